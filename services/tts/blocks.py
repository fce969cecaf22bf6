"""Small building blocks shared by the EAR-TTS networks: the two offset RMSNorms and the gated MLP.

Two norms on purpose: the Gemma-3 backbone adds one to its weight in the weight's own dtype (bf16), while
the subword encoder, fusion and MoG head run the norm in float32 and cast back:

    >>> OffsetRMSNorm.of(mx.zeros((4,)), 1e-6)(mx.ones((1, 4)))  # weight 0 means scale 1
    array([[1, 1, 1, 1]], dtype=float32)
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from services.common.checkpoint import Weights
from services.common.layers import Linear, Projections, as_stored


@dataclass
class GemmaRMSNorm:
    """rms_norm(x) * scale, where scale = 1 + w is computed once, in the weight's dtype; x: (..., D)."""

    WIDEN = ("scale",)

    scale: mx.array
    eps: float
    narrow: mx.Dtype | None = None  # the dtype scale had, once `widen` kept it wider

    @classmethod
    def from_weights(cls, weights: Weights, path: str, eps: float) -> GemmaRMSNorm:
        return cls.of(weights.get(f"{path}.weight"), eps)

    @classmethod
    def of(cls, weight: mx.array, eps: float) -> GemmaRMSNorm:
        scale = 1.0 + weight
        mx.eval(scale)  # a constant of every call, not an addition in each
        return cls(scale, eps)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, as_stored(self.scale, self.narrow, x.dtype), self.eps)


@dataclass
class OffsetRMSNorm:
    """rms_norm(x) * scale computed in float32, where scale = 1 + w in float32 is computed once; returned in x's
    dtype; x: (..., D)."""

    scale: mx.array
    eps: float

    @classmethod
    def from_weights(cls, weights: Weights, path: str, eps: float) -> OffsetRMSNorm:
        return cls.of(weights.get(f"{path}.weight"), eps)

    @classmethod
    def of(cls, weight: mx.array, eps: float) -> OffsetRMSNorm:
        scale = 1.0 + weight.astype(mx.float32)
        mx.eval(scale)  # a constant of every call, not a conversion and an addition in each
        return cls(scale, eps)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x.astype(mx.float32), self.scale, self.eps).astype(x.dtype)


@dataclass
class GatedMLP:
    """down(gelu_tanh(gate(x)) * up(x)); x: (..., D) -> (..., D)."""

    gate_up: Projections  # gate_proj and up_proj as one matmul
    down_proj: Linear

    @classmethod
    def from_weights(cls, weights: Weights, path: str) -> GatedMLP:
        return cls(Projections.from_weights(weights, [f"{path}.gate_proj", f"{path}.up_proj"]),
                   Linear.from_weights(weights, f"{path}.down_proj"))

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_up(x)
        return self.down_proj(nn.gelu_approx(gate) * up)
