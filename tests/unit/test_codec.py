"""The codec modules and engine on the tiny random checkpoint: STFT front/back, shapes, streaming, bad input."""

import math

import mlx.core as mx
import numpy as np
import pytest

from services.codec.codec import Codec, DecodeState
from services.codec.engine import CodecEngine
from services.codec.stft import _overlap_add, edge_padding, hann_window, istft, spectrogram
from services.common.errors import LimitExceeded

N_FFT, HOP = 16, 4


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> CodecEngine:
    return CodecEngine.load(tiny_checkpoint)


@pytest.fixture(scope="module")
def codec(engine) -> Codec:
    return engine.codec


def random_codes(engine, frames, seed=0):
    return np.random.default_rng(seed).integers(0, engine.codebook_size, (frames, engine.num_quantizers), np.int32)


# ---- STFT -------------------------------------------------------------------------------------------


def test_hann_window_is_periodic():
    w = np.array(hann_window(N_FFT))
    assert w.dtype == np.float32 and w.shape == (16,)
    assert w[0] == 0.0 and w[8] == 1.0 and w[4] == pytest.approx(0.5, abs=1e-7)
    np.testing.assert_array_equal(w[1:], w[1:][::-1])  # periodic: symmetric about n = 8, not about 7.5
    assert np.sum(w**2) == pytest.approx(6.0, abs=1e-6)  # 3/8 of 16: four overlapping frames sum to 1.5


def test_edge_padding_and_frame_count():
    assert edge_padding(N_FFT, HOP) == (6, 6)
    spec = spectrogram(mx.zeros((2, 1764)), N_FFT, HOP)
    assert spec.shape == (2, 441, 9) and spec.dtype == mx.complex64  # 1 + (1764 + 12 - 16) // 4 frames


def test_spectrogram_of_a_constant_is_the_window_transform():
    spec = np.array(spectrogram(mx.ones((1, 64)), N_FFT, HOP))[0]
    interior = spec[5]  # a frame that sees no edge padding
    assert interior[0] == pytest.approx(8.0, abs=1e-5)  # sum of the window
    assert interior[1] == pytest.approx(-4.0, abs=1e-5)  # Hann's only other nonzero bin
    np.testing.assert_allclose(np.abs(interior[2:]), 0.0, atol=1e-5)
    assert spec[0, 0] == pytest.approx(float(np.sum(np.array(hann_window(16))[6:])), abs=1e-5)  # 6 zeros in front


def test_codec_features_are_18_channels(engine, codec):
    assert engine.config.stft_channels == 18
    first = codec.encoder_layers[0]
    assert first.weight.shape[-1] == 18  # the 1x1 input conv reads real then imaginary parts of 9 bins


def test_istft_inverts_the_spectrogram():
    x = np.random.default_rng(0).uniform(-0.9, 0.9, (2, 2 * 1764)).astype(np.float32)
    spec = spectrogram(mx.array(x), N_FFT, HOP)
    y = np.array(istft(spec.real, spec.imag, N_FFT, HOP))
    assert y.shape == x.shape
    np.testing.assert_allclose(y, x, atol=2e-6)  # edges too: the norm divides by the window actually present


def test_istft_clips_frames_to_the_window_envelope():
    spec = spectrogram(mx.full((1, 64), 3.0), N_FFT, HOP)
    y = np.array(istft(spec.real, spec.imag, N_FFT, HOP))
    np.testing.assert_allclose(y[0, 8:-8], 1.0, atol=1e-6)  # |frame| <= window means samples of 3 come back as 1


def test_overlap_add_sums_in_frame_order():
    frames = np.random.default_rng(1).standard_normal((2, 7, 16)).astype(np.float32)
    expected = np.zeros((2, 6 * 4 + 16), np.float32)
    for m in range(7):  # the order a sequential scatter-add visits the frames
        expected[:, 4 * m : 4 * m + 16] += frames[:, m]
    np.testing.assert_array_equal(np.array(_overlap_add(mx.array(frames), 4)), expected)


# ---- whole sequence ------------------------------------------------------------------------------------


def test_sizes_come_from_the_config(engine):
    assert engine.samples_per_frame == 1764 == 4 * 7 * 7 * 9
    assert (engine.num_quantizers, engine.sample_rate) == (31, 22050)


def test_decode_gives_1764_samples_per_frame(engine):
    codes = random_codes(engine, 3)
    audio = engine.decode(codes)
    assert audio.shape == (3 * 1764,) and audio.dtype == np.float32
    assert np.isfinite(audio).all() and np.abs(audio).max() <= 1.0 + 1e-6  # frames are clipped to the window
    assert np.abs(audio).max() > 1e-3


