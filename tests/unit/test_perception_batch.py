"""PerceptionEngine.push_batch: several sessions' frames as one step give what each session's own pushes give.

Sessions start staggered and leave early, the batch composition changes every few frames, sessions step solo
between batched steps, and a bad frame in a batch fails alone. On this machine the batched floats equal the solo
ones bit for bit (max-abs 0); the bound asserted leaves room for a batched matmul's rounding on other kernels.
"""

import mlx.core as mx
import numpy as np
import pytest

from services.common.layers import Embedding, Linear
from services.perception.engine import PerceptionEngine
from services.perception.rnnt import RNNT, JointNetwork, LSTMLayer, PredictionNetwork

TOL = 1e-5
FRAMES = 28  # the tiny encoder's left context is 12 frames: a session's caches fill over its first 13 pushes


# input gain per checkpoint: the quantized tiny RNNT emits only on loud input
GAIN = {"tiny": 1.0, "tinymix": 15.0}


@pytest.fixture(scope="module", params=sorted(GAIN))
def engine(request, tiny_checkpoint, tinymix_checkpoint):
    engine = PerceptionEngine.load({"tiny": tiny_checkpoint, "tinymix": tinymix_checkpoint}[request.param])
    engine.test_gain = GAIN[request.param]
    return engine


def _audio(engine, k: int) -> np.ndarray:
    """Session k's input: noise of its own level (the tiny RNNTs emit pieces on most such frames)."""
    rng = np.random.default_rng(100 + k)
    level = (0.1 + 0.1 * k) * engine.test_gain
    return (rng.standard_normal(engine.frame_samples * FRAMES) * level).astype(np.float32)


def _frame(engine, audio: np.ndarray, f: int) -> np.ndarray:
    n = engine.frame_samples
    return audio[f * n : (f + 1) * n]


def _solo(engine, audio: np.ndarray, frames: int = FRAMES):
    stream = engine.open_stream()
    return [stream.push(_frame(engine, audio, f)) for f in range(frames)]


@pytest.fixture
def batch_sizes(monkeypatch):
    """The B of every batched step taken (a spy on the engine's batched step)."""
    sizes = []
    original = PerceptionEngine._step_batch

    def spy(self, streams, *args):
        sizes.append(len(streams))
        return original(self, streams, *args)

    monkeypatch.setattr(PerceptionEngine, "_step_batch", spy)
    return sizes


