"""Projections: several projections of one input joined into one matmul give each layer's own output."""

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from services.common.checkpoint import Weights
from services.common.config import QuantSpec
from services.common.layers import Linear, Projections, linears

RNG = np.random.default_rng(0)


def _weights(arrays: dict[str, mx.array], specs: dict[str, QuantSpec] | None = None) -> Weights:
    specs = specs or {}
    return Weights(SimpleNamespace(path="test", quant_spec=lambda module: specs.get(module)), dict(arrays))


def _dense(out: int, inp: int, dtype=mx.bfloat16) -> mx.array:
    return mx.array(RNG.standard_normal((out, inp)).astype(np.float32)).astype(dtype)


def _quantized(prefix: str, out: int, inp: int, spec: QuantSpec) -> dict[str, mx.array]:
    weight, scales, biases = mx.quantize(_dense(out, inp, mx.float32), group_size=spec.group_size, bits=spec.bits)
    return {f"{prefix}.weight": weight, f"{prefix}.scales": scales, f"{prefix}.biases": biases}


def _separately(arrays: dict[str, mx.array], paths: list[str], specs=None, x: mx.array | None = None):
    return [Linear.from_weights(_weights(arrays, specs), path)(x) for path in paths]


@pytest.mark.parametrize("rows", [1, 2, 32])
def test_joined_dense_projections_equal_the_separate_layers_bit_for_bit(rows):
    arrays = {"a.q.weight": _dense(96, 64), "a.k.weight": _dense(32, 64), "a.v.weight": _dense(32, 64)}
    paths = ["a.q", "a.k", "a.v"]
    x = mx.array(RNG.standard_normal((rows, 1, 64)).astype(np.float32))
    weights = _weights(arrays)
    projections = Projections.from_weights(weights, paths)
    assert projections.joined is not None and projections.parts == [] and projections.sizes == (96, 32, 32)
    assert not any(key.startswith("a.") for key in weights.arrays)  # the sources are dropped once joined
    for got, want in zip(projections(x), _separately(arrays, paths, x=x), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.array(got), np.array(want))


def test_joined_biased_and_quantized_projections_equal_the_separate_layers():
    x = mx.array(RNG.standard_normal((3, 128)).astype(np.float32))
    biased = {"b.k.weight": _dense(64, 128, mx.float32), "b.k.bias": _dense(1, 64, mx.float32)[0],
              "b.v.weight": _dense(48, 128, mx.float32), "b.v.bias": _dense(1, 48, mx.float32)[0]}
    spec = QuantSpec(bits=4, group_size=64)
    quantized = {**_quantized("c.k", 64, 128, spec), **_quantized("c.v", 32, 128, spec)}
    specs = {"c.k": spec, "c.v": spec}
    for arrays, paths, specs_ in ((biased, ["b.k", "b.v"], None), (quantized, ["c.k", "c.v"], specs)):
        projections = Projections.from_weights(_weights(arrays, specs_), paths)
        assert projections.joined is not None
        for got, want in zip(projections(x), _separately(arrays, paths, specs_, x=x), strict=True):
            np.testing.assert_array_equal(np.array(got), np.array(want))


def test_projections_stored_differently_stay_separate():
    x = mx.array(RNG.standard_normal((2, 128)).astype(np.float32))
    four, eight = QuantSpec(bits=4, group_size=64), QuantSpec(bits=8, group_size=64)
    cases = [
        ({"d.a.weight": _dense(16, 128), "d.b.weight": _dense(16, 128, mx.float32)}, None),  # two dtypes
        ({"d.a.weight": _dense(16, 128), "d.b.weight": _dense(16, 128), "d.b.bias": _dense(1, 16)[0]}, None),
        ({**_quantized("d.a", 64, 128, four), **_quantized("d.b", 64, 128, eight)}, {"d.a": four, "d.b": eight}),
        ({**_quantized("d.a", 64, 128, four), "d.b.weight": _dense(16, 128)}, {"d.a": four}),
    ]
    for arrays, specs in cases:
        weights = _weights(arrays, specs)
        projections = Projections.from_weights(weights, ["d.a", "d.b"])
        assert projections.joined is None and len(projections.parts) == 2
        assert set(weights.arrays) == set(arrays)  # nothing dropped
        for got, want in zip(projections(x), _separately(arrays, ["d.a", "d.b"], specs, x=x), strict=True):
            np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("quantized", [False, True])
def test_widened_layers_compute_as_before_for_float32_and_narrow_inputs(quantized):
    """`widen` keeps a bf16 layer's arrays in float32 (scales and biases of a quantized one): float32 inputs get
    the very numbers the promoted bf16 arrays gave, and bf16 inputs compute with the arrays cast back, exactly
    as the bf16 layer does (not promoted to a float32 matmul)."""
    from services.common.layers import widen

    spec = QuantSpec(bits=4, group_size=64)
    if quantized:
        w, scales, biases = mx.quantize(_dense(64, 128, mx.float32), group_size=64, bits=4)
        arrays = {"e.weight": w, "e.scales": scales.astype(mx.bfloat16), "e.biases": biases.astype(mx.bfloat16),
                  "e.bias": _dense(1, 64)[0]}
    else:
        arrays = {"e.weight": _dense(64, 128), "e.bias": _dense(1, 64)[0]}
    specs = {"e": spec} if quantized else None
    plain = Linear.from_weights(_weights(arrays, specs), "e")
    wide = Linear.from_weights(_weights(arrays, specs), "e")
    converted = widen(wide, mx.float32)
    assert len(converted) == (3 if quantized else 2) and all(a.dtype == mx.float32 for a in converted)
    assert wide.narrow == mx.bfloat16
    assert wide.widened == (("scales", "biases", "bias") if quantized else ("weight", "bias"))
    for dtype in (mx.float32, mx.bfloat16):
        x = mx.array(RNG.standard_normal((3, 128)).astype(np.float32)).astype(dtype)
        got, want = wide(x), plain(x)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))
    with pytest.raises(ValueError, match="widened once"):
        wide.widened = ("weight",)
        wide.bias = wide.bias.astype(mx.bfloat16)
        widen(wide, mx.float32)


