"""Cache-aware FastConformer encoder: causal depthwise-striding subsampling, rel-pos attention, causal conv.

Every module is a pure function of its weights and inputs. The whole-utterance door is `Conformer.__call__`
(mel `(1, T, n_mels)` -> `(1, T', d_model)` with the chunked-limited mask); the streaming door is
`Conformer.step`, which takes every layer's attention and conv caches and returns the updated ones
(the caches live in `streaming.EncoderStream`, never here).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from functools import lru_cache

import mlx.core as mx

from services.common.checkpoint import Weights
from services.common.config import EncoderConfig
from services.common.layers import Linear, Projections, as_stored

NEG_INF = -1e30
# Causal 3x3 stride-2 convs pad (kernel - 1) before and (stride - 1) after, on time and frequency.
SUB_KERNEL, SUB_STRIDE = 3, 2
SUB_PAD = (SUB_KERNEL - 1, SUB_STRIDE - 1)


def subsampled_length(n: int, steps: int) -> int:
    """Length after `steps` causal stride-2 convs: `floor(n / 2) + 1` each, so 128 -> 65 -> 33 -> 17."""
    for _ in range(steps):
        n = (n + SUB_PAD[0] + SUB_PAD[1] - SUB_KERNEL) // SUB_STRIDE + 1
    return n


def chunked_limited_mask(length: int, left: int, right: int) -> mx.array:
    """(length, length) additive mask: 0 where query i sees key j, NEG_INF elsewhere.

    Frames form chunks of `right + 1`; a frame sees its own chunk and `left // (right + 1)` chunks before it.
    With (left, right) = (2, 0): row 3 sees keys 1, 2, 3.
    """
    chunk = right + 1
    back = left // chunk if left >= 0 else length
    idx = mx.arange(length, dtype=mx.int32) // chunk
    diff = idx[:, None] - idx[None, :]
    return mx.where((diff >= 0) & (diff <= back), 0.0, NEG_INF).astype(mx.float32)


def rel_shift(x: mx.array) -> mx.array:
    """x: (B, H, Tq, P) scores against positions P = 2*Tk - 1 (descending) -> same shape, row i shifted so
    column j holds relative position (i - j) for the first Tk columns (Transformer-XL's pad-and-reshape)."""
    b, h, tq, p = x.shape
    x = mx.pad(x, [(0, 0), (0, 0), (0, 0), (1, 0)])
    x = x.reshape(b, h, p + 1, tq)[:, :, 1:, :]
    return x.reshape(b, h, tq, p)


@lru_cache(maxsize=4)
def _position_table(max_len: int, d_model: int) -> mx.array:
    # Built once over positions max_len-1 .. -(max_len-1) and sliced, so every window sees identical rows.
    pos = mx.arange(max_len - 1, -max_len, -1, dtype=mx.int32).astype(mx.float32)[:, None]
    freq = mx.exp(mx.arange(0, d_model, 2, dtype=mx.float32) * -(math.log(10000.0) / d_model))
    angles = pos * freq
    table = mx.stack([mx.sin(angles), mx.cos(angles)], axis=-1).reshape(2 * max_len - 1, d_model)
    mx.eval(table)
    return table


def rel_positions(length: int, d_model: int, max_len: int = 5000) -> mx.array:
    """(1, 2*length - 1, d_model) sinusoids (even channels sin, odd cos) for positions length-1 .. -(length-1)."""
    max_len = max(max_len, length)
    table = _position_table(max_len, d_model)
    centre = max_len - 1
    return table[None, centre - (length - 1) : centre + length]


@dataclass
class LayerNorm:
    weight: mx.array
    bias: mx.array
    eps: float = 1e-5
    narrow: mx.Dtype | None = None  # the dtype weight and bias were stored in, once `widen` kept them wider

    @classmethod
    def from_weights(cls, weights: Weights, path: str) -> LayerNorm:
        return cls(weights.get(f"{path}.weight"), weights.get(f"{path}.bias"))

    def __call__(self, x: mx.array) -> mx.array:
        weight, bias = (as_stored(a, self.narrow, x.dtype) for a in (self.weight, self.bias))
        return mx.fast.layer_norm(x, weight, bias, self.eps)


@dataclass
class Conv:
    """Channels-last conv: weight `(O, *k, I/groups)`; 1-D when the weight is 3-D, 2-D when 4-D."""

    weight: mx.array
    bias: mx.array | None
    stride: int = 1
    groups: int = 1

    @classmethod
    def from_weights(cls, weights: Weights, path: str, *, stride: int = 1, groups: int = 1) -> Conv:
        bias = weights.get(f"{path}.bias") if f"{path}.bias" in weights else None
        return cls(weights.get(f"{path}.weight"), bias, stride, groups)

    def __call__(self, x: mx.array) -> mx.array:
        if self.weight.ndim == 4:
            y = mx.conv2d(x, self.weight, self.stride, 0, 1, self.groups)
        elif self._one_depthwise_step(x):
            # a streaming frame's depthwise conv: its window times the taps, summed over time (the conv's own
            # result bit for bit on the CPU, without a convolution primitive)
            y = (x * self.weight[:, :, 0].T).sum(axis=1, keepdims=True)
        else:
            y = mx.conv1d(x, self.weight, self.stride, 0, 1, self.groups)
        return y + self.bias if self.bias is not None else y

    def _one_depthwise_step(self, x: mx.array) -> bool:
        """A 1-D depthwise conv (one input channel per group) whose input spans exactly one kernel window."""
        channels, kernel, per_group = self.weight.shape
        return per_group == 1 and self.groups == channels and self.stride == 1 and x.shape[1] == kernel


def pointwise(weights: Weights, path: str) -> Linear:
    """A 1x1 conv as the Linear it computes over the channel axis: weight `(O, 1[, 1], I)` read as `(O, I)`. The
    same result as the conv bit for bit on the CPU, as a GEMM rather than a convolution primitive."""
    conv = Conv.from_weights(weights, path)
    if any(size != 1 for size in conv.weight.shape[1:-1]):
        raise ValueError(f"{path}: a pointwise conv needs a 1x1 kernel, got weight shape {conv.weight.shape}")
    return Linear(conv.weight.reshape(conv.weight.shape[0], conv.weight.shape[-1]), conv.bias)


@dataclass
class Subsampling:
    """Causal depthwise-striding 8x subsampling: mel (B, T, F) -> (B, T', d_model)."""

    convs: list[tuple[Conv | Linear, bool, bool]]  # (conv, pad before it, ReLU after it); 1x1 convs as Linear
    out: Linear

    @classmethod
    def from_weights(cls, weights: Weights, path: str, cfg: EncoderConfig) -> Subsampling:
        ch = cfg.subsampling_conv_channels
        convs = [(Conv.from_weights(weights, f"{path}.conv.0", stride=SUB_STRIDE), True, True)]
        for i in range(cfg.subsampling_steps - 1):  # conv.2/3, conv.5/6, ... (ReLUs hold no weights)
            base = 2 + 3 * i
            convs.append((Conv.from_weights(weights, f"{path}.conv.{base}", stride=SUB_STRIDE, groups=ch), True, False))
            convs.append((pointwise(weights, f"{path}.conv.{base + 1}"), False, True))
        return cls(convs, Linear.from_weights(weights, f"{path}.out"))

    def __call__(self, mel: mx.array) -> mx.array:
        x = mel[..., None]  # (B, T, F, 1)
        pad = [(0, 0), SUB_PAD, SUB_PAD, (0, 0)]
        for conv, padded, relu in self.convs:
            x = conv(mx.pad(x, pad) if padded else x)
            if relu:
                x = mx.maximum(x, 0)
        b, t, f, c = x.shape
        return self.out(x.transpose(0, 1, 3, 2).reshape(b, t, c * f))  # channel-major flatten


@dataclass
class RelPosAttention:
    qkv: Projections  # linear_q, linear_k and linear_v, all of one input in self-attention, as one matmul
    out: Linear
    pos: Linear
    bias_u: mx.array  # (H, Dh)
    bias_v: mx.array
    n_heads: int

    @classmethod
    def from_weights(cls, weights: Weights, path: str, n_heads: int) -> RelPosAttention:
        lin = {n: Linear.from_weights(weights, f"{path}.linear_{n}") for n in ("out", "pos")}
        qkv = Projections.from_weights(weights, [f"{path}.linear_{n}" for n in ("q", "k", "v")])
        return cls(qkv, lin["out"], lin["pos"], weights.get(f"{path}.pos_bias_u"),
                   weights.get(f"{path}.pos_bias_v"), n_heads)

    def positions(self, pos_emb: mx.array) -> mx.array:
        """pos_emb: (1, P, D) sinusoids -> (1, H, P, Dh), their projection split into heads. It depends on the
        number of keys only, so a stream computes it once per window length."""
        p = self.pos(pos_emb)
        return p.reshape(p.shape[0], p.shape[1], self.n_heads, -1).transpose(0, 2, 1, 3)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x: (B, T, D) attention inputs -> (queries (B, T, D), keys and values (B, T, 2D)): each row's query,
        key and value projections, from one matmul. A row's projections depend on that row alone, so a stream
        caches its rows' keys and values instead of its inputs and projects only its new rows each step."""
        q, kv = self.qkv.grouped(x, (1, 2))
        return q, kv

    def keys_values(self, x: mx.array) -> mx.array:
        """x: (B, T, D) attention inputs -> (B, T, 2D): each row's key and value projections side by side (what
        a stream's attention cache holds)."""
        return self.project(x)[1]

    def __call__(self, x: mx.array, p: mx.array, mask: mx.array | None) -> mx.array:
        """Self-attention over x: (B, T, D); p: (1, H, 2T - 1, Dh) `positions` of (1, 2T - 1, D) sinusoids;
        mask: additive (T, T) or None."""
        q, kv = self.project(x)
        return self.attend(q, kv, p, mask)

    def attend(self, q: mx.array, projected: mx.array, p: mx.array, mask: mx.array | None) -> mx.array:
        """q: (B, Tq, D) projected queries; projected: (B, Tk, 2D) keys and values as `project` gives them, the
        last Tq rows aligned with the queries; p: (1, H, 2*Tk - 1, Dh) `positions` of (1, 2*Tk - 1, D)
        sinusoids; mask: additive (Tq, Tk) or (B, 1, 1, Tk), or None."""
        b, tq, d = q.shape
        tk = projected.shape[1]
        h = self.n_heads
        dh = d // h
        scale = dh**-0.5
        q = q.reshape(b, tq, h, dh)
        k, v = mx.split(projected, [self.qkv.sizes[1]], axis=-1)
        k = k.reshape(b, tk, h, dh).transpose(0, 2, 1, 3)
        v = v.reshape(b, tk, h, dh).transpose(0, 2, 1, 3)
        q_u = (q + self.bias_u).transpose(0, 2, 1, 3)
        q_v = (q + self.bias_v).transpose(0, 2, 1, 3)
        bd = q_v @ p.swapaxes(-2, -1)
        if tq > 1:  # one query's row needs no shift: rel_shift leaves a single row as it is
            bd = rel_shift(bd)
        bd = bd[:, :, :, :tk] * scale
        if mask is not None:
            bd = bd + mask
        o = mx.fast.scaled_dot_product_attention(q_u, k, v, scale=scale, mask=bd)
        return self.out(o.transpose(0, 2, 1, 3).reshape(b, tq, d))


@dataclass
class FeedForward:
    linear1: Linear
    linear2: Linear

    @classmethod
    def from_weights(cls, weights: Weights, path: str) -> FeedForward:
        return cls(Linear.from_weights(weights, f"{path}.linear1"), Linear.from_weights(weights, f"{path}.linear2"))

    def __call__(self, x: mx.array) -> mx.array:
        h = self.linear1(x)
        return self.linear2(h * mx.sigmoid(h))


@dataclass
class ConvModule:
    """pointwise (D -> 2D) -> GLU -> causal depthwise (k) -> LayerNorm -> SiLU -> pointwise (D -> D)."""

    pointwise1: Linear  # the 1x1 convs as matmuls (`pointwise`)
    depthwise: Conv
    norm: LayerNorm
    pointwise2: Linear

    @classmethod
    def from_weights(cls, weights: Weights, path: str, d_model: int) -> ConvModule:
        return cls(
            pointwise(weights, f"{path}.pointwise_conv1"),
            Conv.from_weights(weights, f"{path}.depthwise_conv", groups=d_model),
            LayerNorm.from_weights(weights, f"{path}.batch_norm"),  # a LayerNorm despite the key name
            pointwise(weights, f"{path}.pointwise_conv2"),
        )

    def gated(self, x: mx.array) -> mx.array:
        """x: (B, T, D) -> GLU output (B, T, D): the depthwise conv's input, which the stream caches."""
        a, gate = mx.split(self.pointwise1(x), 2, axis=-1)
        return a * mx.sigmoid(gate)

    def finish(self, padded: mx.array) -> mx.array:
        """padded: (B, T + k - 1, D) GLU output with its left context -> (B, T, D)."""
        y = self.norm(self.depthwise(padded))
        return self.pointwise2(y * mx.sigmoid(y))


@dataclass
class ConformerBlock:
    norm_ff1: LayerNorm
    ff1: FeedForward
    norm_att: LayerNorm
    attn: RelPosAttention
    norm_conv: LayerNorm
    conv: ConvModule
    norm_ff2: LayerNorm
    ff2: FeedForward
    norm_out: LayerNorm

    @classmethod
    def from_weights(cls, weights: Weights, path: str, cfg: EncoderConfig) -> ConformerBlock:
        def ln(name: str) -> LayerNorm:
            return LayerNorm.from_weights(weights, f"{path}.{name}")

        return cls(
            ln("norm_feed_forward1"), FeedForward.from_weights(weights, f"{path}.feed_forward1"),
            ln("norm_self_att"), RelPosAttention.from_weights(weights, f"{path}.self_attn", cfg.n_heads),
            ln("norm_conv"), ConvModule.from_weights(weights, f"{path}.conv", cfg.d_model),
            ln("norm_feed_forward2"), FeedForward.from_weights(weights, f"{path}.feed_forward2"),
            ln("norm_out"),
        )

    def __call__(self, x: mx.array, positions: mx.array, mask: mx.array, conv_pad: tuple[int, int]) -> mx.array:
        """Whole sequence: x (B, T, D) -> (B, T, D); positions: this layer's `RelPosAttention.positions`."""
        x = x + 0.5 * self.ff1(self.norm_ff1(x))
        xn = self.norm_att(x)
        x = x + self.attn(xn, positions, mask)
        g = self.conv.gated(self.norm_conv(x))
        x = x + self.conv.finish(mx.pad(g, [(0, 0), conv_pad, (0, 0)]))
        x = x + 0.5 * self.ff2(self.norm_ff2(x))
        return self.norm_out(x)

    def step(
        self, x: mx.array, attn_cache: mx.array, conv_cache: mx.array, positions: mx.array, left: int,
        key_mask: mx.array | None = None,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Streaming: x (B, c, D) new frames; attn_cache (B, n, 2D) earlier frames' key and value projections
        (`RelPosAttention.keys_values`, n ≤ left); conv_cache (B, k-1, D) earlier GLU outputs; positions: this
        layer's `RelPosAttention.positions` of (1, 2(n+c)-1, D) sinusoids; key_mask, when some rows' caches are
        front-padded, additive (B, 1, 1, n+c) hiding those padding keys.
        Returns (out (B, c, D), attn_cache', conv_cache')."""
        x = x + 0.5 * self.ff1(self.norm_ff1(x))
        xn = self.norm_att(x)
        q, new = self.attn.project(xn)
        kv = mx.concatenate([attn_cache, new], axis=1)
        # the window is exactly the allowed left context, so only padding needs a mask
        x = x + self.attn.attend(q, kv, positions, key_mask)
        g = self.conv.gated(self.norm_conv(x))
        din = mx.concatenate([conv_cache, g], axis=1)
        x = x + self.conv.finish(din)
        x = x + 0.5 * self.ff2(self.norm_ff2(x))
        return self.norm_out(x), kv[:, max(kv.shape[1] - left, 0) :], din[:, din.shape[1] - conv_cache.shape[1] :]


@dataclass
class Conformer:
    cfg: EncoderConfig
    pre_encode: Subsampling
    layers: list[ConformerBlock]
    # (keys, dtype) -> every layer's projected positions, evaluated: the compiled steps' window length only
    _positions: dict = field(default_factory=dict, repr=False, compare=False)
    _dtypes: dict = field(default_factory=dict, repr=False, compare=False)  # mel dtype -> subsampled dtype
    _zeros: dict = field(default_factory=dict, repr=False, compare=False)  # shape -> `kept_zeros`

    @classmethod
    def from_weights(cls, weights: Weights, path: str, cfg: EncoderConfig) -> Conformer:
        layers = [ConformerBlock.from_weights(weights, f"{path}.layers.{i}", cfg) for i in range(cfg.n_layers)]
        return cls(cfg, Subsampling.from_weights(weights, f"{path}.pre_encode", cfg), layers)

    def __call__(self, mel: mx.array) -> mx.array:
        """Whole utterance: mel (1, T, n_mels) -> (1, subsampled_length(T), d_model)."""
        x = self.pre_encode(mel)
        length = x.shape[1]
        mask = chunked_limited_mask(length, self.cfg.left_context, self.cfg.right_context).astype(x.dtype)
        positions = self.project_positions(length, x.dtype)
        for layer, p in zip(self.layers, positions, strict=True):
            x = layer(x, p, mask, self.cfg.conv_padding)
        return x

    def empty_caches(self) -> tuple[list[mx.array], list[mx.array]]:
        """A stream's caches before its first frame, float32, one of each per layer: the attention cache (1, 0,
        2 * d_model), no frame's key and value projections yet; the conv cache (1, kernel - 1, d_model), zeros.
        They are `kept_zeros`: every fresh stream holds the same arrays."""
        cfg = self.cfg
        attn, conv = self.kept_zeros((1, 0, 2 * cfg.d_model)), self.kept_zeros((1, cfg.conv_kernel_size - 1,
                                                                                cfg.d_model))
        return [attn] * cfg.n_layers, [conv] * cfg.n_layers

    def kept_zeros(self, shape: tuple[int, ...]) -> mx.array:
        """float32 zeros of `shape`, made and evaluated once, then the same array for every caller. A stream's
        caches are replaced by each step, never written in place, so fresh streams may share them; a batch of
        fresh streams then gathers each layer's rows from one array with one take, not a copy of each."""
        zeros = self._zeros.get(shape)
        if zeros is None:
            zeros = mx.zeros(shape, mx.float32)
            mx.eval(zeros)
            self._zeros[shape] = zeros
        return zeros

    def project_positions(self, keys: int, dtype: mx.Dtype) -> list[mx.array]:
        """Every layer's `RelPosAttention.positions` of the 2 * keys - 1 relative positions' sinusoids in `dtype`
        (unevaluated)."""
        pos_emb = rel_positions(keys, self.cfg.d_model, self.cfg.pos_emb_max_len).astype(dtype)
        return [layer.attn.positions(pos_emb) for layer in self.layers]

    def positions(self, keys: int, dtype: mx.Dtype) -> list[mx.array]:
        """`project_positions` for `keys` keys, evaluated once and kept (the compiled steps take them as
        inputs: their window length never changes, so every frame would project the same positions again)."""
        key = (keys, dtype)
        if key not in self._positions:
            self._positions[key] = projected = self.project_positions(keys, dtype)
            mx.eval(projected)
        return self._positions[key]

    def step(
        self, x: mx.array, attn_caches: list[mx.array], conv_caches: list[mx.array],
        key_mask: mx.array | None = None, positions: list[mx.array] | None = None,
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """Streaming over all layers: x (B, c, d_model) subsampled frames -> (B, c, d_model) and new caches;
        key_mask as in `ConformerBlock.step`; positions: `positions(n + c, x.dtype)` (default: projected here)."""
        if positions is None:
            positions = self.project_positions(attn_caches[0].shape[1] + x.shape[1], x.dtype)
        new_attn, new_conv = [], []
        for layer, a, c, p in zip(self.layers, attn_caches, conv_caches, positions, strict=True):
            x, a, c = layer.step(x, a, c, p, self.cfg.left_context, key_mask)
            new_attn.append(a)
            new_conv.append(c)
        return x, new_attn, new_conv

    def stream_step(
        self, window: mx.array, lo: int, hi: int, attn_caches: list[mx.array], conv_caches: list[mx.array],
        positions: list[mx.array] | None = None,
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """One streaming push as a pure function: subsample the mel window (1, W, n_mels), run its encoder
        frames [lo, hi) through every layer. Caches in, (frames (1, hi - lo, d_model), caches') out."""
        return self.step(self.pre_encode(window)[:, lo:hi], attn_caches, conv_caches, positions=positions)

    def padded_stream_step(
        self, window: mx.array, lo: int, hi: int, attn_caches: list[mx.array], conv_caches: list[mx.array],
        key_mask: mx.array, positions: list[mx.array] | None = None,
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """`stream_step` for rows whose attention caches are front-padded to the full left context: key_mask
        (B, 1, 1, left + c) is 0 for a row's real keys and NEG_INF for its padding. Every shape is the full-cache
        one, so sessions whose caches are still filling can step in one batch with any others."""
        return self.step(self.pre_encode(window)[:, lo:hi], attn_caches, conv_caches, key_mask, positions)

    def _kept_positions(self, window: mx.array, lo: int, hi: int, attn_caches: list[mx.array]) -> list[mx.array]:
        """The kept `positions` a step over this window and these caches uses."""
        if window.dtype not in self._dtypes:  # a lazy array's dtype is known without evaluating it
            self._dtypes[window.dtype] = self.pre_encode(window).dtype
        return self.positions(attn_caches[0].shape[1] + hi - lo, self._dtypes[window.dtype])

    @functools.cached_property
    def compiled_padded_stream_step(self):
        """`padded_stream_step` compiled, with the kept positions: traced once per batch size, window shape and
        (lo, hi)."""
        step = mx.compile(self.padded_stream_step)
        return lambda window, lo, hi, attn, conv, key_mask: step(window, lo, hi, attn, conv, key_mask,
                                                                 self._kept_positions(window, lo, hi, attn))

    @functools.cached_property
    def compiled_stream_step(self):
        """`stream_step` compiled, with the kept positions: traced once per window shape and (lo, hi), shared by
        every stream. Streams use it once their attention caches hold the full left context, when every shape
        stops changing."""
        step = mx.compile(self.stream_step)
        return lambda window, lo, hi, attn, conv: step(window, lo, hi, attn, conv,
                                                       self._kept_positions(window, lo, hi, attn))
