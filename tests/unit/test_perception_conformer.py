"""FastConformer pieces on hand-checkable cases, and the streaming door against the whole-sequence door."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from services.common.checkpoint import Weights
from services.common.config import EncoderConfig
from services.perception.conformer import (
    Conv,
    chunked_limited_mask,
    pointwise,
    rel_positions,
    rel_shift,
    subsampled_length,
)
from services.perception.engine import PerceptionEngine
from services.perception.streaming import EncoderStream


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return PerceptionEngine.load(tiny_checkpoint)


def test_subsampled_length_of_128_mel_frames_is_17():
    # The issue (and spec) say 16; the reference's formula floor(n / 2) + 1 per stride-2 step gives 65, 33, 17.
    assert subsampled_length(128, 3) == 17
    assert [subsampled_length(n, 1) for n in (1, 2, 3, 128)] == [1, 2, 2, 65]
    assert subsampled_length(1, 3) == 1 and subsampled_length(9, 3) == 2 and subsampled_length(516, 3) == 66
    assert EncoderConfig().subsampled_features == 17  # the frequency axis follows the same rule


def test_subsampling_output_shape_follows_the_length_rule(engine):
    cfg = engine.encoder.cfg
    out = engine.encoder.pre_encode(mx.zeros((1, 128, cfg.feat_in)))
    assert out.shape == (1, 17, cfg.d_model)


def test_pointwise_convs_as_matmuls_and_one_depthwise_step_equal_the_convs_bit_for_bit():
    mx.random.seed(3)
    stored = {"pw1.weight": mx.random.normal((48, 1, 32)).astype(mx.bfloat16), "pw1.bias": mx.random.normal((48,)),
              "pw2.weight": mx.random.normal((16, 1, 1, 8)), "pw2.bias": mx.random.normal((16,)),
              "dw.weight": mx.random.normal((32, 9, 1)), "dw.bias": mx.random.normal((32,)),
              "wide.weight": mx.random.normal((16, 3, 8))}
    weights = Weights(SimpleNamespace(path="test", quant_spec=lambda module: None), stored)
    x = mx.random.normal((2, 5, 32))
    one_d = pointwise(weights, "pw1")
    assert mx.array_equal(one_d(x), mx.conv1d(x, stored["pw1.weight"]) + stored["pw1.bias"])
    grid = mx.random.normal((1, 3, 4, 8))  # (B, T, F, C): the subsampling's 2-D pointwise conv
    assert mx.array_equal(pointwise(weights, "pw2")(grid), mx.conv2d(grid, stored["pw2.weight"]) + stored["pw2.bias"])
    depthwise = Conv.from_weights(weights, "dw", groups=32)
    for steps in (1, 4):  # one output step takes the multiply-and-sum form, longer inputs the conv
        window = mx.random.normal((3, 8 + steps, 32))
        out = depthwise(window)
        assert out.shape == (3, steps, 32)
        assert mx.array_equal(out, mx.conv1d(window, stored["dw.weight"], groups=32) + stored["dw.bias"])
    with pytest.raises(ValueError, match="1x1 kernel"):
        pointwise(weights, "wide")


def test_mask_allows_exactly_self_and_the_left_context():
    m = np.array(chunked_limited_mask(4, 2, 0))
    allowed = m == 0
    assert allowed.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [False, True, True, True],
    ]
    assert np.all(m[~allowed] == -1e30)
    m = np.array(chunked_limited_mask(100, 70, 0))
    i, j = np.indices(m.shape)
    np.testing.assert_array_equal(m == 0, (j <= i) & (j >= i - 70))


def test_rel_shift_on_a_hand_indexed_example():
    # x[i, p] = 10 i + p over positions p = 0..4 meaning relative offsets +2 .. -2; query i vs key j sits at
    # p = 2 - (i - j), so the first three columns must read 10 i + 2 - i + j.
    x = mx.array([[[[10 * i + p for p in range(5)] for i in range(3)]]], dtype=mx.float32)
    out = np.array(rel_shift(x))[0, 0, :, :3]
    assert out.tolist() == [[2, 3, 4], [11, 12, 13], [20, 21, 22]]
    one = mx.array(np.arange(7, dtype=np.float32).reshape(1, 1, 1, 7))  # one query: the attention skips the shift
    assert mx.array_equal(rel_shift(one), one).item()


def test_rel_positions_centre_row_is_position_zero():
    pe = np.array(rel_positions(4, 8))
    assert pe.shape == (1, 7, 8)
    np.testing.assert_array_equal(pe[0, 3], [0, 1] * 4)  # sin(0), cos(0)
    np.testing.assert_allclose(pe[0, 0, 0], np.sin(3.0), atol=1e-6)  # first row: position +3, channel 0
    np.testing.assert_allclose(pe[0, 6, 0], np.sin(-3.0), atol=1e-6)


def test_block_step_with_caches_equals_the_masked_whole_sequence(engine):
    """The streaming door of every layer, one frame at a time, reproduces the whole-sequence door."""
    enc = engine.encoder
    cfg = enc.cfg
    length = cfg.left_context + 8  # long enough that the window slides
    x = mx.array(np.random.default_rng(0).standard_normal((1, length, cfg.d_model)).astype(np.float32))
    pos = rel_positions(length, cfg.d_model)
    mask = chunked_limited_mask(length, cfg.left_context, cfg.right_context)
    whole = x
    for layer in enc.layers:
        whole = layer(whole, layer.attn.positions(pos), mask, cfg.conv_padding)
    attn, conv = enc.empty_caches()
    steps = []
    for t in range(length):
        h, attn, conv = enc.step(x[:, t : t + 1], attn, conv)
        steps.append(np.array(h[0, 0]))
        assert attn[0].shape[1] == min(t + 1, cfg.left_context)
    np.testing.assert_allclose(np.stack(steps), np.array(whole[0]), rtol=0, atol=1e-4)


def test_a_stream_caches_key_value_projections_and_projects_only_its_new_frames(engine, monkeypatch):
    """Each layer's attention cache holds the key and value projections of its last left-context inputs, so a
    step projects its one new frame, never the window again (its query, key and value in one matmul); the
    cache's rows are exactly those projections."""
    enc = engine.encoder
    cfg = enc.cfg
    projected = []  # the rows each projection call projected
    project = type(enc.layers[0].attn).project
    monkeypatch.setattr(type(enc.layers[0].attn), "project",
                        lambda attn, x: projected.append(x.shape[1]) or project(attn, x))
    x = mx.array(np.random.default_rng(2).standard_normal((1, cfg.left_context + 3, cfg.d_model)).astype(np.float32))
    attn, conv = enc.empty_caches()
    inputs = []  # layer 0's attention input of every frame
    norm = enc.layers[0].norm_att
    for t in range(x.shape[1]):
        frame = x[:, t : t + 1]
        inputs.append(norm(frame + 0.5 * enc.layers[0].ff1(enc.layers[0].norm_ff1(frame))))
        _, attn, conv = enc.step(frame, attn, conv)
    assert projected == [1] * (cfg.n_layers * x.shape[1])
    assert attn[0].shape == (1, cfg.left_context, 2 * cfg.d_model)
    expected = enc.layers[0].attn.keys_values(mx.concatenate(inputs[-cfg.left_context :], axis=1))
    np.testing.assert_array_equal(np.array(attn[0]), np.array(expected))


