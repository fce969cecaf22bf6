"""RNNT greedy decoding on hand-built joints: blank-only frames, the max_symbols cap, special pieces, deltas."""

import mlx.core as mx
import numpy as np
import pytest

from services.common.layers import Embedding, Linear
from services.perception.rnnt import (
    RNNT,
    JointNetwork,
    LSTMLayer,
    PredictionNetwork,
)
from services.perception.vocabulary import is_special_piece, pieces_to_text

H = 4
VOCAB = ["<unk>", "<en-US>", "\u2581hel", "lo", "\u2581world", "<pad>"]
BLANK = len(VOCAB)


def _rnnt(favoured: int | None = None, sequence: list[int] | None = None, max_symbols: int = 3) -> RNNT:
    """A joint whose logits ignore its inputs: always `favoured`, or blank when None."""
    rng = np.random.default_rng(0)

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32) * 0.3)

    layers = [LSTMLayer(arr(4 * H, H), arr(4 * H, H), arr(4 * H)) for _ in range(2)]
    prediction = PredictionNetwork(Embedding(arr(BLANK + 1, H)), layers, H)
    bias = np.zeros(BLANK + 1, np.float32)
    bias[BLANK if favoured is None else favoured] = 10.0
    out = Linear(mx.zeros((BLANK + 1, H)), mx.array(bias))
    joint = JointNetwork(Linear(arr(H, H), arr(H)), Linear(arr(H, H), arr(H)), out)
    return RNNT(prediction, joint, VOCAB, BLANK, max_symbols)


FRAME = mx.ones((1, 1, H))


def test_blank_only_frames_emit_nothing_and_leave_the_state_alone():
    rnnt = _rnnt(favoured=None)
    state = rnnt.new_state()
    for _ in range(3):
        assert rnnt.transcript_update(state, FRAME) == ([], "")
    assert state.last_token == BLANK and state.lstm is None and state.token_ids == [] and state.text == ""


def test_max_symbols_bounds_the_loop():
    rnnt = _rnnt(favoured=2, max_symbols=3)
    state = rnnt.new_state()
    emitted, delta = rnnt.transcript_update(state, FRAME)
    assert emitted == [2, 2, 2]
    assert delta == "hel hel hel" and state.text == "hel hel hel"
    assert state.last_token == 2 and state.lstm is not None
    emitted, delta = rnnt.transcript_update(state, FRAME)
    assert emitted == [2, 2, 2] and delta == " hel hel hel"


def test_a_stream_keeps_its_transcript_as_deltas_and_no_ids_between_frames():
    rnnt = _rnnt(favoured=2, max_symbols=2)
    state = rnnt.new_state()
    seen = []
    for _ in range(3):
        _, delta = rnnt.transcript_update(state, FRAME)
        seen.append(state.so_far())
        assert state.token_ids == []  # the frame's ids are text now: nothing grows but the transcript
    assert state.deltas == ["hel hel", " hel hel", " hel hel"] and state.text == "hel hel hel hel hel hel"
    # each frame's transcript reads as it was at that frame, though the deltas went on growing
    assert [str(s) for s in seen] == ["hel hel", "hel hel hel hel", "hel hel hel hel hel hel"]


def test_special_pieces_advance_the_predictor_but_not_the_text():
    rnnt = _rnnt(favoured=1, max_symbols=2)  # <en-US>
    state = rnnt.new_state()
    assert rnnt.transcript_update(state, FRAME) == ([1, 1], "")
    assert state.last_token == 1 and state.lstm is not None and state.token_ids == []


def test_pieces_map_word_start_to_space_and_drop_specials():
    assert pieces_to_text([1, 2, 3, 0, 4, 5], VOCAB) == "hello world"
    assert pieces_to_text([99], VOCAB) == ""
    assert is_special_piece("<fr-FR>") and is_special_piece("</s>") and not is_special_piece("<b>")


def test_lstm_layer_matches_the_gate_equations():
    rng = np.random.default_rng(3)
    wx, wh, b = (rng.standard_normal(s).astype(np.float32) for s in ((8, 3), (8, 2), (8,)))
    x, h, c = (rng.standard_normal(s).astype(np.float32) for s in ((1, 3), (1, 2), (1, 2)))
    h2, c2 = LSTMLayer(mx.array(wx), mx.array(wh), mx.array(b))(mx.array(x), mx.array(h), mx.array(c))
    g = x @ wx.T + h @ wh.T + b
    sig = 1 / (1 + np.exp(-g))
    i, f, gg, o = sig[:, :2], sig[:, 2:4], np.tanh(g[:, 4:6]), sig[:, 6:]
    c_ref = f * c + i * gg
    np.testing.assert_allclose(np.array(c2), c_ref, atol=1e-5)
    np.testing.assert_allclose(np.array(h2), o * np.tanh(c_ref), atol=1e-5)


