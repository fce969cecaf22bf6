"""The log-mel front end of several streams as one computation (`push_stacked`, and `push_batch` through it,
which also builds the encoder windows as one array, `begin_stacked`) gives exactly what each stream's own pushes
give, as streams join late, push solo in between and leave.

On this CPU the stacked rfft and filterbank matmul round exactly as the per-stream ones (asserted bit for bit);
elsewhere a batched matmul may round differently, so off the CPU the bound is MEL_TOL.
"""

import mlx.core as mx
import numpy as np
import pytest

from services.common.config import PreprocessorConfig
from services.perception import mel as mel_module
from services.perception import streaming as streaming_module
from services.perception.engine import PerceptionEngine
from services.perception.mel import MelStream, push_stacked

CFG = PreprocessorConfig()
FRAME = 1280
FRAMES = 10
EXACT = mx.default_device() == mx.cpu
MEL_TOL = 1e-4


def _audio(k: int, frames: int = FRAMES) -> np.ndarray:
    rng = np.random.default_rng(50 + k)
    return (rng.standard_normal(FRAME * frames) * (0.05 + 0.1 * k)).astype(np.float32)


def _chunk(audio: np.ndarray, f: int) -> np.ndarray:
    return audio[f * FRAME : (f + 1) * FRAME]


def _assert_equal(expected: mx.array, got: mx.array) -> None:
    a, b = np.array(expected), np.array(got)
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    if EXACT:
        assert np.array_equal(a, b)
    else:
        np.testing.assert_allclose(b, a, rtol=0, atol=MEL_TOL)


def _state(stream: MelStream) -> tuple:
    return stream.total, stream.offset, stream.next_frame, np.array(stream.samples).tolist()


def test_stacked_pushes_equal_solo_as_streams_join_push_solo_and_leave():
    audio = [_audio(k) for k in range(4)]
    expected = []
    for a in audio:
        solo = MelStream(CFG, lookahead=FRAME)
        expected.append([solo.push(mx.array(_chunk(a, f))) for f in range(FRAMES)])
        mx.eval(expected[-1])
    assert [e.shape[0] for e in expected[0]] == [1] + [8] * (FRAMES - 1)
    streams = [MelStream(CFG, lookahead=FRAME) for _ in audio]
    start = [0, 0, 1, 3]  # the tick each stream starts: 2 and 3 join the stack late
    stop = [FRAMES, FRAMES, FRAMES + 1, 8]  # 3 leaves early
    solo_ticks = {(1, 5), (0, 7)}  # (stream, tick): that stream pushes alone, outside the stack
    got = [[] for _ in audio]
    stacked_sizes = []
    for tick in range(FRAMES + 1):
        layouts: dict[tuple, list] = {}
        for k, stream in enumerate(streams):
            f = tick - start[k]
            if not 0 <= f < FRAMES or tick >= stop[k]:
                continue
            x = _chunk(audio[k], f)
            if (k, tick) in solo_ticks:
                got[k].append(stream.push(mx.array(x)))
            else:  # first pushes share a layout (empty buffers), second ones another, then all share one
                layouts.setdefault(stream.layout(FRAME), []).append((k, x, f))
        assert len([m for m in layouts.values() if len(m) > 1]) <= 2
        for members in layouts.values():
            if len(members) == 1:
                k, x, _ = members[0]
                got[k].append(streams[k].push(mx.array(x)))
                continue
            out = push_stacked([streams[k] for k, *_ in members], mx.array(np.stack([x for _, x, _ in members])))
            k, _, f = members[0]
            assert out.shape == (len(members), expected[k][f].shape[0], CFG.features)  # a first push emits 1 frame
            stacked_sizes.append((len(members), out.shape[1]))
            for j, (k, *_) in enumerate(members):
                got[k].append(out[j])
        mx.eval([g[-1] for g in got if g], [s.samples for s in streams])
    sizes = {size for size, _ in stacked_sizes}
    assert 4 in sizes and 3 in sizes and 2 in sizes
    assert (2, 1) in stacked_sizes  # streams 0 and 1 took their first pushes stacked
    for k in range(4):
        assert len(got[k]) == min(stop[k] - start[k], FRAMES)
        for e, g in zip(expected[k][: len(got[k])], got[k], strict=True):
            _assert_equal(e, g)
    # every stream's buffer and counters are its solo stream's: it continues solo, equal
    for k in (0, 1, 2):
        solo = MelStream(CFG, lookahead=FRAME)
        for f in range(FRAMES):
            solo.push(mx.array(_chunk(audio[k], f)))
        assert _state(streams[k]) == _state(solo)
        more = _audio(10 + k, 1)
        _assert_equal(solo.push(mx.array(more)), streams[k].push(mx.array(more)))