def test_decode_is_causal(engine):
    codes = random_codes(engine, 4)
    whole = engine.decode(codes)
    changed = codes.copy()
    changed[3] = (changed[3] + 1) % engine.codebook_size
    other = engine.decode(changed)
    # The last frame only reaches back through the iSTFT overlap (n_fft - hop - 6 = 6 samples).
    np.testing.assert_array_equal(other[: 3 * 1764 - 6], whole[: 3 * 1764 - 6])
    assert not np.array_equal(other[3 * 1764 :], whole[3 * 1764 :])


def test_encode_gives_one_code_frame_per_1764_samples(engine):
    wave = np.random.default_rng(2).uniform(-0.5, 0.5, 2 * 1764 + 1000).astype(np.float32)
    codes = engine.encode(wave)
    assert codes.shape == (2, 31) and codes.dtype == np.int32
    assert codes.min() >= 0 and codes.max() < engine.codebook_size
    # The partial frame is dropped; the STFT's 6-sample look-ahead lets it touch only the last full frame.
    np.testing.assert_array_equal(engine.encode(wave[: 2 * 1764])[:1], codes[:1])


def test_quantize_picks_the_nearest_mean_per_residual(codec):
    # A latent built from chosen means round-trips when each mean dominates the remaining residual.
    means = [np.array(m.astype(mx.float32)) for m in codec.means]
    latent = 50.0 * means[0][5] + 1e-3 * means[1][7]
    codes = np.array(codec.quantize(mx.array(latent[None, None].astype(np.float32))))[0, 0]
    residual = latent.astype(np.float32)
    for q in range(len(means)):
        expected = int(np.argmin(((residual[None] - means[q]) ** 2).sum(-1)))
        assert codes[q] == expected
        residual = residual - means[q][expected]


def test_dequantize_sums_the_chosen_means(codec, engine):
    codes = random_codes(engine, 2)
    latents = np.array(codec.dequantize(mx.array(codes)[None]).astype(mx.float32))[0]
    means = [np.array(m.astype(mx.float32)) for m in codec.means]
    expected = sum(means[q][codes[:, q]] for q in range(len(means)))
    np.testing.assert_allclose(latents, expected, rtol=0.05, atol=0.05)  # bf16 partial sums


def test_encode_prompt_codes_masks_first_and_second_to_last(engine):
    prompt = engine.encode_prompt_codes(5)
    silence = engine.encode(np.zeros(6 * 1764, np.float32))
    assert prompt.shape == (5, 31)
    assert (prompt[0] == engine.codebook_size).all() and (prompt[4] == engine.codebook_size).all()
    np.testing.assert_array_equal(prompt[1:4], silence[1:4])


# ---- streaming -----------------------------------------------------------------------------------------


def stream_decode(engine, codes):
    stream = engine.open_stream()
    return [stream.decode_frame(i, frame) for i, frame in enumerate(codes)]


def test_stream_gives_exactly_1764_samples_per_frame(engine):
    chunks = stream_decode(engine, random_codes(engine, 3))
    assert [c.shape for c in chunks] == [(1764,)] * 3


def test_stream_equals_whole_decode_delayed_by_8_samples(engine):
    codes = random_codes(engine, 5, seed=3)
    whole = engine.decode(codes)
    stream = np.concatenate(stream_decode(engine, codes))
    # The stream holds back 2 spectral frames (8 samples) it cannot finish; past the first 14 samples (the
    # 8-sample delay plus the 6 edge samples whole decode normalises by a partial window) the two agree.
    np.testing.assert_allclose(stream[14:], whole[6:-8], atol=1e-6)
    assert not np.allclose(stream[:8], whole[:8])


@pytest.mark.parametrize("chunk", [2, 3])
def test_stream_in_chunks_equals_frame_by_frame(codec, engine, chunk):
    codes = random_codes(engine, 6, seed=4)
    one = np.concatenate(stream_decode(engine, codes))
    state, pieces = DecodeState(), []
    for start in range(0, 6, chunk):
        pieces.append(np.array(codec.decode_step(mx.array(codes[start : start + chunk])[None], state))[0])
    np.testing.assert_allclose(np.concatenate(pieces), one, atol=1e-6)
    assert state.frames_decoded == 6


def test_compiled_stream_frames_equal_the_plain_step_bit_for_bit(codec, engine):
    codes = random_codes(engine, 8, seed=5)
    stream, state = engine.open_stream(), DecodeState()
    for index, frame in enumerate(codes):
        got = stream.decode_frame(index, frame)  # frames after the first run the compiled step
        expected = np.array(codec.decode_step(mx.array(frame)[None, None], state))[0]
        np.testing.assert_array_equal(got, expected)
    for mine, theirs in zip(stream.state.arrays(), state.arrays(), strict=True):
        assert mx.array_equal(mine, theirs).item()
    assert stream.state.frames_decoded == state.frames_decoded == 8


