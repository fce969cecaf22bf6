"""Split matmuls: float32 activations times bf16 weights on a CUDA GPU's tensor cores, at float32's accuracy.

The kernels run on CUDA only: the tests of their numbers are marked `gpu` (`pytest -m gpu` on a CUDA host).
What decides which layers take them, and what happens without a GPU, is tested everywhere.
"""

import mlx.core as mx
import numpy as np
import pytest

from services.common import layers, split_matmul
from services.common.config import QuantSpec
from services.common.layers import Linear, widen
from services.llm.engine import LanguageEngine

RNG = np.random.default_rng(0)
_on_cuda = pytest.mark.skipif(not split_matmul.available(), reason="the split kernels run on a CUDA GPU only")


def cuda(test):
    """A test of the kernels' numbers: marked `gpu` (run with -m gpu) and skipped without a CUDA device."""
    return pytest.mark.gpu(_on_cuda(test))


def _array(*shape: int, dtype=mx.float32, scale: float = 1.0) -> mx.array:
    return mx.array((scale * RNG.standard_normal(shape)).astype(np.float32)).astype(dtype)


def test_only_dense_bf16_weights_with_sides_of_multiples_of_16_are_split():
    spec = QuantSpec(group_size=32, bits=4)
    packed, scales, biases = mx.quantize(_array(64, 64), group_size=32, bits=4)
    split = Linear(_array(48, 32, dtype=mx.bfloat16))
    model = {
        "split": split,
        "narrow side": Linear(_array(40, 32, dtype=mx.bfloat16)),
        "float32": Linear(_array(48, 32)),
        "quantized": Linear(packed, None, scales, biases, spec),
        "nested": [Linear(_array(16, 64, dtype=mx.bfloat16))],
    }
    assert layers.split_matmuls(list(model.values())) == 2
    assert [layer.split for layer in list(model.values())[:4]] == [True, False, False, False]
    assert model["nested"][0].split


def test_widen_leaves_a_split_layer_in_bf16_and_widens_the_others():
    split, other = Linear(_array(32, 32, dtype=mx.bfloat16)), Linear(_array(40, 32, dtype=mx.bfloat16))
    layers.split_matmuls([split, other])
    converted = widen([split, other], mx.float32)
    assert split.weight.dtype == mx.bfloat16 and split.narrow is None
    assert other.weight.dtype == mx.float32 and other.narrow == mx.bfloat16
    assert len(converted) == 1


def test_a_split_layer_sends_float32_inputs_to_the_kernel_and_bf16_inputs_to_the_plain_matmul(monkeypatch):
    weight, bias = _array(32, 16, dtype=mx.bfloat16), _array(32)
    calls = []

    def kernel(x, w):
        calls.append((x.dtype, x.shape))
        return x @ w.astype(mx.float32).T

    monkeypatch.setattr(split_matmul, "split_matmul", kernel)
    layer = Linear(weight, bias, split=True)
    x = _array(3, 1, 16)
    y = layer(x)
    assert calls == [(mx.float32, (3, 1, 16))]
    np.testing.assert_array_equal(np.array(y), np.array(x @ weight.astype(mx.float32).T + bias))
    narrow = x.astype(mx.bfloat16)
    np.testing.assert_array_equal(np.array(layer(narrow)), np.array(mx.addmm(bias, narrow, weight.T)))
    assert len(calls) == 1


def test_without_a_cuda_device_the_language_engine_refuses_split_matmuls(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(split_matmul, "available", lambda: False)
    with pytest.raises(ValueError, match="CUDA"):
        LanguageEngine.load(tiny_checkpoint, split_matmuls=True)


def test_split_matmuls_need_dense_bf16_projections(tiny4_checkpoint, monkeypatch):
    monkeypatch.setattr(split_matmul, "available", lambda: True)  # the check comes after the load: no kernel runs
    with pytest.raises(ValueError, match="no dense bf16 projection"):
        LanguageEngine.load(tiny4_checkpoint, split_matmuls=True)


def test_the_kernel_refuses_inputs_it_was_not_built_for():
    with pytest.raises(ValueError, match="multiples of 16"):
        split_matmul.split_matmul(_array(2, 32), _array(40, 32, dtype=mx.bfloat16))
    with pytest.raises(ValueError, match="float32 x"):
        split_matmul.split_matmul(_array(2, 32, dtype=mx.bfloat16), _array(48, 32, dtype=mx.bfloat16))


@cuda
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 48, 32), (3, 144, 64), (16, 272, 512), (21, 256, 4480),
                                               (40, 1024, 128)])
def test_the_split_product_has_float32_accuracy_against_float64(rows, n, k):
    x = _array(2, rows, k, scale=4.0)
    weight = _array(n, k, dtype=mx.bfloat16, scale=0.05)
    y = split_matmul.split_matmul(x, weight)
    assert y.shape == (2, rows, n) and y.dtype == mx.float32
    exact = np.array(x).astype(np.float64) @ np.array(weight.astype(mx.float32)).astype(np.float64).T
    float32 = np.array(x @ weight.astype(mx.float32).T)
    scale = np.abs(exact).max()
    error = np.abs(np.array(y) - exact).max() / scale
    assert error <= max(4 * np.abs(float32 - exact).max() / scale, 1e-6), error


@cuda
def test_a_rows_result_does_not_depend_on_the_other_rows():
    weight = _array(528, 4480, dtype=mx.bfloat16, scale=0.05)
    x = _array(19, 4480)
    together = np.array(split_matmul.split_matmul(x, weight))
    for i in (0, 7, 15, 16, 18):
        alone = np.array(split_matmul.split_matmul(x[i : i + 1], weight))
        np.testing.assert_array_equal(together[i : i + 1], alone)
    shuffled = np.array(split_matmul.split_matmul(x[::-1], weight))
    np.testing.assert_array_equal(shuffled[::-1], together)


@cuda
def test_the_language_engine_with_split_matmuls_gives_the_float32_weights_ids_and_near_logits(tiny_checkpoint):
    embeds = [_array(3, 128) for _ in range(12)]
    results = []
    for split in (False, True):
        engine = LanguageEngine.load(tiny_checkpoint, float32_weights=True, split_matmuls=split)
        sessions = [engine.open_session() for _ in range(3)]
        rows = []
        for frame in embeds:
            outs = engine.step_batch([(s, frame[i], True, None) for i, s in enumerate(sessions)])
            rows.append([(o.text_id, o.function_id, np.array(o.text_logits)) for o in outs])
        results.append(rows)
    for plain, split in zip(*results, strict=True):
        assert [r[:2] for r in plain] == [r[:2] for r in split]
        for a, b in zip(plain, split, strict=True):
            np.testing.assert_allclose(b[2], a[2], atol=1e-4, rtol=0)
