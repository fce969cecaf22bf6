"""The Gemma-3-style EAR-TTS backbone, run on injected embeddings, over caches from services.common.cache.

Layer i is global when (i + 1) % pattern == 0 (full cache, RoPE base `rope_global_base_freq`), otherwise
sliding (a rotating cache of `sliding_window` keys, RoPE base `rope_local_base_freq`). Inputs are NOT scaled
by sqrt(hidden). Caches keep keys in the same physical order as the reference's, since the attention sum
over keys is order-sensitive in the last bit:

    caches = backbone.make_caches()
    h = backbone(x, caches)          # x: (B, T, D) float32 -> (B, T, D)

Several sessions' single-frame steps run as one batch: rows 2i and 2i + 1 are session i's (its caches hold
those two rows) and each session's keys are written to its own caches. Per layer, the sessions whose caches
hold at most `stack_up_to` keys (the engine's policy) attend together over their keys stacked, the others in
place (`services.common.cache.attend_sessions`):

    h = backbone.step_batch(x, [caches_0, caches_1], stack_up_to)   # x: (2 * sessions, 1, D) -> same
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from services.common.cache import Bound, FullCache, RingCache, attend_sessions
from services.common.checkpoint import Weights
from services.common.config import TTSConfig
from services.common.layers import Linear, Projections
from services.tts.blocks import GatedMLP, GemmaRMSNorm


@dataclass
class Attention:
    qkv: Projections  # q_proj, k_proj, v_proj as one matmul
    o_proj: Linear
    q_norm: GemmaRMSNorm
    k_norm: GemmaRMSNorm
    n_heads: int
    n_kv_heads: int
    scale: float
    rope_base: float

    def project(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """x: (B, T, D) -> q, k, v (B, heads, T, head_dim), normed and rotated from position `offset` (an int,
        or a (B,) int32 array of each row's offset)."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x)
        q = q.reshape(b, t, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(b, t, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(b, t, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.q_norm(q), self.k_norm(k)
        dims = q.shape[-1]
        q = mx.fast.rope(q, dims, traditional=False, base=self.rope_base, scale=1.0, offset=offset)
        k = mx.fast.rope(k, dims, traditional=False, base=self.rope_base, scale=1.0, offset=offset)
        return q, k, v

    def output(self, attended: mx.array) -> mx.array:
        """attended: (B, heads, T, head_dim) -> (B, T, D) through o_proj."""
        b, _, t, _ = attended.shape
        return self.o_proj(attended.transpose(0, 2, 1, 3).reshape(b, t, -1))

    def attend(self, x: mx.array, mask: str | mx.array | None, cache: FullCache | RingCache) -> mx.array:
        """x: (B, T, D) -> (B, heads, T, head_dim): this layer's attention over `cache`, advanced by T."""
        q, k, v = self.project(x, cache.offset)
        k, v = cache.update(k, v)
        if isinstance(mask, mx.array) and mask.shape[-1] != k.shape[2]:
            mask = mask[..., -k.shape[2] :]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: FullCache | RingCache) -> mx.array:
        return self.output(self.attend(x, mask, cache))


@dataclass
class Block:
    self_attn: Attention
    mlp: GatedMLP
    input_layernorm: GemmaRMSNorm
    post_attention_layernorm: GemmaRMSNorm
    pre_feedforward_layernorm: GemmaRMSNorm
    post_feedforward_layernorm: GemmaRMSNorm

    def head(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The block up to its attention: the residual stream x -> this layer's q, k, v."""
        return self.self_attn.project(self.input_layernorm(x), offset)

    def tail(self, x: mx.array, attended: mx.array) -> mx.array:
        """The block after its attention: the residual stream x and the attention's output -> the block's output."""
        h = x + self.post_attention_layernorm(self.self_attn.output(attended))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: FullCache | RingCache) -> mx.array:
        return self.tail(x, self.self_attn.attend(self.input_layernorm(x), mask, cache))

    def step_batch(self, x: mx.array, caches: Sequence[FullCache | RingCache], offsets: mx.array,
                   stack_up_to: int) -> mx.array:
        return self.tail(x, attend_sessions(*self.head(x, offsets), caches, self.self_attn.scale, stack_up_to))


@dataclass
class Gemma3Backbone:
    """28 blocks (config-sized) + final norm over injected embeddings; no token embedding, no head."""

    layers: list[Block]
    norm: GemmaRMSNorm
    config: TTSConfig

    @classmethod
    def from_weights(cls, weights: Weights, path: str, config: TTSConfig) -> Gemma3Backbone:
        eps = config.rms_norm_eps
        layers = []
        for i in range(config.num_hidden_layers):
            p = f"{path}.layers.{i}"

            def norm(name: str, p: str = p) -> GemmaRMSNorm:
                return GemmaRMSNorm.from_weights(weights, f"{p}.{name}", eps)

            attn = Attention(
                Projections.from_weights(weights, [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")]),
                Linear.from_weights(weights, f"{p}.self_attn.o_proj"),
                q_norm=norm("self_attn.q_norm"),
                k_norm=norm("self_attn.k_norm"),
                n_heads=config.num_attention_heads,
                n_kv_heads=config.num_key_value_heads,
                scale=config.query_pre_attn_scalar**-0.5,
                rope_base=config.rope_global_base_freq if config.is_global_layer(i) else config.rope_local_base_freq,
            )
            layers.append(Block(attn, GatedMLP.from_weights(weights, f"{p}.mlp"), norm("input_layernorm"),
                                norm("post_attention_layernorm"), norm("pre_feedforward_layernorm"),
                                norm("post_feedforward_layernorm")))
        return cls(layers, GemmaRMSNorm.from_weights(weights, f"{path}.norm", eps), config)

    def make_caches(self, bound: Bound | None = None) -> list[FullCache | RingCache]:
        """One cache per layer: full for global layers (holding at most `bound`'s keys), a ring of
        `sliding_window` keys for the others."""
        return [FullCache(bound) if self.config.is_global_layer(i) else RingCache(self.config.sliding_window)
                for i in range(len(self.layers))]

    def __call__(self, x: mx.array, caches: list[FullCache | RingCache]) -> mx.array:
        """x: (B, T, D) embeddings -> (B, T, D) normed hidden states; advances every cache by T."""
        n = x.shape[1]
        masks = {}  # one mask per cache kind, computed before any cache advances
        for i, cache in enumerate(caches):
            kind = self.config.is_global_layer(i)
            if kind not in masks:
                masks[kind] = cache.mask(n)
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            x = layer(x, masks[self.config.is_global_layer(i)], cache)
        return self.norm(x)

    def step_batch(self, x: mx.array, caches: Sequence[list[FullCache | RingCache]],
                   stack_up_to: int = 0) -> mx.array:
        """x: (2S, 1, D), rows 2i and 2i + 1 of session i (caches[i]) -> (2S, 1, D); advances every cache by 1.

        Per layer, caches of at most `stack_up_to` keys attend stacked, the others each in place
        (`services.common.cache.attend_sessions`)."""
        per = x.shape[0] // len(caches)
        offsets = mx.array(np.repeat([own[0].offset for own in caches], per).astype(np.int32))
        for i, layer in enumerate(self.layers):
            x = layer.step_batch(x, [own[i] for own in caches], offsets, stack_up_to)
        return self.norm(x)
