"""Nemotron-H hybrid stack (Mamba2 / attention / squared-ReLU MLP) on injected embeddings, with two heads.

Modules are pure functions of their weights and inputs; every per-session tensor lives in a cache object the
caller owns (`make_caches`), so one model in memory serves any number of sessions:

    model = DuplexLanguageModel.from_weights(weights, config)
    caches = model.make_caches()
    hidden = model.backbone(fused, caches)        # fused: (B, L, D) -> (B, L, D) after norm_f
    text_logits, function_logits = model.heads(hidden)

Numerics follow the reference op for op: f32 activations against bf16 weights, the chunked (256-position)
state-space form for sequences, and a single-position recurrence whose ops reduce to the same arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from services.common.cache import Bound, FullCache, MambaCache, attend_sessions
from services.common.checkpoint import Weights
from services.common.config import TextConfig, VoiceChatConfig
from services.common.layers import Embedding, Linear, as_stored

SSM_CHUNK = 256  # positions per block of the chunked state-space form
WEIGHT_PREFIXES = ("stt_model.embed_tokens", "stt_model.llm", "stt_model.lm_head", "stt_model.function_head")


# ---- caches ------------------------------------------------------------------------------------------------


LayerCache = MambaCache | FullCache | None

# ---- the state-space recurrence ----------------------------------------------------------------------------


@mx.compile
def time_steps(dt: mx.array, dt_bias: mx.array, limits: tuple[float, float]) -> mx.array:
    """dt: (B, L, H) raw projection -> clip(softplus(dt + dt_bias), *limits) in float32.

    Compiled like the reference's, so the fused softplus rounds the same way."""
    return mx.clip(nn.softplus(dt.astype(mx.float32) + dt_bias), limits[0], limits[1])


def _cumulative_log_decay(a: mx.array) -> mx.array:
    """a: (B, H, T) per-step log decays -> (B, H, T, T) with [i, j] = sum(a[j+1..i]) for j <= i, 0 above."""
    t = a.shape[-1]
    tiled = mx.tril(mx.repeat(a[..., None], t, axis=-1), -1)
    return mx.cumsum(tiled, axis=-2)


def ssm_sequence(x: mx.array, A: mx.array, B: mx.array, C: mx.array, D: mx.array, dt: mx.array,
                 dt_bias: mx.array, state: mx.array | None, limits: tuple[float, float],
                 chunk: int = SSM_CHUNK) -> tuple[mx.array, mx.array]:
    """Chunked (quadratic within a chunk, recurrent across chunks) selective scan.

    x: (B, L, H, P); A: (H,) the decay rates, -exp(A_log); B, C: (B, L, G, N); dt: (B, L, H); state: (B, H, P, N)
    or None.
    Returns y: (B, L, H, P) in x's dtype and the final state (B, H, P, N) float32."""
    b, length, heads, p = x.shape
    groups, n = B.shape[2], B.shape[3]
    per_group = heads // groups
    dt = time_steps(dt, dt_bias, limits)
    log_decay = dt * A.astype(dt.dtype).reshape(1, 1, -1)  # (B, L, H)
    scaled_x = dt.reshape(b, length, heads, 1) * x  # (B, L, H, P)

    outputs = []
    for start in range(0, length, chunk):
        xs, la = scaled_x[:, start : start + chunk], log_decay[:, start : start + chunk]
        bs, cs = B[:, start : start + chunk], C[:, start : start + chunk]
        s = xs.shape[1]
        b_t = mx.transpose(bs, (0, 2, 3, 1))  # (B, G, N, S)
        scores = mx.repeat(mx.swapaxes(cs, 1, 2) @ b_t, per_group, axis=1)  # (B, H, S, S)
        decay = mx.exp(_cumulative_log_decay(la.swapaxes(1, 2)))  # (B, H, S, S)
        y = mx.swapaxes(mx.tril(scores * decay, 0) @ xs.swapaxes(1, 2), 1, 2)  # (B, S, H, P)

        # State carried out of the chunk: each position's input decayed to the chunk's end.
        to_end = decay[:, :, -1:, :].transpose(0, 3, 1, 2)  # (B, S, H, 1)
        b_heads = mx.repeat(b_t, per_group, axis=1).swapaxes(2, 3)  # (B, H, S, N)
        new_state = (xs * to_end).swapaxes(1, 2).swapaxes(2, 3) @ b_heads  # (B, H, P, N)
        if state is not None:
            carried = mx.exp(mx.cumsum(la, axis=-2))  # (B, S, H): decay from the chunk's start
            new_state += carried[:, -1, :, None, None] * state
            c6 = cs.reshape(b, s, groups, 1, n, 1)
            from_state = (state.reshape((b, 1, groups, per_group, p, n)) @ c6).squeeze(-1).flatten(2, 3)
            y += carried[..., None] * from_state
        outputs.append(y.astype(x.dtype))
        state = new_state
    y = mx.concatenate(outputs, axis=1) + x * D.reshape(1, 1, heads, 1)
    return y, state