def test_layouts_group_streams_by_their_buffer_and_refuse_a_mismatch():
    a, b = MelStream(CFG, lookahead=FRAME), MelStream(CFG, lookahead=FRAME)
    assert a.layout(FRAME) == b.layout(FRAME) is not None  # first pushes, nothing retained yet: one layout
    assert a.layout(FRAME)[0] == 0
    a.push(mx.array(_audio(0, 1)))
    b.push(mx.array(_audio(1, 1)))
    assert a.layout(FRAME) == b.layout(FRAME) is not None
    assert a.layout(100) is None  # emits nothing: 100 samples do not complete a frame
    b.push(mx.array(_audio(2, 1)))  # b one frame ahead: its buffer is trimmed, a's not yet
    assert a.layout(FRAME) != b.layout(FRAME)
    with pytest.raises(ValueError, match="one layout"):
        push_stacked([a, b], mx.zeros((2, FRAME)))
    a.push(mx.array(_audio(3, 1)))  # caught up: b's absolute offset is a's, the buffers line up again
    assert a.layout(FRAME) == b.layout(FRAME)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return PerceptionEngine.load(tiny_checkpoint)


def test_push_batch_runs_the_mel_front_end_once_and_equals_solo(engine, monkeypatch):
    assert engine.frame_samples == FRAME
    frames = 16
    audio = [_audio(k, frames) for k in range(3)]
    expected = []
    for a in audio:
        stream = engine.open_stream()
        expected.append([stream.push(_chunk(a, f)) for f in range(frames)])
    calls = {"push_stacked": [], "begin_stacked": []}

    def spy(module, name):
        original = getattr(module, name)

        def counted(streams, *args, **kwargs):
            calls[name].append(len(streams))
            return original(streams, *args, **kwargs)

        monkeypatch.setattr(f"services.perception.engine.{name}", counted)

    spy(mel_module, "push_stacked")
    spy(streaming_module, "begin_stacked")
    streams = [engine.open_stream() for _ in audio]
    f = [0, 0, 0]
    got = [[] for _ in audio]
    for tick in range(frames + 4):
        # 0 and 1 from the start, 2 joins at tick 4; 1 pushes alone at tick 8; 0 leaves after 12 frames
        ks = [k for k in range(3) if f[k] < frames and (k != 2 or tick >= 4) and not (k == 0 and f[k] >= 12)]
        if tick == 8:
            got[1].append(streams[1].push(_chunk(audio[1], f[1])))
            f[1] += 1
            ks.remove(1)
        entries = [(streams[k], _chunk(audio[k], f[k])) for k in ks]
        for k, out in zip(ks, engine.push_batch(entries) if entries else [], strict=True):
            got[k].append(out)
            f[k] += 1
        if tick == 7:  # the stacked buffers stay rows of one array: the next stack gathers them without a copy
            rows = [s.mel.samples for s in streams]
            assert engine._rows.gather(rows, squeeze=True) is engine._rows.gather(rows, squeeze=True)
            rows = [s.encoder.mel_cache for s in streams]
            assert engine._rows.gather(rows) is engine._rows.gather(rows)
    for sizes in calls.values():  # the front end and the windows ran stacked, not per session
        assert max(sizes) == 3 and 2 in sizes
    for k in range(3):
        for e, g in zip(expected[k][: len(got[k])], got[k], strict=True):
            assert g.frame_index == e.frame_index and g.token_ids == e.token_ids and g.transcript == e.transcript
            for x, y in ((e.audio_embedding, g.audio_embedding), (e.encoder_out, g.encoder_out)):
                if EXACT:
                    assert np.array_equal(np.array(x), np.array(y))
                else:
                    np.testing.assert_allclose(np.array(y), np.array(x), rtol=0, atol=1e-5)
    assert len(got[0]) == 12 and len(got[1]) == len(got[2]) == frames
