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
from services.common.loading import LoadOptions
from services.llm.engine import LanguageEngine
from services.perception.engine import PerceptionEngine
from services.tts.engine import TTSEngine

RNG = np.random.default_rng(0)
WIDE, WIDE_SPLIT = LoadOptions(float32_weights=True), LoadOptions(float32_weights=True, split_matmuls=True)
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
        LanguageEngine.load(tiny_checkpoint, options=LoadOptions(split_matmuls=True))


def test_split_matmuls_need_dense_bf16_projections(tiny4_checkpoint, monkeypatch):
    monkeypatch.setattr(split_matmul, "available", lambda: True)  # the check comes after the load: no kernel runs
    with pytest.raises(ValueError, match="no dense bf16 projection"):
        LanguageEngine.load(tiny4_checkpoint, options=LoadOptions(split_matmuls=True))


@pytest.mark.parametrize("engine", [PerceptionEngine, TTSEngine])
def test_without_a_cuda_device_perception_and_speech_refuse_split_matmuls(engine, tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(split_matmul, "available", lambda: False)
    with pytest.raises(ValueError, match="CUDA"):
        engine.load(tiny_checkpoint, LoadOptions(split_matmuls=True))


def test_a_mixed_bit_checkpoint_routes_only_its_dense_projections(tinymix_checkpoint, monkeypatch):
    monkeypatch.setattr(split_matmul, "available", lambda: True)  # nothing runs: routing is decided at load
    engine = PerceptionEngine.load(tinymix_checkpoint, options=LoadOptions(split_matmuls=True))
    modules = [engine.encoder, engine.proj, engine.rnnt.joint]
    everything = layers.linears(modules)
    dense = [m for m in everything if m.spec is None and split_matmul.supports(m.weight)]
    assert 0 < len(dense) < len(everything)  # the map keeps a few perception layers dense
    assert [m for m in everything if m.split] == dense
    with pytest.raises(ValueError, match="no dense bf16 projection"):  # every speech projection is quantized
        TTSEngine.load(tinymix_checkpoint, options=LoadOptions(split_matmuls=True))


def _float32_product(calls):
    def kernel(x, w):  # the product the float32-weights path computes, standing in for the CUDA kernel
        calls.append(w.shape)
        return x @ w.astype(mx.float32).T
    return kernel


def _split_linears(modules) -> list[Linear]:
    return [m for m in layers.linears(modules) if m.split]


def _perception_frames(engine, frames):
    streams = [engine.open_stream() for _ in range(2)]
    out = []
    for frame in frames:
        results = engine.push_batch([(s, frame[i]) for i, s in enumerate(streams)])
        out.append([(r.token_ids, np.array(r.audio_embedding)) for r in results])
    return out


def test_perception_routes_its_float32_projections_through_the_kernel(tiny_checkpoint, monkeypatch):
    frames = [(0.1 * RNG.standard_normal((2, 1280))).astype(np.float32) for _ in range(20)]
    plain = _perception_frames(PerceptionEngine.load(tiny_checkpoint, options=WIDE), frames)
    calls = []
    monkeypatch.setattr(split_matmul, "available", lambda: True)
    monkeypatch.setattr(split_matmul, "split_matmul", _float32_product(calls))
    engine = PerceptionEngine.load(tiny_checkpoint, options=WIDE_SPLIT)
    routed = _split_linears([engine.encoder, engine.proj, engine.rnnt.joint])
    assert routed and all(layer.weight.dtype == mx.bfloat16 for layer in routed)
    assert engine.encoder.layers[0].norm_ff1.weight.dtype == mx.float32  # the rest still widened
    split = _perception_frames(engine, frames)
    # traced into the compiled steps (so called once a trace, not once a frame)
    assert engine.proj.weight.shape in calls and engine.encoder.layers[0].ff1.linear1.weight.shape in calls
    for a, b in zip(plain, split, strict=True):
        assert [ids for ids, _ in a] == [ids for ids, _ in b]
        for (_, x), (_, y) in zip(a, b, strict=True):
            np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)


def _speech_codes(engine, frames):
    prompt = np.random.default_rng(0).integers(0, 256, (engine.prompt_frames, engine.num_quantizers))
    sessions = [engine.open_session(seed, prompt.astype(np.int32)) for seed in (0, 1)]
    return [[np.array(raw) for raw, _ in engine.step_batch([(s, ids[i]) for i, s in enumerate(sessions)])]
            for ids in frames]