def ssm_step(x: mx.array, A: mx.array, B: mx.array, C: mx.array, D: mx.array, dt: mx.array,
             dt_bias: mx.array, state: mx.array | None, limits: tuple[float, float]) -> tuple[mx.array, mx.array]:
    """One position of the recurrence: h' = exp(dt A) h + dt x B^T;  y = h' C + D x.

    x: (B, 1, H, P); A: (H,) as in `ssm_sequence`; B, C: (B, 1, G, N); dt: (B, 1, H); state: (B, H, P, N) or
    None (zeros).
    y is computed as (C.B) dt x + exp(dt A) (h C), the factorisation the chunked form takes for one
    position, so both forms give the same bits on a single step."""
    b, _, heads, p = x.shape
    groups, n = B.shape[2], B.shape[3]
    per_group = heads // groups
    dt = time_steps(dt, dt_bias, limits)
    log_decay = dt * A.astype(dt.dtype).reshape(1, 1, -1)  # (B, 1, H)
    scaled_x = dt.reshape(b, 1, heads, 1) * x  # (B, 1, H, P)
    b_col = B.reshape(b, groups, n, 1)
    cb = mx.repeat(C.reshape(b, groups, 1, n) @ b_col, per_group, axis=1)  # (B, H, 1, 1)
    y = (cb * scaled_x.swapaxes(1, 2)).swapaxes(1, 2)  # (B, 1, H, P)
    b_heads = mx.repeat(B.reshape(b, groups, 1, n), per_group, axis=1)  # (B, H, 1, N)
    new_state = scaled_x.reshape(b, heads, p, 1) * b_heads  # (B, H, P, N)
    if state is not None:
        keep = mx.exp(log_decay)  # (B, 1, H)
        new_state += keep[:, 0, :, None, None] * state
        from_state = (state.reshape(b, 1, groups, per_group, p, n) @ C.reshape(b, 1, groups, 1, n, 1))
        y += keep[..., None] * from_state.squeeze(-1).flatten(2, 3)
    y = y.astype(x.dtype) + x * D.reshape(1, 1, heads, 1)
    return y, new_state


# ---- blocks ------------------------------------------------------------------------------------------------


