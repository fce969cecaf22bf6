"""services/common/cache.py: sessions' state as rows of batched arrays. `RowSources` hands out rows that are views
and gathers them back without copies; `StatePools` keeps a batch's stacked states for the next batch of the same
sessions, all or some of them; `group_by_signature` splits a batch into the entries that can run together."""

import gc
import threading
import weakref
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from services.common.cache import Bound, FullCache, MambaCache, PooledState, RowSources, StatePools, group_by_signature


def test_row_sources_give_back_the_batched_array_a_view_or_one_take():
    sources = RowSources()
    batched = mx.arange(12, dtype=mx.float32).reshape(4, 3)
    rows = sources.split(batched)
    assert sources.gather(rows) is batched  # the same composition: no copy at all
    assert sources.source_of(rows[2])[0] is batched and sources.source_of(rows[2])[1] == 2
    assert np.array_equal(np.array(sources.gather([rows[2], rows[0]])), np.array(batched)[[2, 0]])
    run = sources.gather(rows[1:3])  # a run of the batch's rows: a slice of it
    assert np.array_equal(np.array(run), np.array(batched)[1:3])
    loose = mx.full((1, 3), 7.0)
    mixed = sources.gather([rows[3], loose, rows[1], loose])
    assert np.array_equal(np.array(mixed), np.array([[9, 10, 11], [7, 7, 7], [3, 4, 5], [7, 7, 7]]))
    sources.keep({id(rows[0])})
    assert np.array_equal(np.array(sources.gather([rows[0]])), [[0, 1, 2]])  # row 0 of the batched array
    assert sources.gather([rows[1]]) is rows[1]  # forgotten: the row is its own source
    assert sources.source_of(rows[1]) is None


def test_arrange_orders_rows_so_that_the_gather_copies_nothing():
    sources = RowSources()
    whole = mx.zeros((3, 2))
    first, second = sources.split(whole), sources.split(mx.ones((2, 2)))
    loose = mx.full((1, 2), 5.0)
    rows = [second[1], loose, first[2], first[0], second[0], first[1]]
    order = sources.arrange(rows)
    # the batch whose row comes first, in its order, then the other, then the loose row
    assert order == [4, 0, 3, 5, 2, 1]
    reversed_rows = first[::-1]
    assert sources.arrange(reversed_rows) == [2, 1, 0]
    assert sources.gather([reversed_rows[p] for p in sources.arrange(reversed_rows)]) is whole


def test_a_batched_array_is_let_go_once_each_of_its_rows_is_freed_or_forgotten():
    sources = RowSources()
    batched = mx.arange(9, dtype=mx.float32).reshape(3, 3)
    watch = weakref.ref(batched)
    rows = sources.split(batched)
    del batched
    sources.keep({id(rows[0]), id(rows[1])})  # row 2 forgotten while still alive...
    third = rows.pop()
    del third  # ...then freed: counted once, not twice
    del rows[1]
    gc.collect()
    assert watch() is not None and sources.source_of(rows[0]) == (watch(), 0)
    assert sources.gather(rows) is not watch() and np.array_equal(np.array(sources.gather(rows)), [[0, 1, 2]])
    del rows
    gc.collect()
    assert watch() is None  # the last row gone: nothing of the batch is held here


def test_rows_freed_on_other_threads_while_the_engine_thread_splits_gathers_and_keeps():
    sources, handed, errors = RowSources(), [], []
    lock, stop = threading.Lock(), threading.Event()
    watches = []

    def free() -> None:  # the sessions' threads, letting their rows go at any moment
        try:
            while not stop.is_set() or handed:
                with lock:
                    rows = handed.pop(0) if handed else None
                del rows
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=free) for _ in range(3)]
    for thread in threads:
        thread.start()
    last = last_batched = None
    for step in range(300):
        batched = mx.full((8, 4), float(step))
        watches.append(weakref.ref(batched))
        rows = sources.split(batched)
        if last is not None:
            assert sources.gather(last) is last_batched  # the engine still holds last: the same array back
        sources.keep({id(r) for r in rows})
        with lock:
            handed.append(rows)
        last, last_batched = list(rows), batched
        del rows, batched
    stop.set()
    for thread in threads:
        thread.join()
    del last, last_batched
    gc.collect()
    assert not errors and not [w for w in watches if w() is not None]


class Holder(PooledState):
    width = 2


@dataclass
class Session:
    key: int
    holders: list


def _sessions(n: int) -> list[Session]:
    return [Session(k, [Holder((mx.full((1, 2), float(k)), mx.full((1, 3), 10.0 + k)))]) for k in range(n)]


def _pools(share: float = 0.5) -> StatePools:
    return StatePools(lambda s: s.key, lambda s: s.holders, share)