def test_speech_routes_its_float32_projections_through_the_kernel(tiny_checkpoint, monkeypatch):
    frames = [RNG.integers(16, 1000, 2).tolist() for _ in range(12)]
    plain = _speech_codes(TTSEngine.load(tiny_checkpoint, options=WIDE), frames)
    calls = []
    monkeypatch.setattr(split_matmul, "available", lambda: True)
    monkeypatch.setattr(split_matmul, "split_matmul", _float32_product(calls))
    engine = TTSEngine.load(tiny_checkpoint, options=WIDE_SPLIT)
    model = engine.model
    routed = _split_linears([model.backbone, model.embed_code, model.fusion.audio_proj, model.mog_head])
    assert routed and all(layer.weight.dtype == mx.bfloat16 for layer in routed)
    split = _speech_codes(engine, frames)
    assert calls
    for a, b in zip(plain, split, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(y, x)


def test_the_layout_splits_k_by_the_weights_shape_alone():
    # the language model's shapes: 64 columns a warp, split along K towards 1024 warps, in whole 64-wide blocks
    assert split_matmul.plan(131072, 4480, 16) == split_matmul.Plan(splits=1, row_tiles=2, warps=2048)
    assert split_matmul.plan(22656, 4480, 16).splits == 3  # 354 warps
    assert split_matmul.plan(4480, 15680, 16).splits == 15  # 70 warps
    assert split_matmul.plan(1024, 4480, 16).splits == 64  # 16 warps, 70 blocks of K
    assert split_matmul.plan(48, 32, 1).splits == 1  # K shorter than one block: all of it in the last range
    for n, k in ((131072, 4480), (4480, 10240), (144, 64), (256, 4496)):
        plans = [split_matmul.plan(n, k, rows) for rows in (1, 3, 8, 9, 16, 40)]
        assert {p.splits for p in plans} == {plans[0].splits}  # the rows never change a row's sums
        assert [p.rows for p in plans] == [8, 8, 8, 16, 16, 16]
        assert plans[0].blocks * split_matmul.BLOCK_WARPS * split_matmul.WARP_COLUMNS >= n


def test_the_kernel_refuses_inputs_it_was_not_built_for():
    with pytest.raises(ValueError, match="multiples of 16"):
        split_matmul.split_matmul(_array(2, 32), _array(40, 32, dtype=mx.bfloat16))
    with pytest.raises(ValueError, match="float32 x"):
        split_matmul.split_matmul(_array(2, 32, dtype=mx.bfloat16), _array(48, 32, dtype=mx.bfloat16))


@cuda
@pytest.mark.parametrize(("rows", "n", "k", "one_range"), [
    (1, 48, 32, False), (3, 144, 64, False), (16, 272, 512, False), (21, 256, 4480, False), (40, 1024, 128, False),
    (9, 4480, 10240 + 48, False), (16, 256, 8960, True), (5, 512, 4480 + 16, True)])
def test_the_split_product_has_float32_accuracy_against_float64(rows, n, k, one_range, monkeypatch):
    if one_range:  # all of K in one range, as the widest weights (the language heads) take it
        monkeypatch.setattr(split_matmul, "TARGET_WARPS", 1)
        assert split_matmul.plan(n, k, rows).splits == 1
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
        engine = LanguageEngine.load(tiny_checkpoint, options=LoadOptions(float32_weights=True, split_matmuls=split))
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


@cuda
def test_perception_with_split_matmuls_gives_the_float32_weights_tokens_and_near_embeddings(tiny_checkpoint):
    frames = [(0.1 * RNG.standard_normal((2, 1280))).astype(np.float32) for _ in range(20)]
    plain = _perception_frames(PerceptionEngine.load(tiny_checkpoint, options=WIDE), frames)
    split = _perception_frames(PerceptionEngine.load(tiny_checkpoint, options=WIDE_SPLIT),
                               frames)
    for a, b in zip(plain, split, strict=True):
        assert [ids for ids, _ in a] == [ids for ids, _ in b]
        for (_, x), (_, y) in zip(a, b, strict=True):
            np.testing.assert_allclose(y, x, atol=1e-4, rtol=0)


@cuda
def test_speech_with_split_matmuls_gives_the_float32_weights_codes(tiny_checkpoint):
    frames = [RNG.integers(16, 1000, 2).tolist() for _ in range(12)]
    plain = _speech_codes(TTSEngine.load(tiny_checkpoint, options=WIDE), frames)
    split = _speech_codes(TTSEngine.load(tiny_checkpoint, options=WIDE_SPLIT), frames)
    for a, b in zip(plain, split, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(y, x)