@dataclass
class Mamba2Mixer:
    """in_proj -> [gate | conv input | dt]; depthwise causal conv + SiLU; selective scan; gated RMSNorm; out_proj."""

    # conv_weight meets the activations in a conv, D in a cast of its own; the other small arrays meet them in
    # fused elementwise kernels
    WIDEN = ("conv_weight", "D")

    in_proj: Linear
    conv_weight: mx.array  # (conv_dim, K, 1)
    conv_bias: mx.array | None
    dt_bias: mx.array
    A_log: mx.array
    D: mx.array
    norm_weight: mx.array
    out_proj: Linear
    heads: int
    head_dim: int
    groups: int
    state_size: int
    eps: float
    limits: tuple[float, float]
    narrow: mx.Dtype | None = None  # the dtype conv_weight and D were stored in, once `widen` kept them wider
    decay_rate: mx.array = field(init=False, repr=False)  # A = -exp(A_log): a constant, computed once

    def __post_init__(self) -> None:
        self.decay_rate = -mx.exp(self.A_log)
        mx.eval(self.decay_rate)

    @classmethod
    def from_weights(cls, w: Weights, path: str, cfg: TextConfig) -> Mamba2Mixer:
        conv_dim = cfg.mamba_conv_dim
        return cls(
            in_proj=Linear.from_weights(w, f"{path}.in_proj"),
            conv_weight=w.get(f"{path}.conv1d.weight", (conv_dim, cfg.conv_kernel, 1)),
            conv_bias=w.get(f"{path}.conv1d.bias", (conv_dim,)) if cfg.use_conv_bias else None,
            dt_bias=w.get(f"{path}.dt_bias", (cfg.mamba_num_heads,)),
            A_log=w.get(f"{path}.A_log", (cfg.mamba_num_heads,)),
            D=w.get(f"{path}.D", (cfg.mamba_num_heads,)),
            norm_weight=w.get(f"{path}.norm.weight", (cfg.mamba_intermediate,)),
            out_proj=Linear.from_weights(w, f"{path}.out_proj"),
            heads=cfg.mamba_num_heads, head_dim=cfg.mamba_head_dim, groups=cfg.n_groups,
            state_size=cfg.ssm_state_size, eps=cfg.layer_norm_epsilon, limits=cfg.dt_limits,
        )

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.conv_weight.shape[0]

    def _split(self, projected: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        # Checkpoints may pad the projection with two unused d_mlp branches in front of the gate.
        extra = projected.shape[-1] - (self.inner + self.conv_dim + self.heads)
        if extra < 0 or extra % 2:
            raise ValueError(f"Mamba in_proj width {projected.shape[-1]} is not "
                             f"{self.inner + self.conv_dim + self.heads} plus an even padding")
        gate0 = extra
        conv0 = gate0 + self.inner
        dt0 = conv0 + self.conv_dim
        return projected[..., gate0:conv0], projected[..., conv0:dt0], projected[..., dt0:]

    def _conv(self, u: mx.array, cache: MambaCache | None) -> mx.array:
        """u: (B, L, conv_dim) -> SiLU(causal depthwise conv(u)), updating the cache's conv tail."""
        tail = self.conv_weight.shape[1] - 1
        if cache is None:
            padded = mx.pad(u, [(0, 0), (tail, 0), (0, 0)])
        else:
            prev = cache.conv if cache.conv is not None else mx.zeros((u.shape[0], tail, self.conv_dim), u.dtype)
            padded = mx.concatenate([prev, u], axis=1)
            cache.conv = padded[:, -tail:, :]
        y = mx.conv1d(padded, as_stored(self.conv_weight, self.narrow, padded.dtype), 1, 0, 1, self.conv_dim)
        if self.conv_bias is not None:
            y = y + self.conv_bias
        return nn.silu(y)

    def _gated_norm(self, y: mx.array, gate: mx.array) -> mx.array:
        """RMSNorm over each of the `groups` slices of silu(gate) * y, then the weight."""
        y = mx.unflatten(nn.silu(gate) * y, -1, (-1, self.inner // self.groups))
        return self.norm_weight * mx.fast.rms_norm(y, None, self.eps).flatten(-2)

    def __call__(self, x: mx.array, cache: MambaCache | None = None) -> mx.array:
        """x: (B, L, D) -> (B, L, D). With a cache the conv tail and SSM state carry over; L == 1 with a
        cache takes the single-position recurrence."""
        b, length, _ = x.shape
        gate, conv_in, dt = self._split(self.in_proj(x))
        xbc = self._conv(conv_in, cache)
        gn = self.groups * self.state_size
        xs, bs, cs = mx.split(xbc, [self.inner, self.inner + gn], axis=-1)
        xs = xs.reshape(b, length, self.heads, self.head_dim)
        bs = bs.reshape(b, length, self.groups, self.state_size)
        cs = cs.reshape(b, length, self.groups, self.state_size)
        state = cache.ssm if cache is not None else None
        d = self.D.astype(xs.dtype)
        if cache is not None and length == 1:
            y, state = ssm_step(xs, self.decay_rate, bs, cs, d, dt, self.dt_bias, state, self.limits)
        else:
            y, state = ssm_sequence(xs, self.decay_rate, bs, cs, d, dt, self.dt_bias, state, self.limits)
        if cache is not None:
            cache.ssm = state
        y = self._gated_norm(y.reshape(b, length, self.inner), gate)
        return self.out_proj(y)


@dataclass
class Attention:
    """Grouped-query attention without positional encoding (Nemotron-H attention layers use none)."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_weights(cls, w: Weights, path: str, cfg: TextConfig) -> Attention:
        return cls(*(Linear.from_weights(w, f"{path}.{n}_proj") for n in "qkvo"),
                   heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                   head_dim=cfg.attention_head_dim)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """x: (B, L, D) -> q (B, heads, L, Dh), k and v (B, kv_heads, L, Dh)."""
        b, length, _ = x.shape
        q = self.q_proj(x).reshape(b, length, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, length, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, length, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return q, k, v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: FullCache | None) -> mx.array:
        """Causal attention of q over the cache's earlier keys plus k; writes k, v to the cache.
        Returns (B, heads, L, Dh)."""
        if cache is not None:
            k, v = cache.update(k, v)
        mask = "causal" if q.shape[2] > 1 else None
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask=mask)

    def output(self, out: mx.array) -> mx.array:
        """out: (B, heads, L, Dh) -> (B, L, D)."""
        b, _, length, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

    def __call__(self, x: mx.array, cache: FullCache | None = None) -> mx.array:
        """x: (B, L, D) -> (B, L, D); causal over the cache's earlier positions plus these L."""
        return self.output(self.attend(*self.project(x), cache))


@dataclass
class SquaredReluMLP:
    up_proj: Linear
    down_proj: Linear

    @classmethod
    def from_weights(cls, w: Weights, path: str) -> SquaredReluMLP:
        return cls(Linear.from_weights(w, f"{path}.up_proj"), Linear.from_weights(w, f"{path}.down_proj"))

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.relu2(self.up_proj(x)))


@dataclass
class Block:
    """Pre-norm residual block: x + mixer(rms_norm(x)); kind is 'M', '*' or '-'."""

    WIDEN = ("norm_weight",)

    kind: str
    norm_weight: mx.array
    mixer: Mamba2Mixer | Attention | SquaredReluMLP
    eps: float
    narrow: mx.Dtype | None = None  # the dtype norm_weight was stored in, once `widen` kept it wider

    def norm(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, as_stored(self.norm_weight, self.narrow, x.dtype), self.eps)

    def __call__(self, x: mx.array, cache: LayerCache = None) -> mx.array:
        h = self.norm(x)
        h = self.mixer(h) if self.kind == "-" else self.mixer(h, cache)
        return x + h


@dataclass
class NemotronH:
    """The hybrid stack on injected embeddings, ending in norm_f."""

    WIDEN = ("norm_f",)

    blocks: list[Block]
    norm_f: mx.array
    eps: float
    narrow: mx.Dtype | None = None  # the dtype norm_f was stored in, once `widen` kept it wider

    @classmethod
    def from_weights(cls, w: Weights, path: str, cfg: TextConfig) -> NemotronH:
        blocks = []
        for i, kind in enumerate(cfg.hybrid_override_pattern):
            p = f"{path}.layers.{i}"
            if kind == "M":
                mixer = Mamba2Mixer.from_weights(w, f"{p}.mixer", cfg)
            elif kind == "*":
                mixer = Attention.from_weights(w, f"{p}.mixer", cfg)
            else:
                mixer = SquaredReluMLP.from_weights(w, f"{p}.mixer")
            blocks.append(Block(kind, w.get(f"{p}.norm.weight", (cfg.hidden_size,)), mixer, cfg.layer_norm_epsilon))
        return cls(blocks, w.get(f"{path}.norm_f.weight", (cfg.hidden_size,)), cfg.layer_norm_epsilon)

    def make_caches(self, bound: Bound | None = None) -> list[LayerCache]:
        """One cache per block: MambaCache for 'M', FullCache for '*' (holding at most `bound`'s keys), None for
        '-'."""
        return [MambaCache() if b.kind == "M" else FullCache(bound) if b.kind == "*" else None for b in self.blocks]

    def __call__(self, x: mx.array, caches: list[LayerCache] | None = None) -> mx.array:
        """x: (B, L, D) -> (B, L, D). Without caches the whole sequence is computed from scratch."""
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.final_norm(x)

    def final_norm(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, as_stored(self.norm_f, self.narrow, x.dtype), self.eps)


@dataclass
class DuplexLanguageModel:
    """embed_tokens (for the fused input), the Nemotron-H stack, and the text and function heads."""

    embed_tokens: Embedding
    backbone: NemotronH
    lm_head: Linear
    function_head: Linear
    function_channel_weight: float
    hidden_size: int
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    @classmethod
    def from_weights(cls, w: Weights, config: VoiceChatConfig) -> DuplexLanguageModel:
        cfg = config.text_config
        model = cls(
            embed_tokens=Embedding.from_weights(w, "stt_model.embed_tokens"),
            backbone=NemotronH.from_weights(w, "stt_model.llm", cfg),
            lm_head=Linear.from_weights(w, "stt_model.lm_head"),
            function_head=Linear.from_weights(w, "stt_model.function_head"),
            function_channel_weight=float(config.function_channel_weight),
            hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
            pad_id=config.pad_token_id, bos_id=config.bos_token_id, eos_id=config.eos_token_id,
        )
        for name in ("lm_head", "function_head"):
            head = getattr(model, name)
            if (head.out_features, head.in_features) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(f"stt_model.{name}: shape ({head.out_features}, {head.in_features}) differs from "
                                 f"config.json's ({cfg.vocab_size}, {cfg.hidden_size})")
        return model

    def make_caches(self, bound: Bound | None = None) -> list[LayerCache]:
        return self.backbone.make_caches(bound)

    def fuse(self, prev_text: int, audio: mx.array, prev_function: int) -> mx.array:
        """audio: (1, 1, D) -> E(prev_text) + audio + w * E(prev_function), (1, 1, D).

        The sum runs left to right in the dtypes the reference uses (bf16 table rows, w * row in bf16)."""
        return self.fuse_ids(token_ids(prev_text), audio, token_ids(prev_function))

    def fuse_ids(self, prev_text: mx.array, audio: mx.array, prev_function: mx.array) -> mx.array:
        """`fuse` with the two ids given as (1, 1) int32 arrays."""
        text = self.embed_tokens(prev_text)
        function = self.embed_tokens(prev_function)
        return text + audio + self.function_channel_weight * function

    def heads(self, hidden: mx.array) -> tuple[mx.array, mx.array]:
        """hidden: (B, L, D) -> text and function logits, each (B, L, vocab)."""
        return self.lm_head(hidden), self.function_head(hidden)

    def greedy(self, text_logits: mx.array, function_logits: mx.array) -> mx.array:
        """Both heads' logits (B, L, vocab) -> (2,) uint32: the text and function argmax at the last position."""
        return mx.stack([mx.argmax(text_logits[0, -1]), mx.argmax(function_logits[0, -1])])

    @functools.cached_property
    def cached_step(self) -> CachedStep:
        """The compiled single-position step over caches that already hold a position (see `CachedStep`)."""
        return CachedStep(self)

    @functools.cached_property
    def batched_step(self) -> BatchedStep:
        """`cached_step` for several sessions' rows at once (see `BatchedStep`)."""
        return BatchedStep(self)


def token_ids(token: int) -> mx.array:
    """One id as the (1, 1) int32 array the embedding takes."""
    return mx.array([[token]], dtype=mx.int32)


# ---- the compiled single-position step ---------------------------------------------------------------------


class CachedStep:
    """One timeline position through the cached stack as a few compiled pieces, for caches that already hold
    at least one position (every Mamba cache has its conv tail and SSM state, every attention cache a buffer).

    The stack is cut at each attention layer: its cache write and attention run between the pieces, uncompiled,
    because the number of keys grows every position; every other op runs inside a piece. Piece k is a pure
    function (`_piece`). In: the two previous ids and the audio row (piece 0) or the residual stream and
    attention k-1's output (later pieces), plus the conv tail and SSM state of each Mamba layer it runs.
    Out: the residual stream with attention k's q, k, v (or, from the last piece, both heads' logits and the
    greedy ids when `heads`), plus those Mamba states updated. Pieces are traced once per input dtype (the
    prompt prefix may be bf16) and shared by every session; the ops and their order are those of the plain path,
    so the numbers are too.
    """

    def __init__(self, model: DuplexLanguageModel):
        self.model = model
        self.blocks = model.backbone.blocks
        cuts = [i for i, block in enumerate(self.blocks) if block.kind == "*"]
        edges = [-1, *cuts, len(self.blocks)]
        self.ranges = [(edges[k] + 1, edges[k + 1]) for k in range(len(edges) - 1)]
        self.pieces = [mx.compile(functools.partial(self._piece, k)) for k in range(len(self.ranges))]

    def _piece(self, k: int, carried: tuple[mx.array, ...], states: list[mx.array], heads: bool,
               keep: mx.array | None = None) -> tuple[tuple[mx.array, ...], list[mx.array]]:
        """Piece k of the stack: (carried in, [conv, ssm] per Mamba layer) -> (carried out, updated states).
        With `keep` (B,) bool, the rows where it is False give back their states as they came in."""
        model, blocks = self.model, self.blocks
        if k == 0:
            x = model.fuse_ids(*carried)
        else:
            x, attended = carried
            x = x + blocks[self.ranges[k - 1][1]].mixer.output(attended)
        start, end = self.ranges[k]
        pending, updated = iter(states), []
        for block in blocks[start:end]:
            if block.kind == "M":
                before = (next(pending), next(pending))
                cache = MambaCache(*before)
                x = block(x, cache)
                after = (cache.conv, cache.ssm)
                if keep is not None:
                    after = tuple(mx.where(keep.reshape(-1, *[1] * (a.ndim - 1)), a, b)
                                  for a, b in zip(after, before, strict=True))
                updated += after
            else:
                x = block(x)
        if end < len(blocks):
            attention = blocks[end]
            return (x, *attention.mixer.project(attention.norm(x))), updated
        if not heads:
            return (), updated
        text_logits, function_logits = model.heads(model.backbone.final_norm(x))
        return (text_logits, function_logits, self._ids(text_logits, function_logits)), updated

    def _ids(self, text_logits: mx.array, function_logits: mx.array) -> mx.array:
        return self.model.greedy(text_logits, function_logits)

    def __call__(self, prev_text: int, audio: mx.array, prev_function: int, caches: list[LayerCache],
                 heads: bool) -> tuple[mx.array, ...]:
        """audio: (1, 1, D); caches: the session's, advanced in place by one position.
        Returns (text logits, function logits (1, 1, vocab), ids (2,) uint32) when `heads`, else ()."""
        carried: tuple[mx.array, ...] = (token_ids(prev_text), audio, token_ids(prev_function))
        for k, piece in enumerate(self.pieces):
            start, end = self.ranges[k]
            mamba = [caches[i] for i in range(start, end) if self.blocks[i].kind == "M"]
            carried, updated = piece(carried, [a for c in mamba for a in (c.conv, c.ssm)], heads)
            for n, cache in enumerate(mamba):
                cache.conv, cache.ssm = updated[2 * n], updated[2 * n + 1]
            if end < len(self.blocks):
                x, q, k_new, v_new = carried
                carried = (x, self.blocks[end].mixer.attend(q, k_new, v_new, caches[end]))
        return carried


class BatchedStep(CachedStep):
    """`CachedStep` for B sessions at one position each: the pieces run once over their rows stacked along
    axis 0, and each attention layer between them writes each session's keys to its own cache and attends
    over each, in place or stacked as the caller's `stack_up_to` says (`services.common.cache.attend_sessions`).

    Per-session attention keeps every row exact (the same cache write and attention call as the solo step); a
    group stacks the caches once and then writes them in place, so no step copies them. Attention layers are
    few, so this is the only part that grows with B. The pieces are traced once per (B, dtypes) and give each
    row's own greedy ids.
    """

    def _ids(self, text_logits: mx.array, function_logits: mx.array) -> mx.array:
        """(B, L, vocab) each -> (B, 2) uint32: each row's text and function argmax at the last position."""
        return mx.stack([mx.argmax(text_logits[:, -1], axis=-1), mx.argmax(function_logits[:, -1], axis=-1)], axis=-1)

    @functools.cached_property
    def mamba_layers(self) -> list[int]:
        """Indices of the Mamba blocks: the order of the states `__call__` takes and returns."""
        return [i for i, block in enumerate(self.blocks) if block.kind == "M"]

    @functools.cached_property
    def attention_layers(self) -> list[int]:
        """Indices of the attention blocks, whose caches a step writes in place."""
        return [i for i, block in enumerate(self.blocks) if block.kind == "*"]

    def __call__(self, prev_text: mx.array, audio: mx.array, prev_function: mx.array, states: list[mx.array],
                 caches: list[list[LayerCache]], heads: bool = True, active: Sequence[int] | None = None,
                 stack_up_to: int = 0) -> tuple[tuple[mx.array, ...], list[mx.array]]:
        """prev_text, prev_function: (B, 1) int32; audio: (B, 1, D); states: [conv (B, K-1, C), ssm (B, H, P, N)]
        per Mamba layer in stack order, row b being session b's; caches: each session's layer caches, whose
        attention caches advance in place (their Mamba caches are not read or written here).
        Returns ((text logits, function logits (B, 1, vocab), ids (B, 2) uint32), the updated states); the first
        is () without `heads` (a prompt position, whose outputs are not used).

        With `active` (increasing row indices) only those rows step: the other rows' states come back as they
        went in (selected, not recomputed; a bf16 conv tail widened to float32 where the active rows' first
        float32 row widens theirs, which no later step can tell apart), their attention caches are not touched,
        and their outputs are meaningless. Each active row's results are those of a batch of the active rows
        alone: every op but attention is row by row, and attention runs over the active rows' caches only.
        Attention caches of at most `stack_up_to` keys attend stacked (see `attend_sessions`)."""
        carried: tuple[mx.array, ...] = (prev_text, audio, prev_function)
        keep = None
        if active is not None:
            mask = np.zeros(prev_text.shape[0], bool)
            mask[list(active)] = True
            keep = mx.array(mask)
            caches = [caches[r] for r in active]
        pending, updated = iter(states), []
        for k, piece in enumerate(self.pieces):
            start, end = self.ranges[k]
            count = 2 * sum(1 for i in range(start, end) if self.blocks[i].kind == "M")
            carried, out = piece(carried, [next(pending) for _ in range(count)], heads, keep)
            updated += out
            if end < len(self.blocks):
                x, q, k_new, v_new = carried
                layer, scale = [c[end] for c in caches], self.blocks[end].mixer.head_dim**-0.5
                carried = (x, attend_sessions(q, k_new, v_new, layer, scale, stack_up_to, active))
        return carried, updated