def _assert_same(expected, got, exact: bool = False) -> float:
    assert got.frame_index == expected.frame_index
    assert got.token_ids == expected.token_ids
    assert got.transcript_delta == expected.transcript_delta and got.transcript == expected.transcript
    diff = 0.0
    for a, b in ((expected.audio_embedding, got.audio_embedding), (expected.encoder_out, got.encoder_out)):
        a, b = np.array(a), np.array(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        if exact:
            assert np.array_equal(a, b)
        diff = max(diff, float(np.max(np.abs(a.astype(np.float64) - b))))
    assert diff <= TOL
    return diff


def test_batched_sessions_equal_their_solo_runs_as_the_batch_changes(engine, batch_sizes):
    audio = [_audio(engine, k) for k in range(4)]
    expected = [_solo(engine, a) for a in audio]
    assert sum(len(f.token_ids) for f in expected[2]) > 20  # the inputs exercise the RNNT, not only blanks
    start = [0, 2, 5, 9]  # session 3 joins the batch when the others are already in it
    stop = [FRAMES, 24, FRAMES, FRAMES]  # session 1 leaves early
    streams = [engine.open_stream() for _ in audio]
    got = [[] for _ in audio]
    for tick in range(start[-1] + FRAMES):
        due = [k for k in range(4) if start[k] <= tick < start[k] + stop[k]]
        if tick % 5 == 3:  # some sessions sit this step out and push solo right after the batch
            solo, due = due[:1], due[1:]
        else:
            solo = []
        entries = [(streams[k], _frame(engine, audio[k], tick - start[k])) for k in due]
        for k, out in zip(due, engine.push_batch(entries), strict=True):
            got[k].append(out)
        for k in solo:
            got[k].append(streams[k].push(_frame(engine, audio[k], tick - start[k])))
    diff = 0.0
    for k in range(4):
        assert len(got[k]) == stop[k]
        for e, g in zip(expected[k], got[k], strict=False):
            diff = max(diff, _assert_same(e, g))
        assert streams[k].transcript == expected[k][stop[k] - 1].transcript
    assert diff <= TOL
    # batching really happened, at several sizes
    assert max(batch_sizes) == 4 and {2, 3} <= set(batch_sizes)


def test_sessions_opening_together_take_their_first_push_as_one_step(engine, batch_sizes):
    """Three fresh streams' first pushes run as one batched step (their mel buffers stacked, their windows and
    caches begun together), and every frame after equals each stream's solo run."""
    audio = [_audio(engine, k) for k in range(3)]
    expected = [_solo(engine, a, 6) for a in audio]
    streams = [engine.open_stream() for _ in audio]
    assert all(s.batchable for s in streams)
    got = [[] for _ in audio]
    for f in range(6):
        for k, out in enumerate(engine.push_batch([(s, _frame(engine, a, f)) for s, a in zip(streams, audio,
                                                                                              strict=True)])):
            got[k].append(out)
        if f == 0:
            assert batch_sizes == [3]  # the first pushes: one step, none alone
    assert batch_sizes == [3] * 6
    for k in range(3):
        for e, g in zip(expected[k], got[k], strict=True):
            _assert_same(e, g)


def test_sessions_still_filling_their_caches_batch_padded_and_equal_solo(engine, monkeypatch):
    padded = []
    original = engine.encoder.compiled_padded_stream_step

    def spy(window, lo, hi, attn, conv, key_mask):
        padded.append(np.array(key_mask)[:, 0, 0, :])
        return original(window, lo, hi, attn, conv, key_mask)

    monkeypatch.setitem(engine.encoder.__dict__, "compiled_padded_stream_step", spy)
    audio = [_audio(engine, k) for k in range(3)]
    expected = [_solo(engine, a, 16) for a in audio]
    start = [0, 1, 6]  # every session starts inside the others' filling window
    streams = [engine.open_stream() for _ in audio]
    got = [[] for _ in audio]
    for tick in range(start[-1] + 16):
        due = [k for k in range(3) if start[k] <= tick < start[k] + 16]
        entries = [(streams[k], _frame(engine, audio[k], tick - start[k])) for k in due]
        for k, out in zip(due, engine.push_batch(entries), strict=True):
            got[k].append(out)
    for k in range(3):
        for e, g in zip(expected[k], got[k], strict=True):
            _assert_same(e, g)
        assert [c.shape for c in streams[k].encoder.attn_caches] == [c.shape for c in _solo_caches(engine, audio[k])]
    left = engine.encoder.cfg.left_context
    assert padded and all(mask.shape[1] == left + 1 for mask in padded)
    # a young session's padding is masked, a full one's row is not: both kinds went through the padded step
    assert any((mask[:, :left] < -1e29).any(axis=1).sum() for mask in padded)
    assert any(((mask == 0).all(axis=1)).any() for mask in padded)


def test_filling_sessions_batched_again_take_the_padded_caches_their_last_step_left(engine, monkeypatch):
    """A batched step of sessions still filling their caches gets the last padded step's outputs back as its
    inputs (the same arrays: no padding or stacking copied per session and layer), and equals the solo pushes."""
    from bench.stages import KernelCounter

    seen = []
    original = engine.encoder.compiled_padded_stream_step

    def spy(window, lo, hi, attn, conv, key_mask):
        out = original(window, lo, hi, attn, conv, key_mask)
        seen.append((attn, out[1]))
        return out

    monkeypatch.setitem(engine.encoder.__dict__, "compiled_padded_stream_step", spy)
    audio = [_audio(engine, k) for k in range(3)]
    expected = [_solo(engine, a, 10) for a in audio]
    streams = [engine.open_stream() for _ in audio]
    counts = []
    for tick in range(10):  # the tiny left context is 12: every batched step here is a padded one
        with KernelCounter() as counter:
            outs = engine.push_batch([(s, _frame(engine, a, tick)) for s, a in zip(streams, audio, strict=True)])
        counts.append(counter.take()["top"])
        for k, out in enumerate(outs):
            _assert_same(expected[k][tick], out)
    assert len(seen) >= 5
    for (inputs, _), (_, last) in zip(seen[1:], seen[:-1], strict=True):
        assert all(a is b for a, b in zip(inputs, last, strict=True))
    # every padded step pads what every frame pads (the subsampling's input), the first one once more for the
    # batch's first mel window, but nothing per session and layer: fresh streams' empty caches are the encoder's
    # kept zeros, the same array for each
    first = len(counts) - len(seen)
    pads = [c.get("Pad", 0) for c in counts[first:]]
    assert pads[0] - pads[1] < len(streams) and len(set(pads[1:])) == 1
    left = engine.encoder.cfg.left_context
    assert all(a.shape[1] == left for a in seen[0][0]) and not np.array(mx.concatenate(seen[0][0])).any()


def test_sessions_stepping_together_keep_their_caches_as_the_batchs_arrays(engine, monkeypatch):
    """Sessions whose caches are full, stepping together, hand each full step the last one's output arrays as
    they are: no row is cut per session and layer, none stacked back. A session's caches read between two steps
    (a snapshot) are its solo run's, and the read does not end that."""
    audio = [_audio(engine, k) for k in range(3)]
    read = FRAMES - 4
    solo = _solo_caches(engine, audio[1], read)
    seen = []
    original = engine.encoder.compiled_stream_step

    def spy(window, lo, hi, attn, conv):
        out = original(window, lo, hi, attn, conv)
        seen.append(((attn, conv), (out[1], out[2])))
        return out

    monkeypatch.setitem(engine.encoder.__dict__, "compiled_stream_step", spy)
    streams = [engine.open_stream() for _ in audio]
    cfg = engine.encoder.cfg
    for f in range(FRAMES):
        outs = engine.push_batch([(s, _frame(engine, a, f)) for s, a in zip(streams, audio, strict=True)])
        assert len(outs) == 3
        if f == read - 1:
            snapshot = streams[1].snapshot()
            mine = [snapshot[f"encoder.attn.{n}"] for n in range(len(engine.encoder.layers))]
            for a, b in zip(mine, solo, strict=True):
                assert a.shape == b.shape == (1, cfg.left_context, a.shape[2])
                assert np.max(np.abs(np.array(a) - np.array(b))) <= TOL
    assert len(seen) >= 6 and any(len(inputs[0]) for inputs, _ in seen)
    for (inputs, _), (_, last) in zip(seen[1:], seen[:-1], strict=True):
        assert all(a is b for a, b in zip([*inputs[0], *inputs[1]], [*last[0], *last[1]], strict=True))
    # the engine's rows (RowSources) hold none of the encoder's attention or conv caches
    layer_shapes = {a.shape[1:] for a in [*seen[-1][1][0], *seen[-1][1][1]]}
    assert not any(batched.shape[1:] in layer_shapes for _, batched, _ in engine._rows._rows.values())
    for a, stream in zip(audio, streams, strict=True):
        assert stream.frame_index == FRAMES and stream.transcript == _solo(engine, a)[-1].transcript


def _solo_caches(engine, audio: np.ndarray, frames: int = 16) -> list[mx.array]:
    stream = engine.open_stream()
    for f in range(frames):
        stream.push(_frame(engine, audio, f))
    return stream.encoder.attn_caches


def test_a_batch_of_one_is_the_solo_push_bit_for_bit(engine, batch_sizes):
    audio = _audio(engine, 1)
    expected = _solo(engine, audio)
    stream = engine.open_stream()
    for f in range(FRAMES):
        (out,) = engine.push_batch([(stream, _frame(engine, audio, f))])
        _assert_same(expected[f], out, exact=True)
    assert batch_sizes == []


def test_a_bad_frame_fails_alone_and_leaves_its_session_untouched(engine, batch_sizes):
    audio = [_audio(engine, k) for k in range(3)]
    expected = [_solo(engine, a) for a in audio]
    streams = [engine.open_stream() for _ in audio]
    got = [[] for _ in audio]
    bad_inputs = {15: np.zeros(100, np.float32), 16: np.full(engine.frame_samples, np.nan, np.float32),
                  17: np.zeros(engine.frame_samples, np.int16)}
    f = [0, 0, 0]
    for tick in range(FRAMES + len(bad_inputs)):
        entries, owners = [], []
        for k in range(3):
            if f[k] >= FRAMES:
                continue
            frame = _frame(engine, audio[k], f[k])
            if k == 1 and tick in bad_inputs:
                frame = bad_inputs[tick]
            entries.append((streams[k], frame))
            owners.append(k)
        for k, out in zip(owners, engine.push_batch(entries), strict=True):
            if k == 1 and tick in bad_inputs:
                assert isinstance(out, ValueError)
                continue
            got[k].append(out)
            f[k] += 1
    assert "80 ms" in str(engine.push_batch([(streams[0], np.zeros(3, np.float32))])[0])
    for k in range(3):
        assert len(got[k]) == FRAMES
        for e, g in zip(expected[k], got[k], strict=True):
            _assert_same(e, g)
    assert 3 in batch_sizes and 2 in batch_sizes


def test_a_stream_twice_in_one_batch_is_refused(engine):
    stream = engine.open_stream()
    frame = np.zeros(engine.frame_samples, np.float32)
    with pytest.raises(ValueError, match="more than once"):
        engine.push_batch([(stream, frame), (stream, frame)])
    assert stream.frame_index == 0


def test_the_gathers_of_one_step_share_their_index_array(engine):
    """A step of some sessions, and the full step after it, gather every cache array (one per layer and kind)
    in the same order: that order's index array is made once a step, not once per array."""
    from services.common import cache as rows_module

    audio = [_audio(engine, k) for k in range(3)]
    streams = [engine.open_stream() for _ in audio]
    for f in range(FRAMES - 3):
        engine.push_batch([(s, _frame(engine, a, f)) for s, a in zip(streams, audio, strict=True)])
    for members, f in (([0, 2], FRAMES - 3), ([0, 1, 2], FRAMES - 2)):
        rows_module.take_index.cache_clear()
        engine.push_batch([(streams[b], _frame(engine, audio[b], f)) for b in members])
        made = rows_module.take_index.cache_info()
        assert made.hits >= 4 and made.misses <= 2, made  # one or two orders for every layer's caches


def test_begin_batch_builds_each_sessions_solo_proposal():
    """Fresh sessions (blank token, no LSTM state) and started ones in one batch propose what each would alone."""
    rng = np.random.default_rng(0)
    h, vocab, blank = 8, 6, 6

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    layers = [LSTMLayer(arr(4 * h, h), arr(4 * h, h), arr(4 * h)) for _ in range(2)]
    out = Linear(arr(vocab + 1, h), arr(vocab + 1))
    joint = JointNetwork(Linear(arr(h, h), arr(h)), Linear(arr(h, h), arr(h)), out)
    rnnt = RNNT(PredictionNetwork(Embedding(arr(vocab + 1, h)), layers, h), joint, [f"p{i}" for i in range(vocab)],
                blank, max_symbols=4)
    states = [rnnt.new_state() for _ in range(3)]
    for frame in range(3):  # start sessions 1 and 2 (they emit on random frames), session 0 stays fresh
        for s in states[1:]:
            rnnt.decode_frame(s, arr(1, 1, h) * (frame + 1))
    assert states[0].lstm is None and all(s.lstm is not None for s in states[1:])
    frames = arr(3, 1, h)
    zero = mx.zeros((1, h))
    lstm = tuple([mx.concatenate([s.lstm[part][n] if s.lstm else zero for s in states]) for n in range(2)]
                 for part in range(2))
    batch = rnnt.begin_batch(states, frames, lstm)
    for b, state in enumerate(states):
        solo = rnnt.begin_frame(state, frames[b : b + 1])
        n = solo.ids.shape[0]  # the batch builds as many steps as its busiest session wants
        assert n == rnnt.first_steps(state) and batch.ids.shape[1] == max(rnnt.first_steps(s) for s in states)
        assert np.array(batch.ids[b, :n]).tolist() == np.array(solo.ids).tolist()
        for (bh, bc), (sh, sc) in zip(batch.states[:n], solo.states, strict=True):
            for x, y in zip([*bh, *bc], [*sh, *sc], strict=True):
                assert x[b : b + 1].dtype == y.dtype
                assert np.allclose(np.array(x[b : b + 1]), np.array(y), atol=1e-6, rtol=0)


def test_a_filling_session_padded_as_on_a_gpu_equals_its_plain_pushes_bit_for_bit(engine, monkeypatch):
    """On a GPU a session whose caches still fill runs the padded compiled step; forced here, its frames, caches
    and transcript across the left context equal the plain (unpadded, uncompiled) pushes' exactly."""
    import services.perception.streaming as streaming

    audio = _audio(engine, 3)
    plain = engine.open_stream()
    want = [plain.push(_frame(engine, audio, f)) for f in range(FRAMES)]
    monkeypatch.setattr(streaming, "pad_while_filling", lambda: True)
    padded_steps = []
    original = type(engine.encoder).padded_stream_step

    def spy(self, *args):
        padded_steps.append(args[3][0].shape[0])
        return original(self, *args)

    monkeypatch.setattr(type(engine.encoder), "padded_stream_step", spy)
    engine.encoder.__dict__.pop("compiled_padded_stream_step", None)  # recompile around the spy
    padded = engine.open_stream()
    got = [padded.push(_frame(engine, audio, f)) for f in range(FRAMES)]
    engine.encoder.__dict__.pop("compiled_padded_stream_step", None)
    assert padded_steps and set(padded_steps) == {1}  # traced for the solo stream (batch of one)
    for mine, theirs in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.array(mine.audio_embedding), np.array(theirs.audio_embedding))
        np.testing.assert_array_equal(np.array(mine.encoder_out), np.array(theirs.encoder_out))
        assert mine.transcript_delta == theirs.transcript_delta
    for a, b in zip(padded.encoder.attn_caches + padded.encoder.conv_caches,
                    plain.encoder.attn_caches + plain.encoder.conv_caches, strict=True):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("padded", [False, True], ids=["cpu-paths", "gpu-paths"])
