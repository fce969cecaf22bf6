"""LanguageEngine.step_batch: several sessions' steps as one batched forward, each session's results and state
exactly its own; the batch composition may change at any frame."""

import re

import mlx.core as mx
import numpy as np
import pytest

from services.common.cache import STACK_ALL
from services.common.errors import LimitExceeded
from services.common.loading import LoadOptions
from services.llm.engine import LanguageEngine, _stacked_rows
from services.llm.nemotron_h import BatchedStep
from tests.conftest import GOLDEN
from tests.unit.test_snapshots import crossed

# On CPU the batched matmuls have so far given the very bits of the solo ones (max |diff| 0.0); other devices
# may round a matmul over B rows differently, which this bound allows.
LOGIT_TOLERANCE = 1e-4
FRAMES = 14
# Four sessions: f32 prompts, no prompt (its caches are created at its first step), a bf16 prompt prefix
# (its attention caches stay bf16: it batches only with its own kind).
OPENS = [
    {"system_prompt": "Be concise and answer in one sentence."},
    {"system_prompt": ""},
    {"system_prompt": "Hello there."},
    {"prompt_token_ids": [1, 17, 42, 99, 2]},
]
# frame tick -> the sessions that step at it: staggered starts, one late joiner, one that leaves early (closed),
# ticks with a subset only, and a tick where every session is alone.
SCHEDULE = {
    0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2], 4: [0, 2], 5: [0, 1, 2], 6: [0, 1, 2, 3],
    7: [0, 1, 2, 3], 8: [1], 9: [0, 1, 2, 3], 10: [0, 1, 3], 11: [0, 1, 3], 12: [0, 1, 2, 3],
    13: [0, 1, 3], 14: [0, 3], 15: [0, 1, 3], 16: [0, 1, 3], 17: [0, 1, 3],
}
LEAVES = {2: 12}  # session 2 is closed after its frames at tick 12


@pytest.fixture(scope="module")
def embeds():
    z = np.load(GOLDEN / "offline_prompt.npz")
    return z["audio_embeds"][len(z["prompt_ids"]) :]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tiny4_checkpoint, tinymix_checkpoint):
    return {
        "dense": LanguageEngine.load(tiny_checkpoint, max_prompt_tokens=32),
        "4bit": LanguageEngine.load(tiny4_checkpoint, max_prompt_tokens=32),
        "mixed": LanguageEngine.load(tinymix_checkpoint, max_prompt_tokens=32),
        "4bit-as-bf16": LanguageEngine.load(tiny4_checkpoint, max_prompt_tokens=32, options=LoadOptions("bfloat16")),
    }


@pytest.fixture
def batch_sizes(monkeypatch):
    """The B of every batched forward run."""
    sizes = []
    original = BatchedStep.__call__

    def spy(self, prev_text, *args):
        sizes.append(prev_text.shape[0])
        return original(self, prev_text, *args)

    monkeypatch.setattr(BatchedStep, "__call__", spy)
    return sizes


def _open(engine, k, prefix_dtype="float32"):
    return engine.open_session(**OPENS[k], prefix_dtype="bfloat16" if k == 3 else prefix_dtype)


def _inputs(embeds, k, n):
    """Session k's audio rows: a different stretch of the timeline per session."""
    return [mx.array(row) for row in embeds[5 * k : 5 * k + n]]


def _solo(engine, embeds, k, n):
    return _solo_rows(engine, k, _inputs(embeds, k, n))


def _solo_rows(engine, k, rows):
    session = _open(engine, k)
    outputs = [session.step(row, return_logits=True, frame_index=t) for t, row in enumerate(rows)]
    engine.close_session(session)
    return outputs


def _max_diff(a, b):
    return max(float(mx.abs(a.text_logits - b.text_logits).max()),
               float(mx.abs(a.function_logits - b.function_logits).max()))


def _run_schedule(engine, inputs):
    """SCHEDULE's steps of the four sessions, inputs[k] session k's rows -> (the sessions still open, each
    session's outputs)."""
    sessions, got = {}, [[] for _ in range(4)]
    for tick, ks in SCHEDULE.items():
        for k in ks:
            if k not in sessions:
                sessions[k] = _open(engine, k)  # joins at its first tick
        if tick == 8:  # a lone step through the solo door between batched ones
            got[1].append(sessions[1].step(inputs[1][len(got[1])], True, len(got[1])))
            continue
        steps = [(sessions[k], inputs[k][len(got[k])], True, len(got[k])) for k in ks]
        for k, out in zip(ks, engine.step_batch(steps), strict=True):
            got[k].append(out)
        for k, last in LEAVES.items():
            if tick == last:
                engine.close_session(sessions.pop(k))
    return sessions, got


@pytest.mark.parametrize("name", ["dense", "4bit", "mixed", "4bit-as-bf16"])
def test_a_changing_batch_gives_every_session_its_solo_results(engines, embeds, batch_sizes, name):
    engine = engines[name]
    counts = [sum(k in ks for ks in SCHEDULE.values()) for k in range(4)]
    expected = [_solo(engine, embeds, k, counts[k]) for k in range(4)]
    sessions, got = _run_schedule(engine, [_inputs(embeds, k, counts[k]) for k in range(4)])
    assert [len(g) for g in got] == counts == [17, 15, 8, 11]
    worst = 0.0
    for k in range(4):
        assert [(o.text_id, o.function_id) for o in got[k]] == [(o.text_id, o.function_id) for o in expected[k]]
        for a, b in zip(got[k], expected[k], strict=True):
            assert a.text_logits.shape == a.function_logits.shape == (1024,)
            assert a.text_logits.dtype == mx.float32
            worst = max(worst, _max_diff(a, b))
    assert worst <= LOGIT_TOLERANCE
    assert len({i for g in expected for o in g for i in (o.text_id,)}) > 5  # the ids really vary
    # Batches of 2 and 3 ran (sessions 0, 1, 2 in f32); session 3 (bf16 caches) never had a partner.
    assert set(batch_sizes) == {2, 3}
    for k, session in sessions.items():
        assert session.frames == counts[k]
        assert session.positions == session.prompt_positions + counts[k]
        engine.close_session(session)
    assert engine.live_sessions == 0 and not engine._pools


