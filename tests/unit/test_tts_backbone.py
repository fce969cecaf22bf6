"""The Gemma-3-style backbone: the ring cache's layout, and step-by-step equal to one whole-sequence pass."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from services.common.cache import FullCache, RingCache
from services.common.checkpoint import Checkpoint
from services.tts.backbone import Gemma3Backbone


def _kv(values):
    """(1, 1, T, 1) keys whose single feature is the time index."""
    return mx.array(np.array(values, np.float32).reshape(1, 1, -1, 1))


def test_ring_cache_keeps_the_last_window_keys_in_ring_order():
    cache = RingCache(4)
    keys, _ = cache.update(_kv([0, 1, 2]), _kv([0, 1, 2]))
    assert keys.reshape(-1).tolist() == [0, 1, 2]
    seen = []
    for t in range(3, 9):
        keys, values = cache.update(_kv([t]), _kv([t]))
        seen.append(keys.reshape(-1).tolist())
        assert mx.array_equal(keys, values).item()
    # grows to the window, then overwrites the oldest slot in place
    assert seen == [[0, 1, 2, 3], [4, 1, 2, 3], [4, 5, 2, 3], [4, 5, 6, 3], [4, 5, 6, 7], [8, 5, 6, 7]]
    assert cache.offset == 9
    # a multi-token update first restores time order, then keeps window - 1 old keys per new key
    keys, _ = cache.update(_kv([9, 10]), _kv([9, 10]))
    assert keys.reshape(-1).tolist() == [6, 7, 8, 9, 10]


def test_ring_cache_masks_a_long_first_chunk_to_the_window():
    cache = RingCache(3)
    assert cache.mask(3) == "causal"
    mask = np.array(cache.mask(5))
    assert mask.shape == (5, 5)
    assert mask[4].tolist() == [False, False, True, True, True]
    assert mask[1].tolist() == [True, True, False, False, False]
    assert cache.mask(1) is None and FullCache().mask(1) is None and FullCache().mask(4) == "causal"


@pytest.fixture(scope="module")
def small_window_backbone(tiny_checkpoint):
    checkpoint = Checkpoint(tiny_checkpoint)
    config = dataclasses.replace(checkpoint.config.tts_config, sliding_window=8)
    weights = checkpoint.load(["tts_model.tts_model.backbone."])
    return Gemma3Backbone.from_weights(weights, "tts_model.tts_model.backbone", config)


def test_warmup_then_steps_equal_one_whole_pass_with_the_window_mask(small_window_backbone):
    backbone = small_window_backbone
    assert [isinstance(c, FullCache) for c in backbone.make_caches()] == [False] * 5 + [True]
    d = backbone.config.hidden_size
    x = mx.array(np.random.default_rng(0).standard_normal((2, 21, d)).astype(np.float32))
    whole = backbone(x, backbone.make_caches())  # 21 > window: windowed causal mask on the sliding layers
    caches = backbone.make_caches()
    parts = [backbone(x[:, :5], caches)] + [backbone(x[:, t : t + 1], caches) for t in range(5, 21)]
    stepped = mx.concatenate(parts, axis=1)
    assert caches[0].offset == caches[5].offset == 21
    assert caches[0].keys.shape[2] == 8 and caches[5].keys.shape[2] >= 21
    np.testing.assert_allclose(np.array(stepped), np.array(whole), rtol=1e-4, atol=1e-4)
