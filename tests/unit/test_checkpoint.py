"""Random checkpoints and the loader: determinism, the reference's layout, conversions, quantization, errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from services.common import checkpoint as ckpt_module
from services.common.checkpoint import Checkpoint, CheckpointError, _gate_conv1d, _gate_conv2d
from services.common.layers import Embedding, Linear
from services.common.safetensors_io import PlannedTensor, read_header, write_file
from tests.conftest import GOLDEN
from tools.make_checkpoint import write_checkpoint

SERVICE_PREFIXES = {
    "perception": ("stt_model.perception.", "stt_model.rnnt_"),
    "llm": ("stt_model.embed_tokens.", "stt_model.llm.", "stt_model.lm_head.", "stt_model.function_head."),
    "tts": ("tts_model.tts_model.", "tts_model.audio_prompt_latents.", "tts_model.codec_silence_tokens",
            "tts_model._control_codes"),
    "codec": ("tts_model.audio_codec.",),
}
ALL = tuple(p for prefixes in SERVICE_PREFIXES.values() for p in prefixes)


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def as_numpy(value: mx.array) -> np.ndarray:
    return np.array(value.view(mx.uint16)) if value.dtype == mx.bfloat16 else np.array(value)


def test_same_seed_gives_identical_bytes_and_matches_the_goldens_source(tmp_path, tiny_checkpoint,
                                                                        tinymix_checkpoint):
    recorded = json.loads((GOLDEN / "checkpoints.json").read_text())
    again = write_checkpoint(tmp_path / "again", "tiny", 0)
    assert digest(again) == digest(tiny_checkpoint) == recorded["tiny"]
    assert digest(tinymix_checkpoint) == recorded["tiny_mixed"]
    other = write_checkpoint(tmp_path / "other", "tiny", 1)
    assert digest(other)["model.safetensors"] != digest(tiny_checkpoint)["model.safetensors"]
    assert digest(other)["config.json"] == digest(tiny_checkpoint)["config.json"]
    # tensors generated on threads (quantized parts sharing one draw included) give the bytes of one thread
    serial = write_checkpoint(tmp_path / "serial", "tiny", 0, bits=4, workers=1)
    assert digest(write_checkpoint(tmp_path / "threaded", "tiny", 0, bits=4, workers=8)) == digest(serial)


def test_tokenizer_has_the_byte_alphabet_and_the_special_ids(tiny_checkpoint):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    vocab = tok.get_vocab()
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert len(vocab) == config["text_config"]["vocab_size"]
    assert sum(len(token) == 1 for token in vocab) == 256
    assert tok.id_to_token(1) == "<s>" and tok.id_to_token(2) == "</s>"
    assert tok.id_to_token(11) == "<SPECIAL_11>" and tok.id_to_token(12) == "<SPECIAL_12>"
    ids = tok.encode("Be concise and answer in one sentence.", add_special_tokens=False).ids
    assert tok.decode(ids) == "Be concise and answer in one sentence."


@pytest.mark.parametrize("variant, fixture", [("dense", "tiny_checkpoint"), ("4bit", "tiny4_checkpoint"),
                                              ("mixed", "tinymix_checkpoint")])
def test_loader_yields_exactly_what_the_reference_holds_after_loading(variant, fixture, request):
    """Same keys, shapes, dtypes and bytes as the reference's strict load (sanitize included)."""
    expected = json.loads((GOLDEN / f"layout_{variant}.json").read_text())
    weights = Checkpoint(request.getfixturevalue(fixture)).load(ALL)
    got = {}
    for key, value in weights.arrays.items():
        got[key] = [list(value.shape), str(value.dtype).removeprefix("mlx.core."),
                    hashlib.sha256(as_numpy(value).tobytes()).hexdigest()[:16]]
    assert sorted(got) == sorted(expected)
    mismatched = [k for k in expected if got[k] != expected[k]]
    assert not mismatched, mismatched[:5]


def test_an_already_converted_copy_loads_to_the_same_arrays(tmp_path, tiny_checkpoint):
    original = Checkpoint(tiny_checkpoint).load(ALL)
    copy = tmp_path / "converted"
    copy.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, copy / name)
    planned = []
    for key, value in original.arrays.items():
        data = as_numpy(value)
        dtype = {mx.bfloat16: "BF16", mx.float32: "F32", mx.int32: "I32", mx.uint32: "U32"}[value.dtype]
        planned.append(PlannedTensor(key, dtype, tuple(value.shape), lambda data=data: data))
    write_file(copy / "model.safetensors", planned)
    again = Checkpoint(copy).load(ALL)
    assert sorted(again.keys()) == sorted(original.keys())
    for key in original.keys():
        assert np.array_equal(as_numpy(again.get(key)), as_numpy(original.get(key))), key