def test_numpy_rows_step_exactly_as_mlx_rows(engines, embeds, batch_sizes):
    """A service's rows arrive as numpy (one host buffer a batch); session 2 mixes them with MLX rows. Every id
    and logit equals the all-MLX run's, bit for bit, through batches, partial batches and solo steps."""
    engine = engines["dense"]
    counts = [sum(k in ks for ks in SCHEDULE.values()) for k in range(4)]
    rows = [_inputs(embeds, k, counts[k]) for k in range(4)]
    host = [[np.array(row) for row in rows[k]] if k != 2 else
            [np.array(row) if t % 2 else row for t, row in enumerate(rows[k])] for k in range(4)]
    assert isinstance(host[0][0], np.ndarray) and isinstance(host[2][0], mx.array)
    results = []
    for inputs in (rows, host):
        sessions, got = _run_schedule(engine, inputs)
        for session in sessions.values():
            engine.close_session(session)
        results.append(got)
    assert set(batch_sizes) == {2, 3}
    for k in range(4):
        for a, b in zip(*(got[k] for got in results), strict=True):
            assert (a.text_id, a.function_id) == (b.text_id, b.function_id)
            assert mx.array_equal(a.text_logits, b.text_logits) and mx.array_equal(a.function_logits, b.function_logits)


def test_stacked_rows_fill_the_rows_sitting_out_with_zeros():
    a, b = np.arange(4, dtype=np.float32), np.full(4, -0.0, np.float32)
    for rows in ([a, None, b], [mx.array(a), None, b], [a, None, mx.array(b)]):
        out = _stacked_rows(rows)
        assert out.dtype == mx.float32 and out.shape == (3, 4)
        assert np.array_equal(np.array(out), np.stack([a, np.zeros(4, np.float32), b]))
        assert np.signbit(np.array(out)[2]).all()  # the bits as given: -0.0 stays -0.0
    halves = _stacked_rows([None, mx.array(a, dtype=mx.bfloat16)])  # prompt rows keep their dtype
    assert halves.dtype == mx.bfloat16 and np.array_equal(np.array(halves.astype(mx.float32)), np.stack([0 * a, a]))


def test_bf16_prefix_sessions_batch_with_their_own_kind(engines, embeds, batch_sizes):
    engine = engines["4bit-as-bf16"]
    expected = {k: _solo(engine, embeds, k, 6) for k in (0, 2)}
    expected_bf16 = [None, None]
    for j in range(2):
        s = engine.open_session(prompt_token_ids=[1, 17 + j, 42, 2], prefix_dtype="bfloat16")
        expected_bf16[j] = [s.step(row, True) for row in _inputs(embeds, j, 6)]
        engine.close_session(s)
    f32 = [_open(engine, 0), _open(engine, 2)]
    bf16 = [engine.open_session(prompt_token_ids=[1, 17 + j, 42, 2], prefix_dtype="bfloat16") for j in range(2)]
    inputs = [_inputs(embeds, 0, 6), _inputs(embeds, 2, 6), _inputs(embeds, 0, 6), _inputs(embeds, 1, 6)]
    got = [[] for _ in range(4)]
    for t in range(6):
        everyone = [*f32, *bf16]
        for k, out in enumerate(engine.step_batch([(s, inputs[k][t], True, t) for k, s in enumerate(everyone)])):
            got[k].append(out)
    assert batch_sizes == [2, 2] * 6  # one f32 group and one bf16 group per frame
    for k, want in [(0, expected[0]), (1, expected[2]), (2, expected_bf16[0]), (3, expected_bf16[1])]:
        assert [(o.text_id, o.function_id) for o in got[k]] == [(o.text_id, o.function_id) for o in want]
        assert max(_max_diff(a, b) for a, b in zip(got[k], want, strict=True)) <= LOGIT_TOLERANCE
    for s in [*f32, *bf16]:
        engine.close_session(s)


def test_a_batch_of_one_is_the_solo_step_bit_for_bit(engines, embeds, batch_sizes):
    engine = engines["4bit"]
    rows = _inputs(embeds, 1, 5)
    alone, batched = _open(engine, 0), _open(engine, 0)
    history = engine.open_session(full_history=True)  # never batched: its own solo step
    for t, row in enumerate(rows):
        want = alone.step(row, True, t)
        got, with_history = engine.step_batch([(batched, row, True, t), (history, row, False, t)])
        assert (got.text_id, got.function_id) == (want.text_id, want.function_id)
        assert mx.array_equal(got.text_logits, want.text_logits).item()
        assert mx.array_equal(got.function_logits, want.function_logits).item()
        assert with_history.text_logits is None and with_history.function_logits is None
    assert batch_sizes == []
    for s in (alone, batched, history):
        engine.close_session(s)


