"""Log-mel frontend on hand-checkable cases: frame counts, the silence floor, preemphasis, window, filters,
and the streaming frontend against the whole-utterance one."""

import math

import mlx.core as mx
import numpy as np
import pytest

from services.common.config import PreprocessorConfig
from services.perception.mel import MelStream, analysis_window, frame_count, log_mel, mel_filterbank, preemphasize

CFG = PreprocessorConfig()
HOP, FRAME = 160, 1280


def _noise(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 0.1


@pytest.mark.parametrize("n", [257, 1280, 1281, 16000, 16159])
def test_frame_count_is_one_plus_len_over_hop(n):
    assert frame_count(n, CFG) == 1 + n // HOP
    assert log_mel(mx.array(_noise(n)), CFG).shape == (1 + n // HOP, 128)


def test_silence_gives_the_log_guard_floor_everywhere():
    mel = np.array(log_mel(mx.zeros((16000,)), CFG))
    floor = math.log(2.0**-24)  # -16.6355...
    assert mel.shape == (101, 128)
    np.testing.assert_allclose(mel, floor, rtol=0, atol=1e-6)


def test_preemphasis_keeps_the_first_sample_and_subtracts_097_of_the_previous():
    y = np.array(preemphasize(mx.array([1.0, 2.0, 3.0]), 0.97))
    np.testing.assert_allclose(y, [1.0, 2.0 - 0.97, 3.0 - 1.94], rtol=1e-6)
    y = np.array(preemphasize(mx.array([2.0, 3.0]), 0.97, previous=mx.array([1.0])))
    np.testing.assert_allclose(y, [2.0 - 0.97, 3.0 - 1.94], rtol=1e-6)


def test_window_is_a_symmetric_400_hann_centred_in_512():
    w = np.array(analysis_window(CFG))
    assert w.shape == (512,)
    assert np.all(w[:56] == 0) and np.all(w[456:] == 0)
    assert w[56] == 0 and w[455] == 0  # symmetric: both ends of the 400 points are zero
    np.testing.assert_allclose(w[56:456], w[56:456][::-1], atol=1e-7)
    np.testing.assert_allclose(w[56 + 200], 0.5 * (1 - math.cos(2 * math.pi * 200 / 399)), atol=1e-7)


def _slaney_filters_f64(sr=16000, n_fft=512, n_mels=128):
    def hz_to_mel(f):
        return np.where(f < 1000, f * 3 / 200, 15 + np.log(np.maximum(f, 1e-9) / 1000) * 27 / np.log(6.4))

    def mel_to_hz(m):
        return np.where(m < 15, m * 200 / 3, 1000 * np.exp((m - 15) * np.log(6.4) / 27))

    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    pts = mel_to_hz(np.linspace(hz_to_mel(np.array(0.0)), hz_to_mel(np.array(sr / 2)), n_mels + 2))
    out = np.zeros((n_mels, freqs.size))
    for i in range(n_mels):
        lo, mid, hi = pts[i : i + 3]
        tri = np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid))
        out[i] = np.maximum(tri, 0) * 2 / (hi - lo)
    return out


def test_filterbank_matches_an_independent_float64_slaney_build():
    fb = np.array(mel_filterbank(CFG))
    assert fb.shape == (128, 257)
    np.testing.assert_allclose(fb, _slaney_filters_f64(), rtol=0, atol=2e-6)
    assert np.all((fb > 0).sum(axis=1) >= 1)  # every filter covers at least one bin


def test_stream_emits_one_frame_then_eight_per_80ms_and_matches_the_whole_utterance():
    x = _noise(FRAME * 6)
    stream = MelStream(CFG, lookahead=FRAME)
    counts, frames = [], []
    for i in range(6):
        out = np.array(stream.push(mx.array(x[i * FRAME : (i + 1) * FRAME])))
        counts.append(out.shape[0])
        frames.append(out)
    assert counts == [1, 8, 8, 8, 8, 8]
    streamed = np.concatenate(frames)
    whole = np.array(log_mel(mx.array(x), CFG))
    # same samples per frame; only the FFT batch differs (MLX's CPU FFT rounds per batch layout)
    np.testing.assert_allclose(streamed, whole[: streamed.shape[0]], rtol=0, atol=5e-4)
    # the retained tail stays bounded: two frames of look-behind plus the lookahead
    assert stream.samples.shape[0] <= FRAME + 3 * HOP


@pytest.mark.parametrize("chunk", [333, 2000, FRAME * 6])
def test_stream_output_does_not_depend_on_push_size(chunk):
    x = _noise(FRAME * 6, seed=1)
    ref = MelStream(CFG, lookahead=FRAME)
    expected = np.concatenate([np.array(ref.push(mx.array(x[i : i + FRAME]))) for i in range(0, x.size, FRAME)])
    stream = MelStream(CFG, lookahead=FRAME)
    got = np.concatenate([np.array(stream.push(mx.array(x[i : i + chunk]))) for i in range(0, x.size, chunk)])
    np.testing.assert_allclose(got, expected, rtol=0, atol=5e-4)


def test_stream_lookahead_must_cover_half_the_window():
    with pytest.raises(ValueError, match="lookahead"):
        MelStream(CFG, lookahead=100)


def test_too_short_waveform_is_rejected():
    with pytest.raises(ValueError, match="samples"):
        log_mel(mx.zeros((100,)), CFG)
