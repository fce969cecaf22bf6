"""`LayerGroup` (services/common/cache.py): several sessions' caches of one layer as rows of one pair of
arrays. A step of all members or of some of them must leave every cache, and give every stepping session's
attention, exactly as that cache's own single-key update and attention would."""

import gc

import mlx.core as mx
import numpy as np
import pytest

from services.common.cache import GROUP_GROW, GROW, FullCache, LayerGroup, RingCache

HEADS, DIM, PER = 2, 4, 2  # two rows a session, as the speech backbone's guided rows
SCALE = DIM**-0.5


def _kv(rng: np.random.Generator, rows: int, n: int) -> tuple[mx.array, mx.array]:
    return (mx.array(rng.standard_normal((rows, HEADS, n, DIM)).astype(np.float32)),
            mx.array(rng.standard_normal((rows, HEADS, n, DIM)).astype(np.float32)))


def _twins(make, lengths: list[int], seed: int):
    """Two lists of caches filled alike: one to group, one to update on its own."""
    grouped, own = [make() for _ in lengths], [make() for _ in lengths]
    rng = np.random.default_rng(seed)
    for i, n in enumerate(lengths):
        k, v = _kv(rng, PER, n)
        for cache in (grouped[i], own[i]):
            cache.update(k, v)
            for _ in range(3):  # single keys after the prompt: a ring's buffer drops what its append left over
                cache.update(*_kv(np.random.default_rng(100 * seed + i), PER, 1))
    return grouped, own


def _own_step(cache, q, k, v) -> mx.array:
    keys, values = cache.update(k, v)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=SCALE)


def _assert_same_cache(mine, theirs) -> None:
    """The same counters and held keys; and read out whole (a copy), the same buffer: a group member's view may
    stop at the group's width, past every key it holds."""
    assert mine.offset == theirs.offset and getattr(mine, "slot", None) == getattr(theirs, "slot", None)
    assert mine.capacity == theirs.capacity and mine.held() == theirs.held()
    held = theirs.held()
    whole = mine.copy()
    for name in ("keys", "values"):
        np.testing.assert_array_equal(np.array(getattr(mine, name)[..., :held, :]),
                                      np.array(getattr(theirs, name)[..., :held, :]))
        np.testing.assert_array_equal(np.array(getattr(whole, name)), np.array(getattr(theirs, name)))


@pytest.mark.parametrize("make", [FullCache, lambda: RingCache(7)], ids=["full", "ring"])
def test_steps_of_some_members_keep_the_group_and_equal_each_caches_own_steps(make):
    grouped, own = _twins(make, [5, 2, 9], seed=1)
    LayerGroup(grouped, PER)
    group = grouped[0].group
    rng = np.random.default_rng(2)
    # all, then some (in any order), then all again: rings wrap and full buffers grow inside the group
    schedule = [[0, 1, 2], [0, 2], [2], [1, 0], [0, 1, 2]] * 3
    for index in schedule:
        held = LayerGroup.holding([grouped[i] for i in index])
        assert held is not None and held[0] is group and held[1] == index
        plans = group.plans(index)
        assert plans is not None
        q, k = _kv(rng, PER * len(index), 1)
        v = mx.array(rng.standard_normal(k.shape).astype(np.float32))
        got = group.step(q, k, v, plans, SCALE, index)
        for j, i in enumerate(index):
            rows = slice(j * PER, (j + 1) * PER)
            want = _own_step(own[i], q[rows], k[rows], v[rows])
            np.testing.assert_array_equal(np.array(got[rows]), np.array(want))
    for mine, theirs in zip(grouped, own, strict=True):
        assert mine.group is group
        _assert_same_cache(mine, theirs)


def test_a_member_that_leaves_or_closes_ends_the_groups_hold_on_the_others():
    grouped, _ = _twins(FullCache, [3, 4, 5], seed=3)
    LayerGroup(grouped, PER)
    assert LayerGroup.holding(grouped[:2])[1] == [0, 1]
    grouped[2].update(*_kv(np.random.default_rng(4), PER, 1))  # a solo step takes its rows back
    assert grouped[2].group is None
    assert LayerGroup.holding(grouped[:2]) is None  # the others re-form, freeing the departed rows

    grouped, _ = _twins(FullCache, [3, 4, 5], seed=5)
    LayerGroup(grouped, PER)
    del grouped[2]  # its session closed
    gc.collect()
    assert LayerGroup.holding(grouped) is None
    assert LayerGroup.holding([FullCache()]) is None  # never grouped


