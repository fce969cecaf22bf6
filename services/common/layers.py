"""Linear and embedding layers over checkpoint tensors, dense or affine-quantized.

Both run exactly the MLX ops of `mlx.nn.Linear` / `QuantizedLinear` / `QuantizedEmbedding`, so their
numbers equal the reference's bit for bit; the one exception is a dense layer that `split_matmuls` marked, whose
float32 inputs go to `split_matmul` (a CUDA GPU's tensor cores: float32's accuracy, not the same bits).
Weights are read from a `Weights` by module path:

    proj = Linear.from_weights(weights, "stt_model.perception.proj")
    proj(x)  # x: (..., in) -> (..., out)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from services.common import split_matmul
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
    # The dtype the arrays named in `widened` were stored in before `widen` kept them wider; an input of that
    # dtype computes with them cast back (exactly: they hold values of that dtype), as it did before.
    narrow: mx.Dtype | None = None
    widened: tuple[str, ...] = ()
    # float32 inputs meet the dense bf16 weight in `split_matmul` (a CUDA GPU's tensor cores), not in a cast
    split: bool = False

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
        weight, bias, scales, biases = self.weight, self.bias, self.scales, self.biases
        if self.narrow is not None and x.dtype == self.narrow:  # as stored before `widen`: cast back
            arrays = {"weight": weight, "bias": bias, "scales": scales, "biases": biases}
            weight, bias, scales, biases = (a.astype(self.narrow) if name in self.widened else a
                                            for name, a in arrays.items())
        if self.spec is None:
            if self.split and x.dtype == mx.float32:
                y = split_matmul.split_matmul(x, weight)
                return y + bias if bias is not None else y
            if bias is not None:
                return mx.addmm(bias, x, weight.T)
            return x @ weight.T
        # Every row of x as one matrix: MLX's CUDA kernel takes the axes before the last two as separate problems,
        # each reading the whole weight, so a batched step's (B, 1, K) would read it B times; (B, K) reads it once.
        # Each output row is its own dot products either way (on the CPU bit for bit: tests/unit/test_layers.py).
        y = mx.quantized_matmul(
            x.reshape(-1, x.shape[-1]), weight, scales=scales, biases=biases, transpose=True,
            group_size=self.spec.group_size, bits=self.spec.bits, mode=self.spec.mode,
        ).reshape(*x.shape[:-1], -1)
        return y + bias if bias is not None else y

    def dense_weight(self) -> mx.array:
        """The weight as a dense matrix (dequantized when stored quantized)."""
        if self.spec is None:
            return self.weight
        return mx.dequantize(self.weight, self.scales, self.biases, group_size=self.spec.group_size,
                             bits=self.spec.bits, mode=self.spec.mode)


@dataclass
class Projections:
    """Several linear projections of one input, as one matmul where their weights are stored alike (dense of one
    dtype, or quantized with one spec, all with or all without a bias): y = x [W_1; W_2; ...]^T, split back into
    each projection's output. Each output column is its own row's dot product either way, so the outputs are
    those of the separate layers (the parity tests hold the joined path to them); one kernel, not one each.

        q, k, v = Projections.from_weights(weights, [f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"])(x)
    """

    joined: Linear | None
    parts: list[Linear]  # the separate layers; empty once joined (their weights then live in `joined` only)
    sizes: tuple[int, ...]

    @classmethod
    def from_weights(cls, weights: Weights, paths: list[str]) -> Projections:
        """The projections at `paths`, joined when they can be. Joined weights are evaluated at once and their
        sources dropped from `weights`, so loading never holds both copies of more than one group."""
        parts = [Linear.from_weights(weights, path) for path in paths]
        sizes = tuple(part.out_features for part in parts)
        joined = _joined(parts)
        if joined is None:
            return cls(None, parts, sizes)
        mx.eval([a for a in (joined.weight, joined.bias, joined.scales, joined.biases) if a is not None])
        for path in paths:
            for name in ("weight", "bias", "scales", "biases"):
                weights.arrays.pop(f"{path}.{name}", None)
        return cls(joined, [], sizes)

    def __call__(self, x: mx.array) -> list[mx.array]:
        return self.grouped(x, (1,) * len(self.sizes))

    def grouped(self, x: mx.array, counts: Sequence[int]) -> list[mx.array]:
        """The projections of x in consecutive groups of `counts` projections, each group's side by side along
        the last axis: views of the joined matmul's output (the separate layers' outputs concatenated when the
        projections could not join). `grouped(x, (1, 2))` of q, k, v is [q, k and v side by side]."""
        if sum(counts) != len(self.sizes) or any(count < 1 for count in counts):
            raise ValueError(f"groups of {list(counts)} projections do not cover the {len(self.sizes)} projections")
        if self.joined is None:
            outputs, groups, first = [part(x) for part in self.parts], [], 0
            for count in counts:
                group = outputs[first : first + count]
                groups.append(group[0] if count == 1 else mx.concatenate(group, axis=-1))
                first += count
            return groups
        cuts, first, total = [], 0, 0
        for count in counts[:-1]:
            total += sum(self.sizes[first : first + count])
            first += count
            cuts.append(total)
        return mx.split(self.joined(x), cuts, axis=-1)


def _narrower(value: mx.array | None, dtype: mx.Dtype) -> bool:
    return value is not None and mx.issubdtype(value.dtype, mx.floating) and value.itemsize < dtype.size


def _joined(parts: list[Linear]) -> Linear | None:
    """The layers' weights stacked along the output axis as one Linear; None unless they are stored alike."""
    first = parts[0]
    alike = all(
        p.spec == first.spec and p.weight.dtype == first.weight.dtype and p.weight.shape[1:] == first.weight.shape[1:]
        and (p.bias is None) == (first.bias is None)
        and (p.scales is None or (p.scales.dtype == first.scales.dtype and p.biases.dtype == first.biases.dtype))
        for p in parts)
    if not alike or (first.bias is not None and any(p.bias.dtype != first.bias.dtype for p in parts)):
        return None

    def stack(name: str) -> mx.array | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else mx.concatenate(values, axis=0)

    return Linear(stack("weight"), stack("bias"), stack("scales"), stack("biases"), first.spec)


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
    """Store the float arrays of every `kinds` instance under `module` (dataclass fields, lists and tuples,
    recursively) in `dtype` when they are narrower: a dense layer's `weight` and `bias`, a quantized layer's
    `scales`, `biases` and `bias`, or the fields a class names in its `WIDEN`; returns the converted arrays (to
    evaluate).

    MLX converts a narrower weight (or a quantized layer's scales and biases) to the activations' dtype inside
    every call: a converted copy per call, a kernel of its own wherever the consumer is a matmul, a conv or a
    norm. Stored converted once (exactly: every bf16 value is a float32 value), each call computes with the very
    values it used before, so outputs are unchanged; the cost is the wider arrays' memory. A module with a
    `narrow` field records the dtype its arrays had; it computes with them cast back (`as_stored`) for inputs
    of that dtype, so modules that also see narrow activations compute as before too.
    """
    converted: list[mx.array] = []
    if isinstance(module, kinds) and not getattr(module, "split", False):  # a split Linear keeps its bf16 weight
        quantized = getattr(module, "spec", None) is not None
        fields = ("scales", "biases", "bias") if quantized else getattr(module, "WIDEN", ("weight", "bias"))
        names = [name for name in fields if _narrower(getattr(module, name), dtype)]
        if hasattr(module, "narrow"):
            if len({getattr(module, name).dtype for name in names}) > 1 or (names and module.narrow is not None):
                raise ValueError(f"widen: a {type(module).__name__}'s arrays must share one narrower dtype and be "
                                 "widened once")
            if names:
                module.narrow = getattr(module, names[0]).dtype
                if isinstance(module, Linear):
                    module.widened = tuple(names)
        for name in names:
            setattr(module, name, getattr(module, name).astype(dtype))
            converted.append(getattr(module, name))
    for child in _children(module):
        converted += widen(child, dtype, kinds)
    return converted


def route_split_matmuls(modules: object, model_dir: object, hint: str = "") -> int:
    """`--split-matmuls` at load: `split_matmuls(modules)`, failing when no projection qualifies (a checkpoint
    whose projections are all quantized); `hint` ends that message. Returns how many layers were routed."""
    count = split_matmuls(modules)
    if not count:
        raise ValueError(f"{model_dir}: no dense bf16 projection for split matmuls (quantized ones stay "
                         f"quantized{hint})")
    return count


def split_matmuls(module: object) -> int:
    """Have every dense Linear under `module` whose weight `split_matmul` supports (bf16, both sides multiples
    of 16) take float32 inputs through it; returns how many do. Call it before `widen`, which then leaves those
    weights in bf16. Inputs of any other dtype compute as before."""
    routed = [m for m in linears(module) if m.spec is None and split_matmul.supports(m.weight)]
    for layer in routed:
        layer.split = True
    return len(routed)


def linears(module: object) -> list[Linear]:
    """Every Linear under `module` (itself included), in the order its fields and items hold them."""
    found = [module] if isinstance(module, Linear) else []
    for child in _children(module):
        found += linears(child)
    return found


def _children(module: object) -> list[object]:
    """The values a module holds: a dataclass's fields, a list's or tuple's items (others hold none)."""
    if dataclasses.is_dataclass(module) and not isinstance(module, type):
        return [getattr(module, field.name) for field in dataclasses.fields(module)]
    if isinstance(module, list | tuple):
        return list(module)
    return []


def as_stored(array: mx.array, narrow: mx.Dtype | None, dtype: mx.Dtype) -> mx.array:
    """A `widen`ed array as a computation over `dtype` activations saw it before: cast back (exactly) to the
    `narrow` dtype it was stored in for activations of that dtype, else itself."""
    return array.astype(narrow) if narrow is not None and dtype == narrow else array