def _state(session):
    """Everything a step advances, the cached tensors as host copies."""
    return (session.positions, session.frames, session.prev_text, session.prev_function,
            [np.array(a.astype(mx.float32)) for c in session.caches if c is not None for a in c.arrays()])


def _same_state(a, b):
    return a[:4] == b[:4] and all(np.array_equal(x, y) for x, y in zip(a[4], b[4], strict=True))


def test_a_bad_entry_gets_its_error_and_disturbs_nobody(engines, embeds, batch_sizes, monkeypatch):
    from services.llm import engine as engine_module

    engine = engines["dense"]
    n = 8
    expected = [_solo(engine, embeds, k, n) for k in range(3)]
    inputs = [_inputs(embeds, k, n) for k in range(3)]
    sessions = [_open(engine, k) for k in range(3)]
    got = [[] for _ in range(3)]

    def step(ks, bad=None):
        steps = [(sessions[k], inputs[k][len(got[k])], True, len(got[k])) for k in ks]
        if bad is not None:
            steps.insert(1, bad)
        results = engine.step_batch(steps)
        if bad is not None:
            error = results.pop(1)
        for k, out in zip(ks, results, strict=True):
            got[k].append(out)
        return error if bad is not None else None

    step([0, 1, 2])
    step([0, 1, 2])
    before = _state(sessions[2])
    cases = [
        ((sessions[2], inputs[2][2], True, 7), ValueError, "frame_index 7 is out of order; expected 2"),
        ((sessions[2], mx.zeros(127), True, None), ValueError, r"float32 of shape \(128,\); got float32"),
        ((sessions[2], inputs[2][2].astype(mx.float16), False, 2), ValueError, "got float16"),
    ]
    for bad, kind, message in cases:
        error = step([0, 1], bad)
        assert isinstance(error, kind)
        assert re.search(message, str(error))
        assert _same_state(_state(sessions[2]), before)
    step([0, 1, 2])  # the bad one carries on where it was
    step([0, 1, 2])
    # A closed session and a full-history one over its limit: their errors, the others' results.
    gone = _open(engine, 0)
    engine.close_session(gone)
    monkeypatch.setattr(engine_module, "MAX_FULL_HISTORY_POSITIONS", 0)
    history = engine.open_session(full_history=True)
    results = engine.step_batch([(gone, inputs[0][0], False, None), (sessions[0], inputs[0][7], True, 7),
                                 (history, inputs[0][0], False, None), (sessions[1], inputs[1][7], True, 7)])
    assert isinstance(results[0], ValueError) and "is closed" in str(results[0])
    assert isinstance(results[2], LimitExceeded)
    got[0].append(results[1])
    got[1].append(results[3])
    for k in range(3):
        want = expected[k][: len(got[k])]
        assert [(o.text_id, o.function_id) for o in got[k]] == [(o.text_id, o.function_id) for o in want]
        assert max(_max_diff(a, b) for a, b in zip(got[k], want, strict=True)) <= LOGIT_TOLERANCE
    assert [len(g) for g in got] == [8, 8, 4]
    # session 1 (no prompt) takes its first step alone; the steps of two of the three run over all three rows
    assert batch_sizes == [2, 3, 3, 3, 3, 3, 3, 3]
    with pytest.raises(ValueError, match="appears twice"):
        engine.step_batch([(sessions[0], inputs[0][5], False, None)] * 2)
    for s in [*sessions, history]:
        engine.close_session(s)


@pytest.mark.parametrize("share", [0.5, 1.0], ids=["over-all-rows", "rows-taken"])
def test_a_steady_batch_reuses_its_stacked_states_some_keep_them_and_a_leaver_gets_its_own(engines, embeds,
                                                                                           monkeypatch, share):
    """The stacked Mamba states a batch leaves are the next batch's, as they are; a batch of some of the same
    sessions keeps the pool whole, the others' rows unchanged: two of three step over all three rows (at
    MASKED_SHARE 0.5), or take their rows and write them back (at 1.0); a batch that mixes in a session from
    outside drops the pool, and each session it leaves behind gets copies of its own rows. Every session then
    goes on equal to its solo run."""
    engine = engines["dense"]
    monkeypatch.setattr(engine._pools, "masked_share", share)
    layers = engine.model.batched_step.mamba_layers
    inputs = []
    original = BatchedStep.__call__

    def spy(self, prev_text, audio, prev_function, states, *rest):
        inputs.append(states)
        return original(self, prev_text, audio, prev_function, states, *rest)

    monkeypatch.setattr(BatchedStep, "__call__", spy)
    sessions = [_open(engine, k) for k in (0, 2, 0)]
    rows = _inputs(embeds, 0, 4)
    engine.step_batch([(s, rows[0], False, None) for s in sessions])
    (pool,) = engine._pools.pools.values()
    engine.step_batch([(s, rows[1], False, None) for s in reversed(sessions)])  # any order: the same group
    assert all(a is b for a, b in zip(inputs[1], pool.stacked, strict=True))  # taken as they were
    (pool,) = engine._pools.pools.values()
    assert pool.intact() and pool.sessions == tuple(sessions)
    views = [np.array(a) for a in pool.views(2)]
    stacked = pool.stacked
    engine.step_batch([(s, rows[2], False, None) for s in sessions[:2]])  # the third sits this frame out
    if share == 1.0:
        assert all(a.shape[0] == 2 for a in inputs[2])  # the two sessions' rows of the stacks
        (kept,) = engine._pools.pools.values()
        assert kept is pool
    else:
        assert all(a is b for a, b in zip(inputs[2], stacked, strict=True))  # all three rows, as they were
        (pool,) = engine._pools.pools.values()
    assert pool.intact() and pool.sessions == tuple(sessions)
    assert all(np.array_equal(a, b) for a, b in zip(pool.views(2), views, strict=True))
    assert sessions[2].positions == sessions[0].positions - 1
    out = engine.step_batch([(sessions[0], rows[3], True, 3), (sessions[1], rows[3], True, 3),
                             (sessions[2], rows[2], True, 2)])  # all three again: the pool as it is
    assert all(a is b for a, b in zip(inputs[3], pool.stacked, strict=True))
    for k, o, n in zip((0, 2, 0), out, (4, 4, 3), strict=True):
        want = _solo_rows(engine, k, rows[:n])[-1]
        assert (o.text_id, o.function_id) == (want.text_id, want.function_id)
        assert _max_diff(o, want) <= LOGIT_TOLERANCE
    # A batch of one of them with a session from outside: the pool goes, the two left behind own their rows.
    outsider = _open(engine, 0)
    (pool,) = engine._pools.pools.values()
    own_before = [[np.array(a) for a in pool.views(b)] for b in (1, 2)]
    engine.step_batch([(sessions[0], rows[0], False, None), (outsider, rows[0], False, None)])
    assert all(p.sessions != tuple(sessions) for p in engine._pools.pools.values())
    for b, before in zip((1, 2), own_before, strict=True):
        own = [a for i in layers for a in (sessions[b].caches[i].conv, sessions[b].caches[i].ssm)]
        assert all(a.shape[0] == 1 for a in own)
        assert all(np.array_equal(a, w) for a, w in zip(own, before, strict=True))
    for s in [*sessions, outsider]:
        engine.close_session(s)
    assert not engine._pools


