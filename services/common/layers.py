"""Linear and embedding layers over checkpoint tensors, dense or affine-quantized.

Both run exactly the MLX ops of `mlx.nn.Linear` / `QuantizedLinear` / `QuantizedEmbedding`, so their
numbers equal the reference's bit for bit. Weights are read from a `Weights` by module path:

    >>> proj = Linear.from_weights(weights, "stt_model.perception.proj")
    >>> proj(x)  # x: (..., in) -> (..., out)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx

from services.common.checkpoint import Weights
from services.common.config import QuantSpec


@dataclass
class Linear:
    """y = x W^T + b; W dense `(out, in)` or packed `(out, in * bits / 32)` with scales and biases."""

    weight: mx.array
    bias: mx.array | None = None
    scales: mx.array | None = None
    biases: mx.array | None = None
    spec: QuantSpec | None = None

    @classmethod
    def from_weights(cls, weights: Weights, path: str, *, bias: bool | None = None) -> Linear:
        spec = weights.quant_spec(path)
        has_bias = f"{path}.bias" in weights if bias is None else bias
        return cls(
            weight=weights.get(f"{path}.weight"),
            bias=weights.get(f"{path}.bias") if has_bias else None,
            scales=weights.get(f"{path}.scales") if spec else None,
            biases=weights.get(f"{path}.biases") if spec else None,
            spec=spec,
        )

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        if self.spec is None:
            return self.weight.shape[1]
        return self.weight.shape[1] * 32 // self.spec.bits

    def __call__(self, x: mx.array) -> mx.array:
        if self.spec is None:
            if self.bias is not None:
                return mx.addmm(self.bias, x, self.weight.T)
            return x @ self.weight.T
        y = mx.quantized_matmul(
            x, self.weight, scales=self.scales, biases=self.biases, transpose=True,
            group_size=self.spec.group_size, bits=self.spec.bits, mode=self.spec.mode,
        )
        return y + self.bias if self.bias is not None else y

    def dense_weight(self) -> mx.array:
        """The weight as a dense matrix (dequantized when stored quantized)."""
        if self.spec is None:
            return self.weight
        return mx.dequantize(self.weight, self.scales, self.biases, group_size=self.spec.group_size,
                             bits=self.spec.bits, mode=self.spec.mode)


@dataclass
class Embedding:
    """Row lookup `table[ids]`, dense or quantized (rows dequantized after the gather)."""

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    spec: QuantSpec | None = None

    @classmethod
    def from_weights(cls, weights: Weights, path: str) -> Embedding:
        spec = weights.quant_spec(path)
        return cls(
            weight=weights.get(f"{path}.weight"),
            scales=weights.get(f"{path}.scales") if spec else None,
            biases=weights.get(f"{path}.biases") if spec else None,
            spec=spec,
        )

    @property
    def num_embeddings(self) -> int:
        return self.weight.shape[0]

    def __call__(self, ids: mx.array) -> mx.array:
        if self.spec is None:
            return self.weight[ids]
        return mx.dequantize(self.weight[ids], self.scales[ids], self.biases[ids],
                             group_size=self.spec.group_size, bits=self.spec.bits, mode=self.spec.mode)

    def as_linear(self, x: mx.array) -> mx.array:
        """x @ table^T, as a tied output head would compute it."""
        return Linear(self.weight, None, self.scales, self.biases, self.spec)(x)


def widen(module: object, dtype: mx.Dtype, kinds: tuple[type, ...] = (Linear,)) -> list[mx.array]:
    """Store the dense `weight` and `bias` of every `kinds` instance under `module` (dataclass fields, lists and
    tuples, recursively) in `dtype` when they are narrower; returns the converted arrays (to evaluate).

    Only for modules whose matmuls and convolutions always see `dtype` activations: MLX promotes a narrower
    weight to the activations' dtype inside every call, a converted copy of the whole weight per call. Stored
    converted once (exactly: every bf16 value is a float32 value), each call computes with the very values it
    used before, so outputs are unchanged; the cost is the wider weights' memory.
    """
    converted: list[mx.array] = []
    if isinstance(module, kinds):
        if getattr(module, "spec", None) is None:  # quantized weights are not promoted
            for name in ("weight", "bias"):
                value = getattr(module, name)
                if value is not None and mx.issubdtype(value.dtype, mx.floating) and value.itemsize < dtype.size:
                    setattr(module, name, value.astype(dtype))
                    converted.append(getattr(module, name))
    elif dataclasses.is_dataclass(module) and not isinstance(module, type):
        for field in dataclasses.fields(module):
            converted += widen(getattr(module, field.name), dtype, kinds)
    elif isinstance(module, list | tuple):
        for item in module:
            converted += widen(item, dtype, kinds)
    return converted