def _rows(session: Session) -> list[list[float]]:
    return [np.array(a).ravel().tolist() for a in session.holders[0].state]


def test_a_batch_of_the_same_sessions_takes_the_stacks_as_they_are():
    pools, sessions = _pools(), _sessions(3)
    batch = pools.gather(sessions)
    assert batch.rows == [0, 1, 2] and batch.active is None
    assert np.array_equal(np.array(batch.states[0]), [[0, 0], [1, 1], [2, 2]])
    stepped = [a + 1 for a in batch.states]
    pools.scatter(batch, stepped)
    assert _rows(sessions[1]) == [[2.0, 2.0], [12.0, 12.0, 12.0]]  # its views of the new stacks
    assert pools.settle([sessions]) == []
    again = pools.gather(sessions)
    assert all(a is b for a, b in zip(again.states, stepped, strict=True))  # no gather at all


def test_some_of_a_pool_run_over_all_its_rows_or_take_theirs_and_write_them_back():
    for share, over_all in ((0.5, True), (1.0, False)):
        pools, sessions = _pools(share), _sessions(3)
        pools.scatter(pools.gather(sessions), pools.gather(sessions).states)
        some = [sessions[2], sessions[0]]
        assert pools.settle([some]) == []  # the pool is kept for them
        batch = pools.gather(some)
        if over_all:  # every row, the sitting-out session's passed through
            assert batch.members == sessions and batch.rows == [2, 0] and batch.active == [0, 2]
            assert [a.shape[0] for a in batch.states] == [3, 3]
            placed = batch.place([mx.array(7), mx.array(8)], mx.array(0))  # entry i at its row, zeros between
            assert [int(a) for a in placed] == [8, 0, 7]
            new = [mx.where(mx.array([[True], [False], [True]]), a + 100, a) for a in batch.states]
        else:  # their rows taken, then written back into the stacks
            assert batch.members == some and batch.rows == [0, 1] and batch.active is None
            assert np.array_equal(np.array(batch.states[0]), [[2, 2], [0, 0]])
            new = [a + 100 for a in batch.states]
        pools.scatter(batch, new)
        assert _rows(sessions[0])[0] == [100.0, 100.0] and _rows(sessions[2])[0] == [102.0, 102.0]
        assert _rows(sessions[1])[0] == [1.0, 1.0]  # untouched
        (pool,) = pools.pools.values()
        assert pool.sessions == tuple(sessions) and pool.intact()


def test_a_session_leaving_a_pool_gets_its_own_rows_and_closing_drops_it():
    pools, sessions = _pools(), _sessions(3)
    batch = pools.gather(sessions)
    pools.scatter(batch, batch.states)
    outsider = _sessions(4)[3]
    copies = pools.settle([[sessions[0], outsider]])  # mixes in a session from outside: the pool goes
    assert not pools and len(copies) == 4  # sessions 1 and 2 get copies of their two states
    assert _rows(sessions[2]) == [[2.0, 2.0], [12.0, 12.0, 12.0]]
    pools.scatter(pools.gather(sessions[1:]), pools.gather(sessions[1:]).states)
    pools.drop(sessions[1].key)
    assert not pools


def test_a_pool_hands_rows_that_are_read_only_when_needed_and_setting_a_state_leaves_it():
    pools, sessions = _pools(), _sessions(3)
    batch = pools.gather(sessions)
    pools.scatter(batch, [a * 2 for a in batch.states])
    (pool,) = pools.pools.values()
    holder = sessions[1].holders[0]
    assert holder._state is None  # handed as rows of the stacks: no view made for it yet
    assert holder.dtypes() == (mx.float32, mx.float32) and holder._state is None  # read without views
    assert _rows(sessions[1]) == [[2.0, 2.0], [22.0, 22.0, 22.0]]  # read: its row of each stack
    assert pool.intact()  # reading changes nothing
    pools.scatter(pools.gather(sessions[:2]), [a + 1 for a in pools.gather(sessions[:2]).states])
    assert _rows(sessions[1]) == [[3.0, 3.0], [23.0, 23.0, 23.0]]  # the new stacks' rows, read anew
    (pool,) = pools.pools.values()
    holder.state = (mx.zeros((1, 2)), mx.zeros((1, 3)))  # a solo step's own arrays
    assert not pool.holds(1) and pool.holds(0) and not pool.intact()
    assert _rows(sessions[1]) == [[0.0, 0.0], [0.0, 0.0, 0.0]]


