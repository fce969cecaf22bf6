"""CodecEngine.decode_batch on the tiny checkpoint: several decode streams stepped together must give what each
stream gives alone, whatever the batch looks like from frame to frame.

On the CPU the batched samples have equalled the solo ones exactly; the tests allow ATOL (float rounding of a
matmul over B rows may differ from one over a single row on other backends)."""

import mlx.core as mx
import numpy as np
import pytest

from services.codec.engine import CodecEngine

ATOL = 1e-5

# Per tick: the streams in the batch, in entry order, and those stepped alone (decode_frame) at that tick.
# a and b start together, c joins at tick 2, d at tick 5; b sits out ticks 4-5 and steps alone at 6, as does d;
# a leaves after tick 7, c after tick 9; orders change so rows are reused in place, as a view, by a take,
# or copied in.
SCHEDULE = [
    ("ab", ""), ("ab", ""), ("abc", ""), ("cba", ""), ("ac", ""), ("acd", ""), ("ac", "bd"), ("abcd", ""),
    ("bcd", ""), ("dcb", ""), ("bd", ""),
]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> CodecEngine:
    return CodecEngine.load(tiny_checkpoint)


def random_codes(engine, frames, seed):
    return np.random.default_rng(seed).integers(0, engine.codebook_size, (frames, engine.num_quantizers), np.int32)


def solo_run(engine, codes):
    """Each frame's samples and the stream after all of them, stepped alone."""
    stream = engine.open_stream()
    return [stream.decode_frame(index, frame) for index, frame in enumerate(codes)], stream


def next_entry(stream, codes):
    """The decode_frame arguments of the stream's next frame: (stream, frame_index, codes)."""
    return stream, stream.next_frame, codes[stream.next_frame]


def context(stream):
    return [np.array(array.astype(mx.float32)) for array in stream.state.arrays()]


def assert_same_stream(got, expected):
    assert got.next_frame == expected.next_frame
    assert got.state.frames_decoded == expected.state.frames_decoded
    assert list(got.state.block_tails) == list(expected.state.block_tails)
    for mine, theirs in zip(context(got), context(expected), strict=True):
        assert mine.shape == theirs.shape
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=ATOL)


def test_streams_batched_in_changing_company_equal_each_stream_alone(engine):
    names = "abcd"
    frames = {name: sum(name in batch + alone for batch, alone in SCHEDULE) for name in names}
    assert frames == {"a": 8, "b": 9, "c": 8, "d": 6}
    codes = {name: random_codes(engine, frames[name], seed) for seed, name in enumerate(names)}
    expected = {name: solo_run(engine, codes[name]) for name in names}

    streams = {name: engine.open_stream() for name in names}
    got: dict[str, list[np.ndarray]] = {name: [] for name in names}
    batched_frames = 0
    for batch, alone in SCHEDULE:
        entries = [next_entry(streams[name], codes[name]) for name in batch]
        ran = [streams[name] for name in batch]
        for name, samples in zip(batch, engine.decode_batch(entries), strict=True):
            got[name].append(samples)
        # the batch ran as one step, fresh streams' first frames too: their contexts are rows of its arrays
        (source,) = {id(engine._rows.source_of(s.state.spec_real)[0]) for s in ran}
        assert engine._rows.source_of(ran[0].state.spec_real)[0].shape[0] == len(batch)
        batched_frames += len(batch)
        for name in alone:
            stream, index, frame = next_entry(streams[name], codes[name])
            got[name].append(stream.decode_frame(index, frame))
    assert batched_frames == 29

    for name in names:
        solo_samples, solo_stream = expected[name]
        assert len(got[name]) == frames[name]
        for mine, theirs in zip(got[name], solo_samples, strict=True):
            assert mine.shape == (engine.samples_per_frame,) and mine.dtype == np.float32
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=ATOL)
        assert np.abs(np.concatenate(got[name])).max() > 0.01  # real audio, not silence
        assert_same_stream(streams[name], solo_stream)


def test_a_batch_of_one_is_the_solo_path_bit_for_bit(engine):
    codes = random_codes(engine, 4, seed=7)
    solo, _ = solo_run(engine, codes)
    stream = engine.open_stream()
    for index, frame in enumerate(codes):
        [samples] = engine.decode_batch([(stream, index, frame)])
        np.testing.assert_array_equal(samples, solo[index])
    assert stream.next_frame == stream.state.frames_decoded == 4