@pytest.mark.parametrize("kind", ["dense", "4bit-as-bf16"])
def test_prompts_fed_a_row_at_a_time_in_batches_equal_a_prefilled_open(engines, embeds, batch_sizes, kind,
                                                                        monkeypatch):
    engine = engines[kind]
    monkeypatch.setattr(engine, "prompts_kept", 0)  # every session feeds its own prompt
    opens = [
        {"prompt_token_ids": [1, 17, 42, 99, 2], "prefix_dtype": "bfloat16"},
        {"prompt_token_ids": [1, 5, 6, 2], "prefix_dtype": "bfloat16"},
        {"prompt_token_ids": [1, 8, 9, 10, 11, 12, 2], "prefix_dtype": "bfloat16"},
        {"prompt_token_ids": [1, 33, 2], "prefix_dtype": "float32"},
    ]
    expected = []
    for k, spec in enumerate(opens):
        session = engine.open_session(**spec)
        expected.append([session.step(row, return_logits=True, frame_index=t)
                         for t, row in enumerate(_inputs(embeds, k, 4))])
        engine.close_session(session)
    sessions = [engine.open_session(**spec, prefill=False) for spec in opens]
    assert [s.prompt_pending for s in sessions] == [5, 4, 7, 3] and all(s.positions == 0 for s in sessions)
    with pytest.raises(ValueError, match="prompt rows still to feed"):
        sessions[0].step(_inputs(embeds, 0, 1)[0])
    tick = 0
    while any(s.prompt_pending for s in sessions):
        due = [s for s in sessions if s.prompt_pending]
        if tick == 2:  # one session feeds a row alone between batches
            due[0].feed_prompt_row()
            due = due[1:]
        assert engine.prefill_batch(due) == [None] * len(due)
        tick += 1
    assert [s.prompt_positions for s in sessions] == [5, 4, 7, 3]
    assert max(batch_sizes) == 3  # the three bf16 prompts' rows were fed together; the f32 one fed alone
    got = [[] for _ in sessions]
    for t in range(4):
        outs = engine.step_batch([(s, _inputs(embeds, k, 4)[t], True, t) for k, s in enumerate(sessions)])
        for k, out in enumerate(outs):
            got[k].append(out)
    for k in range(len(opens)):
        for e, g in zip(expected[k], got[k], strict=True):
            assert (g.text_id, g.function_id) == (e.text_id, e.function_id)
            assert _max_diff(e, g) <= LOGIT_TOLERANCE
    done = engine.prefill_batch(sessions[:2])
    assert all(isinstance(r, ValueError) and "no prompt rows left" in str(r) for r in done)
    for session in sessions:
        engine.close_session(session)