def test_a_step_of_some_members_adds_gathers_and_scatters_but_no_conversion():
    """Against a step of all members, a step of some runs one scatter per buffer in place of the full write, a
    gather of the queries and one of the outputs: no conversion and no range (the scatter indexes every axis
    with unsigned arrays, the heads' indices made once per group)."""
    from bench.stages import KernelCounter

    grouped, _ = _twins(FullCache, [4, 6, 5], seed=7)
    LayerGroup(grouped, PER)
    group = grouped[0].group
    rng = np.random.default_rng(8)

    def counted(index: list[int]):
        q, k = _kv(rng, PER * len(index), 1)
        v = mx.array(rng.standard_normal(k.shape).astype(np.float32))
        mx.eval(q, k, v)
        with KernelCounter() as counter:
            mx.eval(group.step(q, k, v, group.plans(index), SCALE, index), group.keys, group.values)
        return counter.counts

    counted([0, 2])  # the heads' indices, made once
    full, some = counted([0, 1, 2]), counted([0, 2])
    assert full["ScatterAxis"] == 2 and some["Scatter"] == 2 and "ScatterAxis" not in some
    assert some["Gather"] == full.get("Gather", 0) + 2
    for name in ("AsType", "Arange"):
        assert some[name] == full[name]


def test_layers_stepping_the_same_members_share_their_index_arrays():
    """The layers of one kind step the same members at the same slots: the index arrays (rows, query sources,
    slots) are made once a step, not once a layer, and each layer still equals its caches' own steps."""
    from services.common import cache as kv_group

    layers = [_twins(FullCache, [4, 6, 5], seed=11) for _ in range(3)]
    for grouped, _ in layers:
        LayerGroup(grouped, PER)
    rng = np.random.default_rng(12)
    q, k = _kv(rng, PER * 2, 1)
    v = mx.array(rng.standard_normal(k.shape).astype(np.float32))
    kv_group.member_rows.cache_clear()
    kv_group.step_index.cache_clear()
    for grouped, own in layers:
        group = grouped[0].group
        got = group.step(q, k, v, group.plans([0, 2]), SCALE, [0, 2])
        for j, i in enumerate([0, 2]):
            rows = slice(j * PER, (j + 1) * PER)
            want = _own_step(own[i], q[rows], k[rows], v[rows])
            np.testing.assert_array_equal(np.array(got[rows]), np.array(want))
            _assert_same_cache(grouped[i], own[i])
    for made in (kv_group.member_rows, kv_group.step_index):
        assert made.cache_info().misses == 1 and made.cache_info().hits == len(layers) - 1
    rows, source = kv_group.member_rows((0, 2), 3, PER)
    assert np.array(rows).tolist() == [0, 1, 4, 5] and rows.dtype == mx.uint32
    assert np.array(source).tolist() == [0, 1, 0, 0, 2, 3] and source.dtype == mx.int32


@pytest.mark.parametrize(("make", "prompt"), [(FullCache, 5), (FullCache, 256), (lambda: RingCache(7), 5),
                                              (lambda: RingCache(7), 9), (lambda: RingCache(300), 37)],
                         ids=["full", "full-grows", "ring", "ring-drops", "ring-grows"])
def test_copies_of_one_cache_step_as_a_tiled_group_exactly_as_their_own_updates(make, prompt, monkeypatch):
    """Sessions opened on one kept warm-up hold copies of its caches: their first batched step forms the group
    from the source tiled, then writes the group (no write of each copy), and must leave every cache and give
    every attention exactly as each copy's own update would; a copy that has written since is not a copy any
    more."""
    from services.common import cache as cache_module

    source = make()
    source.update(*_kv(np.random.default_rng(7), PER, prompt))
    tiled = []
    real = cache_module.mx.tile
    monkeypatch.setattr(cache_module.mx, "tile", lambda a, reps: tiled.append(reps[0]) or real(a, reps))
    copies, own = [source.copy() for _ in range(3)], [source.copy() for _ in range(3)]
    assert all(c.copied_from() is not None for c in copies)
    rng = np.random.default_rng(8)
    for _ in range(3):
        q, k = _kv(rng, PER * 3, 1)
        v = mx.array(rng.standard_normal(k.shape).astype(np.float32))
        got = cache_module.attend_sessions(q, k, v, copies, SCALE, stack_up_to=1 << 20)
        for i in range(3):
            rows = slice(i * PER, (i + 1) * PER)
            np.testing.assert_array_equal(np.array(got[rows]), np.array(_own_step(own[i], q[rows], k[rows], v[rows])))
        assert copies[0].group is not None and LayerGroup.holding(copies) is not None
    # one tile of the source's keys and one of its values, once: a ring's prompt of 9 in a window of 7 drops keys
    # at its first single key, which only each copy's own update does (the copies' own buffers then stacked)
    assert tiled == ([] if prompt == 9 else [3, 3])
    for mine, theirs in zip(copies, own, strict=True):
        _assert_same_cache(mine, theirs)
        assert mine.copied_from() is None
    # the source is untouched, and a copy that wrote on its own is no copy
    again = source.copy()
    again.update(*_kv(rng, PER, 1))
    assert again.copied_from() is None and source.offset == prompt