def test_widened_norms_compute_as_before_for_float32_and_narrow_inputs():
    """The norms `widen` keeps in float32 (the fields their classes name in `WIDEN`) give float32 inputs the
    numbers their promoted bf16 arrays gave, and bf16 inputs the bf16 computation, bit for bit."""
    from services.common.layers import widen
    from services.llm.nemotron_h import Block, NemotronH
    from services.perception.conformer import LayerNorm
    from services.tts.blocks import GemmaRMSNorm

    d = 64
    kinds = (LayerNorm, GemmaRMSNorm, Block, NemotronH)
    arrays = [_dense(1, d)[0] for _ in range(2)]
    makers = [  # (build from the same bf16 arrays, the norm to call)
        (lambda: LayerNorm(*arrays), lambda m: m),
        (lambda: GemmaRMSNorm.of(arrays[0], 1e-6), lambda m: m),
        (lambda: Block("-", arrays[0], Linear(_dense(d, d)), 1e-5), lambda m: m.norm),
        (lambda: NemotronH([], arrays[1], 1e-5), lambda m: m.final_norm),
    ]
    for make, norm in makers:
        plain, wide = make(), make()
        converted = widen(wide, mx.float32, kinds)
        assert converted and all(a.dtype == mx.float32 for a in converted) and wide.narrow == mx.bfloat16
        for dtype in (mx.float32, mx.bfloat16):
            x = mx.array(RNG.standard_normal((3, d)).astype(np.float32)).astype(dtype)
            got, want = norm(wide)(x), norm(plain)(x)
            assert got.dtype == want.dtype and mx.array_equal(got, want).item()
        with pytest.raises(ValueError, match="widened once"):
            for name in getattr(wide, "WIDEN", ("weight", "bias")):
                setattr(wide, name, getattr(wide, name).astype(mx.bfloat16))
            widen(wide, mx.float32, kinds)


def test_linears_finds_every_layer_under_fields_and_items_in_order():
    @dataclasses.dataclass
    class Block:
        first: Linear
        rest: list
        other: object = None

    layers = [Linear(mx.zeros((2, 2))) for _ in range(4)]
    model = [Block(layers[0], [layers[1], (layers[2],)], other="not a layer"), layers[3], mx.zeros((1,))]
    assert [id(x) for x in linears(model)] == [id(x) for x in layers]
    assert [id(x) for x in linears(layers[0])] == [id(layers[0])] and linears(mx.zeros((2,))) == []


def test_grouped_projections_are_the_layers_outputs_side_by_side_joined_or_not():
    """`grouped(x, (1, 2))` of q, k, v is [q, k beside v], for joined projections (views of the one matmul's
    output) and for ones that could not join (the layers' own outputs concatenated) alike."""
    x = mx.array(RNG.standard_normal((2, 3, 64)).astype(np.float32))
    joined = {"e.q.weight": _dense(48, 64), "e.k.weight": _dense(32, 64), "e.v.weight": _dense(16, 64)}
    apart = {**joined, "e.v.weight": _dense(16, 64, mx.float32)}  # another dtype: not joined
    paths = ["e.q", "e.k", "e.v"]
    for arrays, is_joined in ((joined, True), (apart, False)):
        q, k, v = (np.array(a) for a in _separately(arrays, paths, x=x))
        projections = Projections.from_weights(_weights(arrays), paths)
        assert (projections.joined is not None) == is_joined
        first, rest = projections.grouped(x, (1, 2))
        np.testing.assert_array_equal(np.array(first), q)
        np.testing.assert_array_equal(np.array(rest), np.concatenate([k, v], axis=-1))
        [every] = projections.grouped(x, (3,))
        np.testing.assert_array_equal(np.array(every), np.concatenate([q, k, v], axis=-1))
        for counts in ((1, 1), (2, 2), (0, 3)):
            with pytest.raises(ValueError, match="do not cover"):
                projections.grouped(x, counts)


@pytest.mark.parametrize("shape", [(5, 1), (2, 3), (1, 4)])
def test_a_quantized_layer_multiplies_every_row_as_one_matrix(monkeypatch, shape):
    """A batched step's (B, 1, K) goes to the quantized kernel as (B, K): on CUDA the leading axes of a 3-D input
    are separate problems, each reading the whole weight. The output keeps x's leading axes and every row equals
    that row multiplied alone."""
    spec = QuantSpec(bits=4, group_size=64)
    layer = Linear.from_weights(_weights(_quantized("q", 48, 128, spec), {"q": spec}), "q")
    x = mx.array(RNG.standard_normal((*shape, 128)).astype(np.float32))
    seen, kernel = [], mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda a, *args, **kw: seen.append(a.shape) or kernel(a, *args, **kw))
    y = layer(x)
    assert seen == [(shape[0] * shape[1], 128)] and y.shape == (*shape, 48)
    alone = [[np.array(layer(x[i, j][None]))[0] for j in range(shape[1])] for i in range(shape[0])]
    np.testing.assert_array_equal(np.array(y), np.array(alone))