def test_after_precompile_streams_opening_and_pushing_in_any_subsets_trace_nothing(tiny_checkpoint, monkeypatch,
                                                                                   compile_traces, padded):
    """Every compiled step a live service runs is traced at load: after `precompile`, streams opening at
    different ticks and pushing in seeded random subsets (young streams' growing windows batched together,
    filling and full caches mixed, streams leaving) trace no step again. On a GPU (the padded steps of filling
    caches, forced here) a step traced under a live session stalls it."""
    import random

    from services.perception import streaming

    traces = compile_traces
    monkeypatch.setattr(streaming, "pad_while_filling", lambda: padded)
    engine = PerceptionEngine.load(tiny_checkpoint)
    engine.precompile(5)
    assert traces  # the steps were traced at load, through the counting compile
    traces.clear()
    rng = random.Random(3)
    noise = np.random.default_rng(4)
    live = []
    for tick in range(40):
        if len(live) < 5 and rng.random() < 0.35:
            live.append(engine.open_stream())
        due = [s for s in live if rng.random() < 0.8] or live[:1]
        if due:
            results = engine.push_batch([(s, (0.1 * noise.standard_normal(engine.frame_samples)).astype(np.float32))
                                         for s in due])
            assert not any(isinstance(r, Exception) for r in results)
        assert traces == [], f"tick {tick}: a push of {len(due)} of {len(live)} streams traced"
        if live and rng.random() < 0.05:
            live.pop(rng.randrange(len(live)))
    assert len(live) >= 4  # the schedule did reach batches of several streams


