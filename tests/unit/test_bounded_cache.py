"""A bounded `FullCache` (services/common/cache.py): the session's prompt keys for good plus a ring of the last
`window` keys. Until keep + window keys it is FullCache bit for bit; after, a single query attends over the prompt
and the last `window` keys, and a `LayerGroup` step writes and attends exactly as each cache's own update."""

import mlx.core as mx
import numpy as np
import pytest

from services.common.cache import Bound, FullCache, LayerGroup, context_bound

HEADS, DIM, PER = 2, 4, 2
SCALE = DIM**-0.5


def _kv(rng: np.random.Generator, n: int, rows: int = PER) -> tuple[mx.array, mx.array]:
    return (mx.array(rng.standard_normal((rows, HEADS, n, DIM)).astype(np.float32)),
            mx.array(rng.standard_normal((rows, HEADS, n, DIM)).astype(np.float32)))


def _attend(q: mx.array, keys: mx.array, values: mx.array) -> np.ndarray:
    return np.array(mx.fast.scaled_dot_product_attention(q, keys, values, scale=SCALE))


def test_until_the_bound_it_is_a_full_cache_bit_for_bit_then_it_keeps_the_prompt_and_the_last_window():
    keep, window = 5, 300  # the buffer grows past one GROW block before the bound
    bounded, full = FullCache(Bound(keep, window)), FullCache()
    rng = np.random.default_rng(0)
    prompt = _kv(rng, keep)
    for cache in (bounded, full):
        cache.update(*prompt)
    singles = []
    for t in range(keep, keep + window + 3 * window // 2):
        k, v = _kv(rng, 1)
        q = mx.array(rng.standard_normal((PER, HEADS, 1, DIM)).astype(np.float32))
        singles.append((k, v))
        mine = bounded.update(k, v)
        theirs = full.update(k, v)
        if t < keep + window:  # the same visible keys, hence the same sums
            if t + 1 < keep + window:  # the buffer only stops growing at the bound
                assert bounded.plan_one()[:2] == full.plan_one()[:2]
            for a, b in zip(mine, theirs, strict=True):
                np.testing.assert_array_equal(np.array(a), np.array(b))
            np.testing.assert_array_equal(_attend(q, *mine), _attend(q, *theirs))
            continue
        # past the bound: the buffer holds the prompt, then key s at slot keep + (s - keep) % window
        assert mine[0].shape[2] == bounded.capacity == keep + window and bounded.offset == t + 1
        by_hand_k = np.zeros((PER, HEADS, keep + window, DIM), np.float32)
        by_hand_v = np.zeros_like(by_hand_k)
        by_hand_k[:, :, :keep], by_hand_v[:, :, :keep] = np.array(prompt[0]), np.array(prompt[1])
        for s in range(t + 1 - window, t + 1):
            sk, sv = singles[s - keep]
            by_hand_k[:, :, keep + (s - keep) % window] = np.array(sk)[:, :, 0]
            by_hand_v[:, :, keep + (s - keep) % window] = np.array(sv)[:, :, 0]
        np.testing.assert_array_equal(np.array(mine[0]), by_hand_k)
        np.testing.assert_array_equal(np.array(mine[1]), by_hand_v)
        # and the attention is that over the prompt plus the last `window` keys in time order (up to the sum's order)
        recent = slice(t + 1 - window - keep, t + 1 - keep)
        in_time = [mx.concatenate([p, *[s[j] for s in singles[recent]]], axis=2) for j, p in enumerate(prompt)]
        np.testing.assert_allclose(_attend(q, *mine), _attend(q, *in_time), rtol=1e-5, atol=1e-6)


def test_a_multi_token_update_past_the_bound_is_refused_and_changes_nothing():
    cache = FullCache(Bound(keep=2, window=3))
    rng = np.random.default_rng(1)
    cache.update(*_kv(rng, 2))
    with pytest.raises(ValueError, match="one key at a time past its 5 keys"):
        cache.update(*_kv(rng, 4))
    assert cache.offset == 2
    with pytest.raises(ValueError, match="window >= 1"):
        Bound(keep=2, window=0)
    assert context_bound(7, None) is None and context_bound(7, 0) is None
    assert context_bound(7, 9) == Bound(7, 9)


@pytest.mark.parametrize("index_schedule", [[None] * 12, [[0, 1, 2], [0, 2], [2], [1, 0], [1]] * 4],
                         ids=["all", "some"])
def test_a_group_step_past_the_bound_equals_each_caches_own_update(index_schedule):
    prompts, window = [3, 1, 6], 4  # each cache keeps its own prompt; all cross the bound inside the group
    grouped = [FullCache(Bound(n, window)) for n in prompts]
    own = [FullCache(Bound(n, window)) for n in prompts]
    rng = np.random.default_rng(2)
    for i, n in enumerate(prompts):
        k, v = _kv(rng, n)
        for cache in (grouped[i], own[i]):
            cache.update(k, v)
    LayerGroup(grouped, PER)
    group = grouped[0].group
    for index in index_schedule:
        members = list(range(len(prompts))) if index is None else index
        plans = group.plans(index)
        assert [plan.slot for plan in plans] == [own[i].plan_one().slot for i in members]
        q, k = _kv(rng, 1, PER * len(members))
        v = mx.array(rng.standard_normal(k.shape).astype(np.float32))
        got = np.array(group.step(q, k, v, plans, SCALE, index))
        for j, i in enumerate(members):
            rows = slice(j * PER, (j + 1) * PER)
            np.testing.assert_array_equal(got[rows], _attend(q[rows], *own[i].update(k[rows], v[rows])))
    for mine, theirs in zip(grouped, own, strict=True):
        assert mine.group is group and mine.offset == theirs.offset > mine.bound.size
        assert mine.capacity == mine.bound.size
        np.testing.assert_array_equal(np.array(mine.keys), np.array(theirs.keys))
        np.testing.assert_array_equal(np.array(mine.values), np.array(theirs.values))