def test_stream_state_holds_each_block_context(codec, engine):
    stream = engine.open_stream()
    stream.decode_frame(0, random_codes(engine, 1)[0])
    config = engine.config
    blocks = config.blocks_per_stage * len(config.downsample_rates)
    assert sorted(stream.state.block_tails) == list(range(blocks))
    widths = [w for w in reversed(config.stage_channels) for _ in range(config.blocks_per_stage)]
    for index, width in enumerate(widths):
        assert stream.state.block_tails[index].shape == (1, config.block_kernel_size - 1, width)
    assert stream.state.spec_real.shape == (1, 2 * math.ceil(6 / 4), 9)


def test_streams_are_independent(engine):
    a, b = random_codes(engine, 3, seed=5), random_codes(engine, 3, seed=6)
    alone = np.concatenate(stream_decode(engine, a))
    sa, sb = engine.open_stream(), engine.open_stream()
    mixed = []
    for i in range(3):
        mixed.append(sa.decode_frame(i, a[i]))
        sb.decode_frame(i, b[i])
    np.testing.assert_array_equal(np.concatenate(mixed), alone)


# ---- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("codes", "message"),
    [
        (np.full((2, 31), 256, np.int32), r"code 256 is out of range: codes must lie in \[0, 256\)"),
        (np.full((2, 31), -1, np.int32), "code -1 is out of range"),
        (np.zeros((2, 30), np.int32), r"Q=31 codebooks, got shape \(2, 30\)"),
        (np.zeros((0, 31), np.int32), "codes are empty"),
        (np.zeros((2, 31), np.float32), "codes must be integers"),
        (np.zeros((31,), np.int32), r"codes must have shape \(T, 31\)"),
    ],
)
def test_decode_rejects_bad_codes(engine, codes, message):
    with pytest.raises(ValueError, match=message):
        engine.decode(codes)


@pytest.mark.parametrize(
    ("wave", "message"),
    [
        (np.zeros(0, np.float32), "has 0 samples; the codec needs at least 1764"),
        (np.zeros(1763, np.float32), "has 1763 samples"),
        (np.array([np.nan] + [0.0] * 1800, np.float32), "1 non-finite samples"),
        (np.array([np.inf, -np.inf] + [0.0] * 1800, np.float32), "2 non-finite samples"),
        (np.zeros((2, 1764), np.float32), r"mono with shape \(N,\)"),
        (np.zeros(1764, np.int32), "floating point"),
    ],
)
def test_encode_rejects_bad_waveforms(engine, wave, message):
    with pytest.raises(ValueError, match=message):
        engine.encode(wave)


def test_stream_rejects_bad_frames(engine):
    stream = engine.open_stream()
    with pytest.raises(ValueError, match="frame_index 1 is out of order: this stream expects 0"):
        stream.decode_frame(1, np.zeros(31, np.int32))
    with pytest.raises(ValueError, match=r"shape \(31,\)"):
        stream.decode_frame(0, np.zeros((1, 31), np.int32))
    with pytest.raises(ValueError, match="out of range"):
        stream.decode_frame(0, np.full(31, 1000, np.int32))
    stream.decode_frame(0, np.zeros(31, np.int32))  # a rejected frame leaves the stream where it was
    assert stream.next_frame == 1


def test_limits(tiny_checkpoint):
    small = CodecEngine.load(tiny_checkpoint, max_frames=2)
    with pytest.raises(LimitExceeded, match="3 code frames"):
        small.decode(np.zeros((3, 31), np.int32))
    with pytest.raises(LimitExceeded, match="limit of 2"):
        small.encode(np.zeros(3 * 1764, np.float32))


def test_prompt_codes_keep_only_a_few_lengths(engine):
    from services.codec.engine import PROMPT_CODES_KEPT

    first = engine.encode_prompt_codes(3)
    for frames in range(4, 4 + PROMPT_CODES_KEPT + 2):
        engine.encode_prompt_codes(frames)
    assert len(engine._prompt_codes) == PROMPT_CODES_KEPT and 3 not in engine._prompt_codes
    again = engine.encode_prompt_codes(3)  # computed anew, the same codes
    np.testing.assert_array_equal(again, first)
    again[0, 0] = -1  # callers get copies
    np.testing.assert_array_equal(engine.encode_prompt_codes(3), first)