@pytest.mark.parametrize("kind", ["dense", "4bit-as-bf16"])
def test_sessions_opening_together_run_their_first_position_as_one_forward(engines, embeds, monkeypatch, kind):
    """Three sessions without a prompt take their first step as one plain forward of three rows (and three bf16
    prompts their first rows), then step on as sessions that opened alone: the same ids, logits within the
    batched tolerance, the same counters and cache shapes and dtypes."""
    from services.llm.nemotron_h import NemotronH

    engine = engines[kind]
    monkeypatch.setattr(engine, "prompts_kept", 0)
    forwards = []
    original = NemotronH.__call__

    def spy(self, x, caches=None):
        forwards.append(x.shape[0])
        return original(self, x, caches)

    expected = [_solo(engine, embeds, 1, 4) for _ in range(3)]  # OPENS[1]: no prompt
    monkeypatch.setattr(NemotronH, "__call__", spy)
    sessions = [_open(engine, 1) for _ in range(3)]
    got = [[] for _ in sessions]
    for t in range(4):
        outs = engine.step_batch([(s, _inputs(embeds, 1, 4)[t], True, t) for s in sessions])
        for k, out in enumerate(outs):
            got[k].append(out)
        if t == 0:
            assert forwards == [3]  # one forward of the three first positions, none alone
    for mine, theirs in zip(got, expected, strict=True):
        assert [(o.text_id, o.function_id) for o in mine] == [(o.text_id, o.function_id) for o in theirs]
        assert max(_max_diff(a, b) for a, b in zip(mine, theirs, strict=True)) <= LOGIT_TOLERANCE
    alone = _open(engine, 1)
    alone.step(_inputs(embeds, 1, 1)[0])
    for session in sessions:
        assert (session.positions, session.frames) == (4, 4)
        assert len(session.caches) == len(alone.caches)
        for mine, theirs in zip(session.caches, alone.caches, strict=True):
            assert type(mine) is type(theirs)
            if mine is not None:
                assert mine.dtypes() == theirs.dtypes()
                assert all(a.shape[0] == 1 for a in mine.arrays())  # its own row, not the batch's arrays
        engine.close_session(session)

    forwards.clear()
    spec = {"prompt_token_ids": [1, 17, 42, 2], "prefix_dtype": "bfloat16"}
    prefilled = engine.open_session(**spec)
    fed = [engine.open_session(**spec, prefill=False) for _ in range(3)]
    forwards.clear()
    assert engine.prefill_batch(fed) == [None] * 3
    assert forwards == [3] and all((s.positions, s.prompt_positions) == (1, 1) for s in fed)
    while fed[0].prompt_pending:
        engine.prefill_batch(fed)
    row = _inputs(embeds, 0, 1)[0]
    want = prefilled.step(row, return_logits=True, frame_index=0)
    for out in engine.step_batch([(s, row, True, 0) for s in fed]):
        assert (out.text_id, out.function_id) == (want.text_id, want.function_id)
        assert _max_diff(out, want) <= LOGIT_TOLERANCE
    for session in (prefilled, alone, *fed):
        engine.close_session(session)


def test_first_positions_leave_a_group_and_a_pool_the_next_step_takes_as_they_are(engines, embeds, monkeypatch):
    """Sessions that took their first position as one forward keep its arrays: each attention layer's as the
    arrays of a group of their caches, the Mamba states as a pool's stacks; so their next batched step (the
    GPU's grouping forced on) stacks and copies nothing, and gives each session its solo results."""
    from services.common import cache
    from services.common.cache import STACK_ALL, LayerGroup

    engine = engines["dense"]
    monkeypatch.setattr(engine, "prompts_kept", 0)
    monkeypatch.setattr(engine, "stack_up_to", STACK_ALL)
    expected = [_solo(engine, embeds, 1, 3) for _ in range(3)]
    sessions = [_open(engine, 1) for _ in range(3)]
    first = engine.step_batch([(s, _inputs(embeds, 1, 3)[0], True, 0) for s in sessions])
    attention = engine.model.batched_step.attention_layers
    for i in attention:
        held = LayerGroup.holding([s.caches[i] for s in sessions])
        assert held is not None and held[1] == [0, 1, 2] and held[0].keys.shape[0] == 3
    (pool,) = engine._pools.pools.values()
    assert pool.sessions == tuple(sessions) and pool.intact()
    stacked = []

    def spy(name):
        real = getattr(cache, name)
        return lambda *args: stacked.append(name) or real(*args)

    for name in ("_runs", "_state_runs"):  # what stacks a group's caches, and a batch's states, piece by piece
        monkeypatch.setattr(cache, name, spy(name))
    rest = [engine.step_batch([(s, _inputs(embeds, 1, 3)[t], True, t) for s in sessions]) for t in (1, 2)]
    assert stacked == []  # no state and no cache stacked again
    for k, theirs in enumerate(expected):
        mine = [first[k], rest[0][k], rest[1][k]]
        assert [(o.text_id, o.function_id) for o in mine] == [(o.text_id, o.function_id) for o in theirs]
        assert max(_max_diff(a, b) for a, b in zip(mine, theirs, strict=True)) <= LOGIT_TOLERANCE
    for session in sessions:
        engine.close_session(session)