@pytest.mark.parametrize("make", [FullCache, lambda: RingCache(7)], ids=["full", "ring"])
def test_sessions_joining_a_group_stack_its_rows_as_one_piece_and_equal_their_own_updates(make, monkeypatch):
    """A group's members stepping with newcomers (fresh copies of one cache, and one cache of its own) form the
    new group from the old one's rows in one piece, the copies' source tiled and the other alone, then write it as
    a group: the attention and every cache exactly as each cache's own update would leave them."""
    from services.common import cache as cache_module

    grouped, own = _twins(make, [5, 2, 4], seed=11)
    LayerGroup(grouped, PER)
    source = make()
    source.update(*_kv(np.random.default_rng(12), PER, 3))
    loner, loner_own = _twins(make, [6], seed=13)
    caches = grouped + [source.copy(), source.copy()] + loner
    owns = own + [source.copy(), source.copy()] + loner_own
    pieces = []
    real = cache_module._runs
    monkeypatch.setattr(cache_module, "_runs", lambda c, per: pieces.append(len(runs := real(c, per))) or runs)
    rng = np.random.default_rng(14)
    for _ in range(3):
        q, k = _kv(rng, PER * len(caches), 1)
        v = mx.array(rng.standard_normal(k.shape).astype(np.float32))
        got = cache_module.attend_sessions(q, k, v, caches, SCALE, stack_up_to=1 << 20)
        for i, theirs in enumerate(owns):
            rows = slice(i * PER, (i + 1) * PER)
            np.testing.assert_array_equal(np.array(got[rows]), np.array(_own_step(theirs, q[rows], k[rows], v[rows])))
    assert pieces == [3]  # the old group's rows, the copies' source, the loner; later steps write the new group
    for mine, theirs in zip(caches, owns, strict=True):
        _assert_same_cache(mine, theirs)


@pytest.mark.parametrize("make", [FullCache, lambda: RingCache(1000)], ids=["full", "ring"])
def test_a_groups_buffer_grows_by_group_grow_keys_past_its_widest_view_not_by_its_members_buffer_size(make):
    grouped, own = _twins(make, [5, 2, 9], seed=7)
    LayerGroup(grouped, PER)
    group = grouped[0].group
    formed = group.keys.shape[2]
    assert formed == max(cache.capacity for cache in own)  # formed at its members' buffer size
    rng = np.random.default_rng(8)
    for _ in range(GROW + 2 * GROUP_GROW):  # past the members' first GROW keys: their own buffers double
        plans = group.plans()
        q, k = _kv(rng, PER * len(grouped), 1)
        v = mx.array(rng.standard_normal(k.shape).astype(np.float32))
        got = group.step(q, k, v, plans, SCALE)
        for i, cache in enumerate(own):
            rows = slice(i * PER, (i + 1) * PER)
            np.testing.assert_array_equal(np.array(got[rows]), np.array(_own_step(cache, q[rows], k[rows], v[rows])))
        widest, width = max(plan.visible for plan in plans), group.keys.shape[2]
        assert width >= widest and (width == formed or width < widest + GROUP_GROW)
    # the members' own buffers grew by GROW keys, the group's by GROUP_GROW keys at a time
    assert max(cache.capacity for cache in own) >= formed + GROW > group.keys.shape[2]
    for mine, theirs in zip(grouped, own, strict=True):
        assert mine.group is group
        _assert_same_cache(mine, theirs)
        for name, value in theirs.snapshot().items():  # a member's snapshot, read from the narrower group
            np.testing.assert_array_equal(np.array(mine.snapshot()[name]), np.array(value))
    k, v = _kv(rng, PER, 1)
    for cache in (grouped[1], own[1]):  # a solo step takes its rows back: its own buffer at its own size again
        cache.update(k, v)
    assert grouped[1].group is None and grouped[1].keys.shape[2] == own[1].capacity
    _assert_same_cache(grouped[1], own[1])