def test_each_layout_rule_converts_torch_layout_and_is_idempotent():
    x = mx.arange(2 * 1 * 3 * 3).reshape(2, 1, 3, 3)  # Conv2d (O, I, kh, kw)
    once = _gate_conv2d("k", x)
    assert once.shape == (2, 3, 3, 1) and mx.array_equal(once, x.transpose(0, 2, 3, 1))
    assert mx.array_equal(_gate_conv2d("k", once), once)
    pw = mx.arange(4 * 5 * 1).reshape(4, 5, 1, 1)
    assert _gate_conv2d("k", pw).shape == (4, 1, 1, 5)

    conv = mx.arange(4 * 6 * 7).reshape(4, 6, 7)  # Conv1d (O, I, K=7)
    once = _gate_conv1d("k", conv, 7, transposed=False)
    assert once.shape == (4, 7, 6) and mx.array_equal(once, conv.transpose(0, 2, 1))
    assert mx.array_equal(_gate_conv1d("k", once, 7, transposed=False), once)

    convt = mx.arange(6 * 4 * 9).reshape(6, 4, 9)  # ConvTranspose1d (I=6, O=4, K=9)
    once = _gate_conv1d("k", convt, 9, transposed=True)
    assert once.shape == (4, 9, 6) and mx.array_equal(once, convt.transpose(1, 2, 0))
    assert mx.array_equal(_gate_conv1d("k", once, 9, transposed=True), once)
    with pytest.raises(CheckpointError, match="kernel size 5"):
        _gate_conv1d("layer.weight", conv, 5, transposed=False)


def test_lstm_renames_and_sums_biases_and_private_buffers_are_renamed(tiny_checkpoint):
    ck = Checkpoint(tiny_checkpoint)
    weights = ck.load(SERVICE_PREFIXES["perception"] + ("tts_model.",))
    stem = "stt_model.rnnt_decoder.prediction.dec_rnn.lstm"
    bias = ck.read_raw(f"{stem}.bias_ih_l1") + ck.read_raw(f"{stem}.bias_hh_l1")
    assert mx.array_equal(weights.get(f"{stem}.1.bias"), bias)
    assert mx.array_equal(weights.get(f"{stem}.0.Wx"), ck.read_raw(f"{stem}.weight_ih_l0"))
    assert "tts_model.control_codes" in weights and "tts_model._control_codes" not in weights
    assert "tts_model.audio_codec.prvq.variance_list.0.variance" in weights
    assert not [k for k in weights.keys() if "preprocessor" in k]


def test_a_service_reads_only_its_own_tensors(tiny_checkpoint, monkeypatch):
    read: list[str] = []
    original = ckpt_module.MappedFile.array

    def recording(self, info):
        read.append(info.key)
        return original(self, info)

    monkeypatch.setattr(ckpt_module.MappedFile, "array", recording)
    for service, prefixes in SERVICE_PREFIXES.items():
        read.clear()
        Checkpoint(tiny_checkpoint).load(prefixes)
        foreign = [k for k in read if not k.startswith(prefixes)]
        assert read and not foreign, (service, foreign[:3])


def test_mixed_bit_modules_load_with_their_own_widths(tinymix_checkpoint):
    ck = Checkpoint(tinymix_checkpoint)
    config = json.loads((tinymix_checkpoint / "config.json").read_text())["quantization"]
    weights = ck.load(ALL)
    widths = set()
    for module, entry in config.items():
        if not isinstance(entry, dict):
            continue
        spec = weights.quant_spec(module)
        assert spec is not None and spec.bits == entry["bits"], module
        widths.add(spec.bits)
        layer = Linear.from_weights(weights, module)
        assert layer.in_features * spec.bits // 32 == weights.get(f"{module}.weight").shape[1]
    assert widths == {4, 5, 6, 8}
    assert weights.quant_spec("tts_model.tts_model.mog_head.proj_mus") is None

    # Dequantized rows equal codes * scale + bias for a 5-bit module, unpacked independently in numpy.
    module = next(m for m, e in config.items() if isinstance(e, dict) and e["bits"] == 5)
    layer = Linear.from_weights(weights, module)
    words = np.array(layer.weight).view(np.uint8)
    bits = np.unpackbits(words, axis=1, bitorder="little").reshape(words.shape[0], -1, 5)
    codes = (bits * (1 << np.arange(5))).sum(-1).astype(np.float32)
    scales = np.array(layer.scales.astype(mx.float32)).repeat(64, axis=1)
    offsets = np.array(layer.biases.astype(mx.float32)).repeat(64, axis=1)
    dense = np.array(layer.dense_weight().astype(mx.float32))
    np.testing.assert_allclose(dense, codes * scales + offsets, rtol=1e-2, atol=1e-2)


def test_quantized_embedding_gathers_rows(tiny4_checkpoint):
    weights = Checkpoint(tiny4_checkpoint).load(("stt_model.embed_tokens.",))
    table = Embedding.from_weights(weights, "stt_model.embed_tokens")
    ids = mx.array([[12, 1, 2]])
    full = Linear.from_weights(weights, "stt_model.embed_tokens").dense_weight()
    assert mx.array_equal(table(ids)[0], full[ids[0]])


