"""Nemotron-H pieces on random inputs: the state-space recurrence, the attention cache, the cached mixer."""

import math

import mlx.core as mx
import numpy as np
import pytest

from services.common.layers import Linear
from services.llm.nemotron_h import (
    Attention,
    FullCache,
    Mamba2Mixer,
    MambaCache,
    NemotronH,
    ssm_sequence,
    ssm_step,
)

NO_LIMIT = (0.0, math.inf)


def _ssm_inputs(seed, b=2, length=12, heads=4, p=3, groups=2, n=5):
    rng = np.random.default_rng(seed)

    def arr(*shape, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))

    return dict(
        x=arr(b, length, heads, p), A=-mx.exp(arr(heads, scale=0.5)), B=arr(b, length, groups, n),
        C=arr(b, length, groups, n), D=arr(heads), dt=arr(b, length, heads), dt_bias=arr(heads, scale=0.3),
    )


def _step_through(inputs, state):
    ys = []
    for t in range(inputs["x"].shape[1]):
        y, state = ssm_step(
            inputs["x"][:, t : t + 1], inputs["A"], inputs["B"][:, t : t + 1], inputs["C"][:, t : t + 1],
            inputs["D"], inputs["dt"][:, t : t + 1], inputs["dt_bias"], state, NO_LIMIT,
        )
        ys.append(y)
    return mx.concatenate(ys, axis=1), state


@pytest.mark.parametrize("chunk", [256, 5, 1])
@pytest.mark.parametrize("with_state", [False, True])
def test_single_step_recurrence_matches_the_chunked_form(chunk, with_state):
    inputs = _ssm_inputs(seed=3)
    state0 = mx.array(np.random.default_rng(4).standard_normal((2, 4, 3, 5)).astype(np.float32)) if with_state else None
    y_seq, s_seq = ssm_sequence(**inputs, state=state0, limits=NO_LIMIT, chunk=chunk)
    y_step, s_step = _step_through(inputs, state0)
    np.testing.assert_allclose(np.array(y_step), np.array(y_seq), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(s_step), np.array(s_seq), rtol=1e-5, atol=1e-5)


def test_single_step_equals_the_chunked_form_bit_for_bit_on_one_position():
    # The cached decode path must give the reference's exact numbers, and the reference runs the chunked form.
    inputs = _ssm_inputs(seed=5, length=1)
    state0 = mx.array(np.random.default_rng(6).standard_normal((2, 4, 3, 5)).astype(np.float32))
    y_seq, s_seq = ssm_sequence(**inputs, state=state0, limits=NO_LIMIT)
    y_step, s_step = ssm_step(**inputs, state=state0, limits=NO_LIMIT)
    assert np.array_equal(np.array(y_step), np.array(y_seq))
    assert np.array_equal(np.array(s_step), np.array(s_seq))


def test_single_step_by_hand():
    # One head, one channel, one state: dt = softplus(0.5 + 0.2), A = -exp(log 2) = -2.
    args = dict(x=mx.array([[[[3.0]]]]), A=-mx.exp(mx.array([math.log(2.0)])), B=mx.array([[[[0.5]]]]),
                C=mx.array([[[[-1.5]]]]), D=mx.array([0.25]), dt=mx.array([[[0.5]]]), dt_bias=mx.array([0.2]))
    y, state = ssm_step(**args, state=mx.array([[[[4.0]]]]), limits=NO_LIMIT)
    dt = math.log1p(math.exp(0.7))
    h = math.exp(-2.0 * dt) * 4.0 + dt * 3.0 * 0.5
    assert float(state.item()) == pytest.approx(h, rel=1e-6)
    assert float(y.item()) == pytest.approx(-1.5 * h + 0.25 * 3.0, rel=1e-6)
    # time_step_limit clips dt before anything else.
    y_clip, state_clip = ssm_step(**args, state=mx.array([[[[4.0]]]]), limits=(0.0, 0.1))
    assert float(state_clip.item()) == pytest.approx(math.exp(-0.2) * 4.0 + 0.1 * 1.5, rel=1e-6)


def _linear(rng, out_dim, in_dim):
    return Linear(mx.array((rng.standard_normal((out_dim, in_dim)) / math.sqrt(in_dim)).astype(np.float32)))


def _attention(seed, d=16, heads=4, kv_heads=2, head_dim=8):
    rng = np.random.default_rng(seed)
    return Attention(_linear(rng, heads * head_dim, d), _linear(rng, kv_heads * head_dim, d),
                     _linear(rng, kv_heads * head_dim, d), _linear(rng, d, heads * head_dim),
                     heads=heads, kv_heads=kv_heads, head_dim=head_dim)


def test_attention_cache_matches_recomputation():
    attn = _attention(seed=0)
    x = mx.array(np.random.default_rng(1).standard_normal((1, 9, 16)).astype(np.float32))
    whole = attn(x)  # causal over all 9 positions, no cache
    cache = FullCache()
    first = attn(x[:, :4], cache)  # a 4-position prefill, then one position at a time
    steps = [attn(x[:, t : t + 1], cache) for t in range(4, 9)]
    cached = mx.concatenate([first, *steps], axis=1)
    np.testing.assert_allclose(np.array(cached), np.array(whole), rtol=1e-5, atol=1e-6)
    assert cache.offset == 9
    # Position 0 attends only to itself: softmax weight 1 on its own value.
    v0 = attn.v_proj(x[:, :1]).reshape(1, 1, 2, 8)
    expected = attn.o_proj(mx.repeat(v0, 2, axis=2).reshape(1, 1, 32))
    np.testing.assert_allclose(np.array(whole[:, :1]), np.array(expected), rtol=1e-5, atol=1e-6)