def test_streams_opening_together_decode_their_first_frames_as_one_step(engine):
    """Fresh streams join a batch with the zeros their first frame would pad with: one step for all of them
    (a started stream beside them too), each frame and context what the stream alone gives."""
    codes = [random_codes(engine, 3, seed) for seed in range(30, 34)]
    expected = [solo_run(engine, c) for c in codes]
    streams = [engine.open_stream() for _ in codes]
    got = [[stream.decode_frame(0, codes[0][0])] for stream in streams[:1]] + [[] for _ in streams[1:]]
    for _ in range(3):
        entries = [(s, s.next_frame, c[s.next_frame]) for s, c in zip(streams, codes, strict=True)
                   if s.next_frame < len(c)]
        for (s, _, _), samples in zip(entries, engine.decode_batch(entries), strict=True):
            got[streams.index(s)].append(samples)
        sources = {id(engine._rows.source_of(s.state.spec_real)[0]) for s, _, _ in entries}
        assert len(sources) == 1  # one step, fresh and started alike
    for (solo, solo_stream), mine, stream in zip(expected, got, streams, strict=True):
        for a, b in zip(mine, solo, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)
        assert_same_stream(stream, solo_stream)
    fresh = engine._fresh_context()
    assert not any(mx.any(z).item() for z in fresh)
    assert [(z.shape, z.dtype) for z in fresh] == [(a.shape, a.dtype) for a in streams[0].state.arrays()]


def test_a_bad_entry_gets_its_error_and_leaves_every_stream_right(engine):
    codes = {name: random_codes(engine, 4, seed) for seed, name in enumerate("pqrs", start=20)}
    expected = {name: solo_run(engine, codes[name]) for name in codes}
    streams = {name: engine.open_stream() for name in codes}
    for name, stream in streams.items():  # all started, so the good ones batch together
        for index in range(2):
            stream.decode_frame(index, codes[name][index])

    q, s = streams["q"], streams["s"]
    q_before, s_before = list(q.state.arrays()), list(s.state.arrays())
    bad_code = codes["q"][2].copy()
    bad_code[3] = engine.codebook_size
    results = engine.decode_batch([
        (streams["p"], 2, codes["p"][2]),
        (q, 2, bad_code),
        (streams["r"], 2, codes["r"][2]),
        (s, 3, codes["s"][3]),
        (streams["p"], 3, codes["p"][3]),
    ])
    assert isinstance(results[1], ValueError)
    assert f"code {engine.codebook_size} is out of range" in str(results[1])
    assert isinstance(results[3], ValueError)
    assert "frame_index 3 is out of order: this stream expects 2" in str(results[3])
    assert isinstance(results[4], ValueError) and "appears twice" in str(results[4])
    for i, name in ((0, "p"), (2, "r")):
        np.testing.assert_allclose(results[i], expected[name][0][2], rtol=0, atol=ATOL)
    for stream, before in ((q, q_before), (s, s_before)):  # untouched: the very same arrays
        assert stream.next_frame == stream.state.frames_decoded == 2
        assert all(mine is theirs for mine, theirs in zip(stream.state.arrays(), before, strict=True))

    wrong_shape = engine.decode_batch([(q, 2, codes["q"][2:3]), (s, 2, codes["s"][2].astype(np.float32))])
    assert "codes must have shape (31,), got (1, 31)" in str(wrong_shape[0])
    assert "codes must be integers, got dtype float32" in str(wrong_shape[1])

    for index in (2, 3):  # the rejected streams carry on, batched with the others, equal to solo
        names = [name for name in "pqrs" if streams[name].next_frame == index]
        results = engine.decode_batch([next_entry(streams[name], codes[name]) for name in names])
        for name, samples in zip(names, results, strict=True):
            np.testing.assert_allclose(samples, expected[name][0][index], rtol=0, atol=ATOL)
    for name in codes:
        assert_same_stream(streams[name], expected[name][1])


def test_the_same_batch_again_reuses_its_context_without_copies(engine):
    streams = [engine.open_stream() for _ in range(3)]
    codes = [random_codes(engine, 3, seed) for seed in range(30, 33)]
    for stream, frames in zip(streams, codes, strict=True):
        stream.decode_frame(0, frames[0])
    engine.decode_batch([(stream, 1, frames[1]) for stream, frames in zip(streams, codes, strict=True)])
    from services.codec.engine import _context

    last = [engine._rows.source_of(a)[0] for a in _context(engine.codec, streams[0].state)]
    states = [stream.state for stream in reversed(streams)]
    order, stacked = engine._stack_contexts(states)
    assert order == [2, 1, 0]  # rows in the last batch's order, whatever the entries' order
    assert all(mine is theirs for mine, theirs in zip(stacked, last, strict=True))
    streams[1].decode_frame(2, codes[1][2])  # a solo step gives the stream arrays of its own: copied in again
    order, stacked = engine._stack_contexts([stream.state for stream in streams])
    assert order == [0, 2, 1]
    assert all(array.shape[0] == 3 for array in stacked)
    assert not any(mine is theirs for mine, theirs in zip(stacked, last, strict=True))