def test_copies_of_one_state_stack_as_it_tiled_and_a_changed_copy_as_its_own(monkeypatch):
    """Sessions opened on one kept prompt hold copies of its states: their first batch stacks the prompt's arrays
    tiled (one copy in all) with the same values a concatenation of the copies gives; a copy given a new state
    since, or handed a pool's rows, stacks what it now holds."""
    from services.common import cache

    prompt = Holder((mx.array([[1.0, 2.0]]), mx.array([[3.0, 4.0, 5.0]])))
    sessions = [Session(k, [prompt.copy()]) for k in range(3)]
    assert all(s.holders[0].copied_from()[0] is prompt.state[0] for s in sessions)
    tiled = []
    real = mx.tile
    monkeypatch.setattr(cache.mx, "tile", lambda a, reps: tiled.append(reps) or real(a, reps))
    pools = _pools()
    batch = pools.gather(sessions)
    assert tiled == [(3, 1), (3, 1)]
    assert np.array(batch.states[1]).tolist() == [[3.0, 4.0, 5.0]] * 3
    pools.scatter(batch, [a + 1 for a in batch.states])
    assert sessions[0].holders[0].copied_from() is None  # a pool's rows now
    assert _rows(sessions[2]) == [[2.0, 3.0], [4.0, 5.0, 6.0]] and np.array(prompt.state[0]).tolist() == [[1, 2]]
    changed = [Session(k, [prompt.copy()]) for k in range(3, 5)]
    changed[1].holders[0].state = (mx.array([[9.0, 9.0]]), mx.array([[9.0, 9.0, 9.0]]))
    tiled.clear()
    again = _pools().gather(changed)
    assert tiled == [] and np.array(again.states[0]).tolist() == [[1.0, 2.0], [9.0, 9.0]]


def test_sessions_of_two_pools_stack_as_one_slice_of_each_pools_stacks(monkeypatch):
    """Two pools' sessions batched together (a group joined by newcomers) stack each pool's consecutive rows as
    one slice of its stacks, not a piece a session; the values are each session's own."""
    from services.common import cache

    pools, sessions = _pools(), _sessions(5)
    for some in (sessions[:3], sessions[3:]):
        batch = pools.gather(some)
        pools.scatter(batch, [a * 10 for a in batch.states])
    assert pools.settle([sessions]) == []  # both pools go; every session is in the batch, so no copies
    pieces = []
    real = mx.concatenate
    monkeypatch.setattr(cache.mx, "concatenate", lambda parts, axis=0: pieces.append(len(parts)) or real(parts, axis))
    batch = pools.gather(sessions)
    assert pieces == [2, 2]  # per stack: the first pool's three rows, the second's two
    assert np.array(batch.states[0]).tolist() == [[10.0 * k] * 2 for k in range(5)]
    assert np.array(batch.states[1]).tolist() == [[10.0 * (10 + k)] * 3 for k in range(5)]
    pieces.clear()
    mixed = [sessions[0], sessions[3], sessions[1]]  # rows out of order: a piece a session
    pools.gather(mixed)
    assert pieces == [3, 3]


def test_group_by_signature_keeps_groups_of_two_or_more_in_order():
    entries = [("a", 3), ("b", 1), ("a", 1), (None, 0), ("b", 0), ("c", 5)]
    groups, solo = group_by_signature(entries, lambda e: e[0], order=lambda e: e[1])
    assert groups == [[2, 0], [4, 1]]  # each sorted by `order`: the same sessions form the same batch
    assert solo == [3, 5]  # not batchable, and alone with its signature


def test_caches_written_for_several_sessions_split_into_each_sessions_own():
    """A cache (and a Mamba state) computed for B sessions at once splits into B of one row: row b holds what
    session b writing alone would, with the counters, and a later write of one row leaves the others."""
    keys = mx.arange(3 * 2 * 1 * 4, dtype=mx.float32).reshape(3, 2, 1, 4)
    together = FullCache(Bound(keep=0, window=8))
    together.update(keys, -keys)
    rows = together.split_rows()
    for b, row in enumerate(rows):
        alone = FullCache(Bound(keep=0, window=8))
        alone.update(keys[b : b + 1], -keys[b : b + 1])
        assert (row.offset, row.capacity, row.bound) == (alone.offset, alone.capacity, alone.bound)
        assert mx.array_equal(row.keys, alone.keys) and mx.array_equal(row.values, alone.values)
    rows[0].update(mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))
    assert rows[0].offset == 2 and rows[1].offset == 1
    assert mx.array_equal(rows[1].keys[..., :1, :], keys[1:2])
    with pytest.raises(ValueError, match="keys of its own"):
        FullCache().split_rows()
    state = MambaCache(mx.arange(6.0).reshape(3, 2), None)
    parts = state.split_rows()
    assert [p.conv.tolist() for p in parts] == [[[0.0, 1.0]], [[2.0, 3.0]], [[4.0, 5.0]]]
    assert all(isinstance(p, MambaCache) and p.ssm is None for p in parts)