def test_a_rounds_proposed_states_are_split_only_for_the_steps_a_row_takes():
    from services.common.cache import RowSources
    from services.perception.engine import _ProposedStates

    class Counting(RowSources):
        def __init__(self):
            super().__init__()
            self.splits = 0

        def split(self, batched, squeeze=False):
            self.splits += 1
            return super().split(batched, squeeze)

    rows, layers, steps, batch = Counting(), 2, 3, 4
    states = [([mx.full((batch, 5), 100.0 * k + n) + mx.arange(batch)[:, None] for n in range(layers)],
               [mx.full((batch, 5), -100.0 * k - n) for n in range(layers)]) for k in range(steps)]
    proposed = _ProposedStates(states, rows)
    assert rows.splits == 0 and len(proposed.row(0)) == steps  # nothing split until a row takes a state
    h, c = proposed.row(2)[1]  # row 2 emitted twice: the state step 1 left
    assert rows.splits == 2 * layers
    assert [np.array(a).tolist() for a in h] == [[[100.0 + n + 2] * 5] for n in range(layers)]
    assert [np.array(a).tolist() for a in c] == [[[-100.0 - n] * 5] for n in range(layers)]
    h, _ = proposed.row(0)[-2]  # another row, the same step: no split again
    assert rows.splits == 2 * layers and np.array(h[0]).tolist() == [[100.0] * 5]
    proposed.row(3)[2]
    assert rows.splits == 4 * layers
    with pytest.raises(IndexError):
        proposed.row(0)[steps]