@pytest.mark.parametrize("token", [None, 3])
def test_prediction_output_is_the_top_layer_hidden(token):
    rnnt = _rnnt()
    out, (hs, cs) = rnnt.prediction(token, None)
    assert out.shape == (1, 1, H) and len(hs) == len(cs) == 2
    np.testing.assert_array_equal(np.array(out[0]), np.array(hs[-1]))


def _one_at_a_time(rnnt, state, frame):
    """Greedy decoding one step and one host read at a time, as the proposals must reproduce it."""
    enc_proj, emitted = rnnt.joint.enc(frame), []
    while len(emitted) < rnnt.max_symbols:
        token = None if state.last_token == rnnt.blank else state.last_token
        pred, proposed = rnnt.prediction(token, state.lstm)
        best = int(mx.argmax(rnnt.joint(enc_proj, pred.astype(frame.dtype))))
        if best == rnnt.blank:
            break
        state.last_token, state.lstm = best, proposed
        emitted.append(best)
    return emitted


@pytest.mark.parametrize("max_symbols", [1, 2, 3, 5])
def test_proposed_steps_emit_what_one_step_at_a_time_emits(max_symbols):
    rng = np.random.default_rng(4)

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    layers = [LSTMLayer(arr(4 * H, H), arr(4 * H, H), arr(4 * H)) for _ in range(2)]
    prediction = PredictionNetwork(Embedding(arr(BLANK + 1, H)), layers, H)
    bias = np.zeros(BLANK + 1, np.float32)
    bias[BLANK] = 2.0  # blank often enough that frames end after different numbers of symbols
    joint = JointNetwork(Linear(arr(H, H), arr(H)), Linear(arr(H, H), arr(H)),
                         Linear(arr(BLANK + 1, H), mx.array(bias)))
    rnnt = RNNT(prediction, joint, VOCAB, BLANK, max_symbols)
    ours, theirs = rnnt.new_state(), rnnt.new_state()
    counts = []
    for _ in range(40):
        frame = arr(1, 1, H) * 2.0
        emitted = rnnt.decode_frame(ours, frame)
        assert emitted == _one_at_a_time(rnnt, theirs, frame)
        assert ours.last_token == theirs.last_token
        if theirs.lstm is not None:
            for a, b in zip([*ours.lstm[0], *ours.lstm[1]], [*theirs.lstm[0], *theirs.lstm[1]], strict=True):
                assert mx.array_equal(a, b).item()
        counts.append(len(emitted))
    assert 0 in counts and len(set(counts)) > 1  # blank frames and frames of different lengths


def test_a_frame_speculates_as_deep_as_the_last_frame_emitted():
    """Steps built per read: a first busy frame doubles its rounds (2, 4, then the 4 left: three reads); the next
    frame builds all ten steps before its one read; after a blank frame, two steps again."""
    built = []

    def counting(rnnt):
        propose = rnnt.propose

        def counted(state, enc_proj, steps, dtype):
            built.append(steps)
            return propose(state, enc_proj, steps, dtype)

        rnnt.propose = counted
        return rnnt

    busy, quiet = counting(_rnnt(favoured=3, max_symbols=10)), counting(_rnnt(favoured=None, max_symbols=10))
    state = busy.new_state()
    frames = [(busy, [3] * 10, [2, 4, 4]), (busy, [3] * 10, [10]), (quiet, [], [10]), (quiet, [], [2])]
    for rnnt, emitted, steps in frames:
        built.clear()
        assert rnnt.decode_frame(state, FRAME) == emitted
        assert built == steps


def test_an_lstm_with_float32_copies_computes_as_before_for_bf16_and_float32_inputs():
    """The float32 copies serve float32 inputs exactly as MLX's own conversion of the bf16 arrays does, and a
    bf16 input still computes in bf16 with the arrays as stored."""
    rng = np.random.default_rng(5)

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    plain = LSTMLayer(arr(4 * H, H), arr(4 * H, H), arr(4 * H))
    copied = LSTMLayer(plain.Wx, plain.Wh, plain.bias)
    assert all(a.dtype == mx.float32 for a in copied.keep_float32())
    for x_dtype in (mx.bfloat16, mx.float32):
        x = arr(3, H).astype(x_dtype)
        state = (arr(3, H).astype(mx.float32), arr(3, H).astype(mx.float32))
        for h, c in ((None, None), state):
            got, want = copied(x, h, c), plain(x, h, c)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and mx.array_equal(a, b).item()