def test_grouped_attention_caches_give_every_session_its_solo_results_bit_for_bit(engines, embeds, monkeypatch):
    """With the GPU's grouping forced on: sessions that step together again write and read their attention
    caches as rows of one group per layer; through a tick one sits out (the others step as some of the group's
    members, the group kept) and a lone step (which takes its rows back: the group re-formed after it), every
    logit equals the session's solo run to the bit, and the groups did run."""
    from services.common.cache import STACK_ALL, LayerGroup

    engine = engines["4bit"]
    monkeypatch.setattr(engine, "stack_up_to", STACK_ALL)
    steps = {"grouped": 0, "some": 0}
    original, form = LayerGroup.step, LayerGroup.__init__

    def counted(self, q, k, v, plans, scale, index=None):
        steps["grouped"] += 1
        steps["some"] += len(plans) < len(self.members)
        return original(self, q, k, v, plans, scale, index)

    def formed(self, *args):
        steps["formed"] = steps.get("formed", 0) + 1
        form(self, *args)

    monkeypatch.setattr(LayerGroup, "__init__", formed)

    monkeypatch.setattr(LayerGroup, "step", counted)
    schedule = [[0, 1, 2]] * 4 + [[0, 2]] + [[0, 1, 2]] * 4 + [[1]] + [[0, 1, 2]] * 3
    counts = [sum(k in ks for ks in schedule) for k in range(3)]
    expected = [_solo(engine, embeds, k, counts[k]) for k in range(3)]
    inputs = [_inputs(embeds, k, counts[k]) for k in range(3)]
    sessions, got = [_open(engine, k) for k in range(3)], [[] for _ in range(3)]
    for ks in schedule:
        steps_now = [(sessions[k], inputs[k][len(got[k])], True, len(got[k])) for k in ks]
        for k, out in zip(ks, engine.step_batch(steps_now), strict=True):
            got[k].append(out)
    for k in range(3):
        assert [(o.text_id, o.function_id) for o in got[k]] == [(o.text_id, o.function_id) for o in expected[k]]
        assert max(_max_diff(a, b) for a, b in zip(got[k], expected[k], strict=True)) == 0.0
    attention_layers = sum(1 for block in engine.model.backbone.blocks if block.kind == "*")
    assert steps["grouped"] >= 6 * attention_layers  # most batched ticks wrote their groups in place
    assert steps["some"] == attention_layers  # the tick of sessions 0 and 2
    # formed at the first tick (session 1, with no prompt, steps alone there), when session 1 joins, and after
    # its lone step; not around the tick it sat out
    assert steps["formed"] == 3 * attention_layers
    for session in sessions:
        engine.close_session(session)