def test_errors_name_the_problem(tmp_path, tiny_checkpoint):
    with pytest.raises(CheckpointError, match="no such folder"):
        Checkpoint(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", empty / "config.json")
    with pytest.raises(CheckpointError, match="no model\\*.safetensors"):
        Checkpoint(empty)
    weights = Checkpoint(tiny_checkpoint).load(("stt_model.perception.",))
    with pytest.raises(CheckpointError, match="missing tensor 'stt_model.perception.absent.weight'"):
        weights.get("stt_model.perception.absent.weight")
    with pytest.raises(CheckpointError, match=r"has shape \(128, 64\), but config.json implies \(128, 32\)"):
        weights.get("stt_model.perception.proj.weight", (128, 32))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        Checkpoint(broken)


def test_sharded_checkpoints_load_through_the_index(tmp_path, tiny_checkpoint):
    sharded = write_checkpoint(tmp_path / "sharded", "tiny", 0, max_shard_bytes=3 << 20)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    keys = {k for f in sharded.glob("model-*.safetensors") for k in read_header(f)}
    assert keys == set(index["weight_map"])
    a = Checkpoint(sharded).load(ALL)
    b = Checkpoint(tiny_checkpoint).load(ALL)
    assert sorted(a.keys()) == sorted(b.keys())
    assert all(mx.array_equal(a.get(k), b.get(k)) for k in b.keys())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packed_codes_dequantize_to_themselves_in_mlx(bits):
    from tools.make_checkpoint import pack_bits

    codes = np.random.default_rng(bits).integers(0, 1 << bits, (8, 128), dtype=np.uint32)
    ones, zeros = mx.ones((8, 2)), mx.zeros((8, 2))
    got = mx.dequantize(mx.array(pack_bits(codes, bits)), ones, zeros, group_size=64, bits=bits)
    assert np.array_equal(np.array(got), codes.astype(np.float32))


def test_dequantized_copy_holds_the_same_dense_weights_as_dequantizing_at_load(tmp_path, tiny4_checkpoint):
    from tools.dequantize_checkpoint import dequantize_checkpoint

    dense = Checkpoint(dequantize_checkpoint(tiny4_checkpoint, tmp_path / "dense"))
    assert dense.config.quantization is None
    assert not [k for k in dense.tensors if k.endswith((".scales", ".biases"))]
    at_load = Checkpoint(tiny4_checkpoint).load(ALL).dequantized()
    copied = dense.load(ALL)
    assert sorted(copied.keys()) == sorted(at_load.keys())
    for key in at_load.keys():
        assert copied.get(key).dtype == at_load.get(key).dtype and mx.array_equal(copied.get(key), at_load.get(key))


def test_widen_stores_dense_weights_wider_and_leaves_the_outputs_alone():
    from dataclasses import dataclass

    import mlx.core as mx

    from services.common.config import QuantSpec
    from services.common.layers import Linear, widen

    rng = np.random.default_rng(0)
    dense = Linear(mx.array(rng.standard_normal((8, 64)), mx.bfloat16), mx.array(rng.standard_normal(8), mx.bfloat16))
    w, scales, biases = mx.quantize(mx.array(rng.standard_normal((8, 64)), mx.float32), 64, 4)
    packed = Linear(w, None, scales, biases, QuantSpec(bits=4, group_size=64))

    @dataclass
    class Holder:
        layers: list

    x = mx.array(rng.standard_normal((2, 64)), mx.float32)
    before = dense(x), packed(x)
    converted = widen(Holder([dense, (packed,)]), mx.float32)
    assert len(converted) == 2 and dense.weight.dtype == dense.bias.dtype == mx.float32
    assert packed.weight.dtype == mx.uint32 and packed.scales.dtype == mx.float32
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, (dense(x), packed(x)), strict=True))
    assert widen(dense, mx.float32) == []  # already wide


def test_the_deep_preset_has_the_full_depth_at_the_tiny_widths(tmp_path):
    from services.common.config import VoiceChatConfig
    from services.llm.engine import LanguageEngine

    full, path = VoiceChatConfig(), write_checkpoint(tmp_path / "deep", "deep", 0, None)
    cfg = json.loads((path / "config.json").read_text())
    text = cfg["text_config"]
    assert text["num_hidden_layers"] == 56 == full.text_config.num_hidden_layers
    assert text["hybrid_override_pattern"] == full.text_config.hybrid_override_pattern
    assert cfg["audio_config"]["encoder"]["n_layers"] == full.audio_config.encoder.n_layers == 24
    assert cfg["tts_config"]["num_hidden_layers"] == full.tts_config.num_hidden_layers == 28
    assert text["hidden_size"] == 128 and cfg["tts_config"]["hidden_size"] == 128  # the tiny widths
    kinds = "".join(block.kind for block in LanguageEngine.load(path).model.backbone.blocks)
    assert kinds == full.text_config.hybrid_override_pattern  # every block loads, of its kind