def test_kv_cache_keeps_its_first_dtype_until_it_grows():
    # As the reference's cache: f32 keys written after a bf16 prefix are rounded to bf16 within the first
    # block; growing concatenates an f32 block, which promotes the buffer.
    cache = FullCache()
    third = mx.full((1, 2, 10, 4), 1.0 / 3.0)
    cache.update(mx.ones((1, 2, 240, 4), mx.bfloat16), mx.ones((1, 2, 240, 4), mx.bfloat16))
    keys, _ = cache.update(third, third)
    assert keys.shape == (1, 2, 250, 4) and keys.dtype == mx.bfloat16
    assert float(keys[0, 0, 245, 0].item()) == float(mx.array(1.0 / 3.0).astype(mx.bfloat16).item())
    keys, _ = cache.update(third, third)
    assert keys.shape == (1, 2, 260, 4) and cache.keys.shape[2] == 250 + 256  # trimmed, then one block more
    assert keys.dtype == mx.float32
    assert float(keys[0, 0, 255, 0].item()) == pytest.approx(1.0 / 3.0, abs=1e-7)


def _mixer(seed, d=16, heads=4, head_dim=4, groups=2, n=6, k=4):
    rng = np.random.default_rng(seed)
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * n

    def arr(*shape, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))

    return Mamba2Mixer(
        in_proj=_linear(rng, inner + conv_dim + heads, d), conv_weight=arr(conv_dim, k, 1, scale=0.5),
        conv_bias=arr(conv_dim, scale=0.1), dt_bias=arr(heads, scale=0.3), A_log=arr(heads, scale=0.5),
        D=arr(heads), norm_weight=1 + arr(inner, scale=0.1), out_proj=_linear(rng, d, inner),
        heads=heads, head_dim=head_dim, groups=groups, state_size=n, eps=1e-5, limits=NO_LIMIT,
    )


def test_cached_mamba_mixer_matches_the_whole_sequence():
    mixer = _mixer(seed=2)
    x = mx.array(np.random.default_rng(3).standard_normal((1, 10, 16)).astype(np.float32))
    whole = mixer(x)
    cache = MambaCache()
    parts = [mixer(x[:, :3], cache)] + [mixer(x[:, t : t + 1], cache) for t in range(3, 10)]
    np.testing.assert_allclose(np.array(mx.concatenate(parts, axis=1)), np.array(whole), rtol=1e-4, atol=1e-5)
    assert cache.conv.shape == (1, 3, mixer.conv_dim)
    np.testing.assert_array_equal(np.array(cache.conv), np.array(mixer._split(mixer.in_proj(x))[1][:, -3:]))


def test_backbone_makes_one_cache_per_block_kind(tiny_checkpoint):
    from services.common.checkpoint import Checkpoint

    ck = Checkpoint(tiny_checkpoint)
    model = NemotronH.from_weights(ck.load(["stt_model.llm"]), "stt_model.llm", ck.config.text_config)
    kinds = [type(c).__name__ if c is not None else None for c in model.make_caches()]
    expected = {"M": "MambaCache", "*": "FullCache", "-": None}
    assert kinds == [expected[k] for k in ck.config.text_config.hybrid_override_pattern]
    x = mx.array(np.random.default_rng(0).standard_normal((1, 6, 128)).astype(np.float32))
    caches = model.make_caches()
    stepped = mx.concatenate([model(x[:, t : t + 1], caches) for t in range(6)], axis=1)
    np.testing.assert_allclose(np.array(stepped), np.array(model(x)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prefix_dtype", [mx.float32, mx.bfloat16])
def test_compiled_cached_step_equals_the_plain_stack_bit_for_bit(tiny_checkpoint, prefix_dtype):
    from services.llm.engine import LanguageEngine

    model = LanguageEngine.load(tiny_checkpoint).model
    rng = np.random.default_rng(1)
    rows = mx.array(rng.standard_normal((12, 1, 1, model.hidden_size)).astype(np.float32))
    plain, compiled = model.make_caches(), model.make_caches()
    ids = (model.pad_id, model.pad_id)
    for t in range(rows.shape[0]):
        audio = rows[t].astype(prefix_dtype) if t < 3 else rows[t]  # a prompt prefix, then audio rows
        text_logits, function_logits = model.heads(model.backbone(model.fuse(ids[0], audio, ids[1]), plain))
        if t == 0:  # the compiled step needs caches that already hold a position
            model.backbone(model.fuse(ids[0], audio, ids[1]), compiled)
            continue
        got_text, got_function, got_ids = model.cached_step(ids[0], audio, ids[1], compiled, heads=True)
        assert mx.array_equal(got_text, text_logits).item() and mx.array_equal(got_function, function_logits).item()
        assert got_ids.tolist() == model.greedy(text_logits, function_logits).tolist()
        for mine, theirs in zip(compiled, plain, strict=True):
            for a, b in zip(mine.arrays() if mine else [], theirs.arrays() if theirs else [], strict=True):
                assert a.dtype == b.dtype and mx.array_equal(a, b).item()
        ids = tuple(got_ids.tolist())