def test_precompile_steps_some_of_the_last_batch_with_its_stacks_kept(engines, monkeypatch):
    """At load, each batch size's steps are followed by a step of all but one of its sessions over all its rows;
    after every size, some of the last batch's sessions step at each size below it, over all its rows or
    (under half of them) taking their rows of its stacked states: the partial steps' kernels are built before
    a client's frame."""
    from services.common.cache import StatePool

    engine = engines["dense"]
    written, calls = [], []
    original, forward = StatePool.write_rows, BatchedStep.__call__

    def spy(self, rows, states):
        written.append((len(self.sessions), list(rows)))
        return original(self, rows, states)

    def spy_forward(self, prev_text, audio, prev_function, states, caches, heads=True, active=None, *rest):
        calls.append((prev_text.shape[0], heads, None if active is None else list(active)))
        return forward(self, prev_text, audio, prev_function, states, caches, heads, active, *rest)

    monkeypatch.setattr(StatePool, "write_rows", spy)
    monkeypatch.setattr(BatchedStep, "__call__", spy_forward)
    engine.precompile(5)
    steps = [c for c in calls if c[1]]  # the steps; prompt rows come first
    # At each size the newest session's first step is solo (its conv tails are bf16 from the prompt until its
    # first float32 step), so size k's first batch is of k - 1 (at size 2 both step alone); then all k, then
    # all but one over all k rows.
    assert steps[:13] == [(2, True, None)] * 2 + [(3, True, None), (3, True, [0, 1])] \
        + [(3, True, None), (4, True, None), (4, True, [0, 1, 2])] \
        + [(4, True, None), (5, True, None), (5, True, [0, 1, 2, 3])] \
        + [(5, True, [0, 1, 2, 3]), (5, True, [0, 1, 2]), (2, True, None)]
    # Last, the openings at each size k from 2. Sessions fresh from one-row prompts: all k step twice (their
    # first step with the prompt's bf16 conv tails); then half of them step (alone at k < 4), the other half
    # joins (two batches: the first half's tails are float32 by now), and all k step. Sessions without a
    # prompt: all k take their first position (no batched step), then one step; half of them take theirs, then
    # step beside the other half's first positions, and all k step.
    def opening(k, half):
        halves = [(n, True, None) for n in (half, k - half) if n > 1]
        prompted = [(k, True, None)] * 2 + halves[:1] * (half > 1) + halves + [(k, True, None)]
        return prompted + [(k, True, None)] + [(half, True, None)] * (half > 1) + [(k, True, None)]

    assert steps[13:] == [call for k in range(2, 6) for call in opening(k, k // 2)]
    assert written[-1:] == [(5, [0, 1])]  # two of five: their rows taken and written back
    # the prompt rows: each size's two rows (one row alone at size 1), then a row of all but one of them over all
    # their rows; the rows left are fed after
    rows = [c for c in calls if not c[1]]
    assert rows[:11] == [(2, False, None)] * 2 + [(3, False, None)] * 2 + [(3, False, [0, 1])] \
        + [(4, False, None)] * 2 + [(4, False, [0, 1, 2])] + [(5, False, None)] * 2 + [(5, False, [0, 1, 2, 3])]
    assert not engine._pools and not engine.live_sessions


@pytest.mark.parametrize("grouped", [False, True], ids=["own-attention", "grouped-attention"])
def test_random_subsets_of_a_pool_give_every_session_its_solo_results(engines, embeds, monkeypatch, grouped):
    """Six sessions stepping all together and in seeded random subsets between, in random order, one of them
    closed midway: steps of at least half of the pool run over all of its rows, smaller ones take their rows,
    and every session's ids and logits equal its solo run, with the attention caches per session or grouped
    (the GPU's path, forced)."""
    from services.common.cache import STACK_ALL, StatePool

    engine = engines["4bit"]
    monkeypatch.setattr(engine, "stack_up_to", STACK_ALL if grouped else 0)
    rng = np.random.default_rng(7)
    # every other tick all of them (the pool re-formed), in between a random subset of any size
    schedule = [[int(k) for k in rng.permutation(6)[: 6 if t % 2 == 0 else int(rng.integers(1, 6))]]
                for t in range(24)]
    schedule = [[k for k in ks if not (k == 5 and t > 12)] for t, ks in enumerate(schedule)]  # 5 leaves at 12
    counts = [sum(k in ks for ks in schedule) for k in range(6)]

    def opened(k):
        return engine.open_session(system_prompt=f"Session {k}, be brief.", prefix_dtype="float32")

    def solo(k):
        session = opened(k)
        out = [session.step(row, True, t) for t, row in enumerate(_inputs(embeds, k, counts[k]))]
        engine.close_session(session)
        return out

    expected = [solo(k) for k in range(6)]
    paths = {"over all rows": 0, "rows taken": 0}
    forward, write = BatchedStep.__call__, StatePool.write_rows

    def spy_forward(self, *args):
        paths["over all rows"] += len(args) > 6 and args[6] is not None
        return forward(self, *args)

    def spy_write(self, *args):
        paths["rows taken"] += 1
        return write(self, *args)

    monkeypatch.setattr(BatchedStep, "__call__", spy_forward)
    monkeypatch.setattr(StatePool, "write_rows", spy_write)
    sessions = [opened(k) for k in range(6)]
    inputs = [_inputs(embeds, k, counts[k]) for k in range(6)]
    got = [[] for _ in range(6)]
    for t, ks in enumerate(schedule):
        steps = [(sessions[k], inputs[k][len(got[k])], True, len(got[k])) for k in ks]
        for k, out in zip(ks, engine.step_batch(steps), strict=True):
            got[k].append(out)
        if t == 12:
            engine.close_session(sessions[5])
    assert paths["over all rows"] >= 5 and paths["rows taken"] >= 2
    for k in range(6):
        assert [(o.text_id, o.function_id) for o in got[k]] == [(o.text_id, o.function_id) for o in expected[k]]
        assert max(_max_diff(a, b) for a, b in zip(got[k], expected[k], strict=True)) <= LOGIT_TOLERANCE
    for session in sessions[:5]:
        engine.close_session(session)
    assert not engine._pools and not engine.live_sessions


def test_precompile_never_holds_more_sessions_than_its_largest_batch(engines, monkeypatch):
    """Its steps' sessions are closed before the openings open theirs: at load a service holds at most one
    largest batch's states and caches at once (on a GPU, with the others loading beside it: the language model's
    peak at 40 sessions was its arrays of 80 before)."""
    engine = engines["dense"]
    live = []
    open_session = engine.open_session

    def counted(*args, **kwargs):
        session = open_session(*args, **kwargs)
        live.append(engine.live_sessions)
        return session

    monkeypatch.setattr(engine, "open_session", counted)
    engine.precompile(5)
    assert max(live) == 5 and live.count(5) > 1  # the steps' five, then the openings' at size 5
    assert engine.live_sessions == 0


@pytest.mark.parametrize("weights", ["stored", "bfloat16"])
def test_after_precompile_sessions_opening_and_stepping_in_any_subsets_trace_nothing(tiny_checkpoint,
                                                                                     compile_traces, weights):
    """Every compiled piece a live service runs is traced at load: after `precompile`, sessions opening at
    different ticks, feeding their prompts and stepping in seeded random subsets (first steps of sessions fresh
    from their prompts, prompt rows over a pool's rows, sessions leaving) trace no piece again. On a GPU a piece
    traced under a live session stalls it, for seconds on a machine whose kernel cache is empty."""
    import random

    traces = compile_traces
    engine = LanguageEngine.load(tiny_checkpoint, options=LoadOptions(weights, float32_weights=True))
    engine.precompile(6)
    assert traces  # the pieces were traced at load, through the counting compile
    traces.clear()
    rng = random.Random(7)
    audio = mx.zeros((engine.model.hidden_size,), mx.float32)
    live = []
    for tick in range(50):
        if len(live) < 6 and rng.random() < 0.3:
            live.append(engine.open_session("Be concise." * rng.randint(1, 3), prefix_dtype="bfloat16",
                                            prefill=False))
        due = [s for s in live if rng.random() < 0.8] or live[:1]
        pending = [s for s in due if s.prompt_pending]
        ready = [s for s in due if not s.prompt_pending]
        if pending:
            assert not any(engine.prefill_batch(pending))
        if ready:
            results = engine.step_batch([(s, audio, False, None) for s in ready])
            assert not any(isinstance(r, Exception) for r in results)
        assert traces == [], f"tick {tick}: {len(pending)} prompt rows and {len(ready)} steps of {len(live)} traced"
        if live and rng.random() < 0.05:
            engine.close_session(live.pop(rng.randrange(len(live))))
    assert len(live) >= 4  # the schedule did reach batches of several sessions
    for session in live:
        engine.close_session(session)


def _dtypes_now(session):
    return tuple(dtype for c in session.caches if c is not None for dtype in c.dtypes())


def test_a_sessions_cache_dtypes_follow_its_state_through_prompt_rows_steps_and_a_restore(engines, embeds,
                                                                                          monkeypatch):
    """The dtypes a batch groups by are read once per state; after every prompt row (alone or batched), every step
    (alone or batched) and a restore they are what the caches hold then: a bf16 prefix's conv tails turn float32
    at its first step, its attention caches stay bf16."""
    engine = engines["4bit-as-bf16"]
    monkeypatch.setattr(engine, "prompts_kept", 0)  # both feed their prompts
    ids = [1, 17, 42, 2]
    bf16, f32 = (engine.open_session(prompt_token_ids=ids, prefix_dtype=d, prefill=False)
                 for d in ("bfloat16", "float32"))
    seen = []
    bf16.feed_prompt_row()
    f32.feed_prompt_row()
    while bf16.prompt_pending:
        assert engine.prefill_batch([bf16, f32]) == [None, None]
        for s in (bf16, f32):
            assert s.cache_dtypes() == _dtypes_now(s)
        seen.append(bf16.cache_dtypes())
    for t, row in enumerate(_inputs(embeds, 0, 3)):
        if t == 0:
            bf16.step(row, frame_index=0)
            f32.step(row, frame_index=0)
        else:
            engine.step_batch([(s, row, False, t) for s in (bf16, f32)])
        for s in (bf16, f32):
            assert s.cache_dtypes() == _dtypes_now(s)
        seen.append(bf16.cache_dtypes())
    assert seen[0] != seen[-1] and mx.bfloat16 in seen[-1] and mx.float32 in seen[-1]
    assert bf16.cache_dtypes() != f32.cache_dtypes()
    # a restore at the same counters: the dtypes read before it are forgotten
    bf16.restore(crossed(f32))
    assert (bf16.positions, bf16.prompt_positions) == (f32.positions, f32.prompt_positions)
    assert bf16.cache_dtypes() == _dtypes_now(bf16) == f32.cache_dtypes()
    for s in (bf16, f32):
        engine.close_session(s)


def _fed_alone(engine, spec, rows):
    """A session that feeds its own prompt, then steps `rows`: its outputs and state."""
    kept, engine.prompts_kept = engine.prompts_kept, 0
    try:
        session = engine.open_session(**spec, prefill=False)
    finally:
        engine.prompts_kept = kept
    while session.prompt_pending:
        assert engine.prefill_batch([session]) == [None]
    outputs = [session.step(row, return_logits=True, frame_index=t) for t, row in enumerate(rows)]
    state = _state(session), session.cache_dtypes()
    engine.close_session(session)
    return outputs, state


@pytest.mark.parametrize("stack", [0, STACK_ALL], ids=["own-attention", "grouped-attention"])
@pytest.mark.parametrize("kind", ["dense", "4bit-as-bf16"])
def test_a_session_opening_with_a_kept_prompt_feeds_nothing_and_steps_as_one_that_fed_it(
        tiny_checkpoint, tiny4_checkpoint, embeds, monkeypatch, kind, stack):
    """The first sessions of a prompt feed it (here batched, their caches grouped with STACK_ALL); the caches it
    left are kept, and a session opening later with that prompt takes copies: nothing fed, no forward run, and
    its steps and state are bit for bit those of a session that fed the prompt itself, however the first
    sessions stepped meanwhile. Another prefix dtype or prompt feeds its own; so does a restore."""
    engine = (LanguageEngine.load(tiny_checkpoint, max_prompt_tokens=32) if kind == "dense" else
              LanguageEngine.load(tiny4_checkpoint, max_prompt_tokens=32, options=LoadOptions("bfloat16")))
    engine.stack_up_to = stack
    spec = {"prompt_token_ids": [1, 17, 42, 99, 2], "prefix_dtype": "bfloat16"}
    rows = _inputs(embeds, 0, 4)
    want_outputs, want_state = _fed_alone(engine, spec, rows)
    first = [engine.open_session(**spec, prefill=False) for _ in range(3)]
    assert [s.prompt_pending for s in first] == [5, 5, 5]  # none kept yet
    while first[0].prompt_pending:
        assert engine.prefill_batch(first) == [None] * 3
    for t, row in enumerate(_inputs(embeds, 1, 3)):  # the first sessions step on, in their groups
        engine.step_batch([(s, row, False, t) for s in first])

    runs = []
    monkeypatch.setattr(BatchedStep, "__call__", lambda *a, **k: runs.append("batched"))
    backbone = type(engine.model.backbone).__call__
    monkeypatch.setattr(type(engine.model.backbone), "__call__",
                        lambda *a, **k: runs.append("solo") or backbone(*a, **k))
    later = engine.open_session(**spec, prefill=False)
    assert (later.prompt_pending, later.positions, later.prompt_positions, runs) == (0, 5, 5, [])
    monkeypatch.undo()
    assert engine.prefill_batch([later]) != [None]  # nothing to feed
    got = [later.step(row, return_logits=True, frame_index=t) for t, row in enumerate(rows)]
    assert [(o.text_id, o.function_id) for o in got] == [(o.text_id, o.function_id) for o in want_outputs]
    assert max(_max_diff(a, b) for a, b in zip(got, want_outputs, strict=True)) == 0.0
    assert _same_state(_state(later), want_state[0]) and later.cache_dtypes() == want_state[1]
    # a second session from the same kept caches: `later`'s steps wrote its own copies only
    again = engine.open_session(**spec)
    assert again.prompt_pending == 0
    assert [again.step(row, frame_index=t).text_id for t, row in enumerate(rows)] == [o.text_id for o in got]
    other = engine.open_session(**{**spec, "prefix_dtype": "float32"}, prefill=False)
    restored = engine.open_session(**spec, restore=crossed(first[0]))
    assert other.prompt_pending == 5 and restored.positions == first[0].positions == 8
    for s in [*first, later, again, other, restored]:
        engine.close_session(s)