def test_encoder_stream_gives_one_frame_per_80ms_and_tracks_the_offline_encoder(engine):
    cfg = engine.encoder.cfg
    mel = mx.array(np.random.default_rng(1).standard_normal((1, 1 + 8 * 12, cfg.feat_in)).astype(np.float32))
    offline = np.array(engine.encoder(mel)[0])
    stream = EncoderStream(engine.encoder)
    frames = []
    for lo, hi in [(0, 1)] + [(1 + 8 * k, 9 + 8 * k) for k in range(12)]:
        chunks = stream.push(mel[:, lo:hi])
        assert [c.shape[1] for c in chunks] == [1]
        frames.append(np.array(chunks[0][0, 0]))
    assert offline.shape[0] == len(frames) == 13
    # identical context for the first frames; later the zero-started subsampling window drifts a little
    np.testing.assert_allclose(frames[0], offline[0], rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.stack(frames), offline, rtol=0, atol=0.1)
    assert len(stream.arrays()) == 1 + 2 * cfg.n_layers


def test_compiled_streaming_push_equals_the_plain_one_bit_for_bit(tiny_checkpoint, monkeypatch):
    """Past the left context every push runs the compiled step: outputs and transcript as the plain step's. The
    compiled step projects its positions once, on its first push; the plain one projects them every push."""
    compiled, plain = PerceptionEngine.load(tiny_checkpoint), PerceptionEngine.load(tiny_checkpoint)
    plain.encoder.__dict__["compiled_stream_step"] = plain.encoder.stream_step  # shadows the cached property
    frames = plain.encoder.cfg.left_context + 12
    audio = np.random.default_rng(0).standard_normal((frames, plain.frame_samples)).astype(np.float32) * 0.1
    streams = compiled.open_stream(), plain.open_stream()
    projected = []
    attention = type(compiled.encoder.layers[0].attn)
    original = attention.positions
    monkeypatch.setattr(attention, "positions", lambda self, pos: projected.append(pos.shape) or original(self, pos))
    for n, chunk in enumerate(audio):
        if n == plain.encoder.cfg.left_context:  # the filling pushes are over: they project their own
            projected.clear()
        a, b = (stream.push(chunk) for stream in streams)
        assert mx.array_equal(a.encoder_out, b.encoder_out).item()
        assert mx.array_equal(a.audio_embedding, b.audio_embedding).item()
        assert (a.token_ids, a.transcript) == (b.token_ids, b.transcript)
    assert streams[0].encoder.attn_caches[0].shape[1] == plain.encoder.cfg.left_context
    keys = plain.encoder.cfg.left_context + 1
    pushes = frames - plain.encoder.cfg.left_context  # the plain step's, each projecting; one of the compiled's
    assert projected == [(1, 2 * keys - 1, plain.encoder.cfg.d_model)] * plain.encoder.cfg.n_layers * (pushes + 1)
