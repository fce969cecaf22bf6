"""Write a random-weight VoiceChat checkpoint in the layout of the mlx-community conversions.

    python -m tools.make_checkpoint --out DIR --preset {tiny,small,full} --seed N [--bits 4|8] [--mixed-bits]

Every key of the real files is written, in their pre-sanitize (torch-export) layout: perception and
codec convolutions `(O, I, K...)`, the codec decoder's transposed convolutions `(I, O, K)`, PyTorch LSTM
weights with separate biases, `prvq._variance_list`, `tts_model._control_codes` and the mel frontend's
buffers. Floats are bfloat16 except `A_log` (float32); buffers are int32. With `--bits` the language
model (embedding, both heads, every mixer projection) is affine-quantized with group size 64; with
`--mixed-bits` almost every linear and embedding of all four networks is quantized at 4, 5, 6 or 8 bits.

Each tensor draws from `numpy.random.default_rng([seed, crc32(key)])`, so one seed gives the same bytes
on any machine and a tensor does not depend on the order of the others. Scales keep activations near
unit size, and a few rows are tilted (pad/EOS/silence rows of the heads, the RNNT blank) so that the
outputs vary like a model's do.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from services.common.config import VoiceChatConfig
from services.common.safetensors_io import PlannedTensor, float32_to_bf16_bits, write_file
from tools.tokenizers_synth import build_rnnt_vocabulary, build_tokenizer

GROUP_SIZE = 64
PROMPT_FRAMES = 37  # frames of the built-in Aria prompt latents
SUBWORD_VOCAB = 131_072  # the character encoder's subword tables are sized for the full vocabulary

# Preset overrides on top of the released model's config.json values.
PRESETS: dict[str, dict] = {
    "full": {},
    "small": {
        "text_config": {
            "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "mamba_num_heads": 16,
            "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 2, "hybrid_override_pattern": "M-M*M-M-",
        },
        "audio_config": {
            "encoder": {"n_layers": 6, "d_model": 256, "n_heads": 4, "subsampling_conv_channels": 64,
                        "att_context_size": [[70, 0]]},
            "decoder": {"pred_hidden": 256, "vocab_size": 512},
            "joint": {"joint_hidden": 256, "encoder_hidden": 256, "pred_hidden": 256, "num_classes": 512},
            "output_dim": 512,
        },
        "rnnt_blank_id": 512,
        "tts_config": {
            "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 8,
            "num_key_value_heads": 8, "head_dim": 64, "latent_size": 128, "codebook_size": 1024,
            "character_encoder": {"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8,
                                  "num_key_value_heads": 8, "head_dim": 64},
            "mog_head": {"intermediate_size": 1536, "low_rank": 16, "num_predictions": 256},
        },
        "codec_config": {"base_channels": 64, "latent_dim": 128, "codebook_size": 1024},
    },
    "tiny": {
        "text_config": {
            "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "mamba_num_heads": 8,
            "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "hybrid_override_pattern": "M-M*M-",
        },
        "audio_config": {
            "encoder": {"n_layers": 2, "d_model": 64, "n_heads": 2, "subsampling_conv_channels": 64,
                        "att_context_size": [[12, 0]]},
            "decoder": {"pred_hidden": 64, "vocab_size": 128},
            "joint": {"joint_hidden": 64, "encoder_hidden": 64, "pred_hidden": 64, "num_classes": 128},
            "output_dim": 128,
        },
        "rnnt_blank_id": 128,
        "tts_config": {
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 4, "head_dim": 32, "sliding_window": 48, "latent_size": 64,
            "codebook_size": 256,
            "character_encoder": {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                                  "num_key_value_heads": 4, "head_dim": 32},
            "mog_head": {"intermediate_size": 256, "low_rank": 8, "num_predictions": 64},
        },
        "codec_config": {"base_channels": 16, "latent_dim": 64, "codebook_size": 256},
    },
}


# The full model's depth at the tiny widths: every layer and op of a frame, generated and stepped in seconds, so
# the host's share of a step (Python, launches) can be measured on a CPU at many sessions (bench.service
# --host-split).
_FULL = VoiceChatConfig()
PRESETS["deep"] = copy.deepcopy(PRESETS["tiny"])
PRESETS["deep"]["text_config"].update(num_hidden_layers=_FULL.text_config.num_hidden_layers,
                                      hybrid_override_pattern=_FULL.text_config.hybrid_override_pattern)
PRESETS["deep"]["audio_config"]["encoder"]["n_layers"] = _FULL.audio_config.encoder.n_layers
PRESETS["deep"]["tts_config"]["num_hidden_layers"] = _FULL.tts_config.num_hidden_layers


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def preset_config(preset: str) -> dict:
    """The full `config.json` (without quantization) of a preset."""
    values = dataclasses.asdict(VoiceChatConfig())
    values.pop("quantization")
    values = _merge(values, PRESETS[preset])
    values["audio_config"]["encoder"]["att_context_size"] = [list(p) for p in
                                                            values["audio_config"]["encoder"]["att_context_size"]]
    values["architectures"] = ["NemotronVoiceChatForConditionalGeneration"]
    values["rnnt_vocabulary"] = build_rnnt_vocabulary(values["audio_config"]["decoder"]["vocab_size"])
    VoiceChatConfig.from_dict(values)  # fail here, not in a loader, if a preset is inconsistent
    return values


# --------------------------------------------------------------------------------------------------
# Tensor plans. An Init turns an rng and a shape into float32 values; the plan decides dtype/layout.

Init = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


def normal(std: float, mean: float = 0.0) -> Init:
    return lambda rng, shape: (mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def uniform(low: float, high: float) -> Init:
    return lambda rng, shape: rng.uniform(low, high, shape).astype(np.float32)


def const(value: float) -> Init:
    return lambda rng, shape: np.full(shape, value, dtype=np.float32)


def fan_in(n: int, gain: float = 1.0) -> Init:
    return normal(gain / math.sqrt(n))


class Plan:
    """Collects the tensors of one checkpoint in file order."""

    def __init__(self, seed: int, quant: dict[str, int]):
        self.seed = seed
        self.quant = quant  # module path -> bits, for modules written quantized
        self.tensors: list[PlannedTensor] = []

    def rng(self, key: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(key.encode())])

    def add(self, key: str, shape: tuple[int, ...], init: Init, dtype: str = "BF16",
            edit: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        def produce() -> np.ndarray:
            values = init(self.rng(key), shape)
            if edit is not None:
                values = edit(values)
            if dtype == "BF16":
                return float32_to_bf16_bits(values)
            if dtype == "F32":
                return values.astype(np.float32)
            raise ValueError(dtype)

        self.tensors.append(PlannedTensor(key, dtype, tuple(shape), produce))

    def add_int(self, key: str, values: Callable[[np.random.Generator], np.ndarray]) -> None:
        sample = values(np.random.default_rng(0))
        self.tensors.append(
            PlannedTensor(key, "I32", tuple(sample.shape), lambda: values(self.rng(key)).astype(np.int32))
        )

    def linear(self, path: str, out_dim: int, in_dim: int, *, bias: bool = False, gain: float = 1.0,
               edit: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """A Linear (or Embedding, with gain as the std and in_dim=1 semantics handled by caller)."""
        std = gain / math.sqrt(in_dim)
        self.matrix(path, out_dim, in_dim, std, edit=edit)
        if bias:
            self.add(f"{path}.bias", (out_dim,), normal(0.02))

    def embedding(self, path: str, rows: int, dim: int, std: float = 1.0,
                  edit: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.matrix(path, rows, dim, std, edit=edit)

    def matrix(self, path: str, rows: int, cols: int, std: float,
               edit: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        bits = self.quant.get(path)
        if bits is None:
            self.add(f"{path}.weight", (rows, cols), normal(std), edit=edit)
        else:
            self.quantized(path, rows, cols, std, bits, edit)

    def quantized(self, path: str, rows: int, cols: int, std: float, bits: int,
                  edit: Callable[[np.ndarray], np.ndarray] | None) -> None:
        """Random affine-quantized weights: codes uniform in [0, 2^bits), groups spanning about +-std*sqrt(3)."""
        if cols % GROUP_SIZE or (cols * bits) % 32:
            raise ValueError(f"{path}: {cols} input columns cannot be quantized in groups of {GROUP_SIZE}")
        groups = cols // GROUP_SIZE
        levels = (1 << bits) - 1

        def params() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            rng = self.rng(path + "#q")
            codes = rng.integers(0, levels + 1, size=(rows, cols), dtype=np.uint32)
            half = std * math.sqrt(3.0) * rng.uniform(0.75, 1.25, size=(rows, groups)).astype(np.float32)
            if edit is not None:  # tilt whole rows by scaling their range
                half = edit(half)
            scales = float32_to_bf16_bits(2.0 * half / levels)
            biases = float32_to_bf16_bits(-half)
            return codes, scales, biases

        cache: dict[str, np.ndarray] = {}
        lock = threading.Lock()  # the three parts may be produced on different threads

        def part(name: str) -> Callable[[], np.ndarray]:
            def produce() -> np.ndarray:
                with lock:
                    if name not in cache:
                        codes, scales, biases = params()
                        cache.update(weight=pack_bits(codes, bits), scales=scales, biases=biases)
                    return cache.pop(name)
            return produce

        self.tensors.append(PlannedTensor(f"{path}.weight", "U32", (rows, cols * bits // 32), part("weight")))
        self.tensors.append(PlannedTensor(f"{path}.scales", "BF16", (rows, groups), part("scales")))
        self.tensors.append(PlannedTensor(f"{path}.biases", "BF16", (rows, groups), part("biases")))

    def rms_norm(self, path: str, dim: int, offset: bool = False) -> None:
        """Plain RMSNorm weights sit near 1; offset (Gemma) norms store w with the scale being 1 + w."""
        self.add(f"{path}.weight", (dim,), normal(0.05, 0.0 if offset else 1.0))

    def layer_norm(self, path: str, dim: int) -> None:
        self.add(f"{path}.weight", (dim,), normal(0.05, 1.0))
        self.add(f"{path}.bias", (dim,), normal(0.02))


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes into uint32 words as one little-endian bitstream per row (MLX's layout)."""
    rows, cols = codes.shape
    if 32 % bits == 0:  # whole codes per word: shift and add, without the per-bit detour
        per_word = 32 // bits
        shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
        return (codes.reshape(rows, cols // per_word, per_word).astype(np.uint32) << shifts).sum(
            axis=2, dtype=np.uint32)
    shifts = np.arange(bits, dtype=np.uint32)
    stream = ((codes[..., None] >> shifts) & 1).astype(np.uint8).reshape(rows, cols * bits)
    packed = np.packbits(stream, axis=1, bitorder="little")
    return packed.view("<u4").reshape(rows, cols * bits // 32)


# --------------------------------------------------------------------------------------------------
# The four networks, in the key layout of the converted files.


def plan_perception(p: Plan, cfg: dict) -> None:
    audio = cfg["audio_config"]
    pre, enc = audio["preprocessor"], audio["encoder"]
    d, ch = enc["d_model"], enc["subsampling_conv_channels"]
    win = int(pre["window_size"] * pre["sample_rate"])
    base = "stt_model.perception"
    # NeMo's featurizer buffers; every loader drops them and rebuilds the frontend in code.
    p.add(f"{base}.preprocessor.featurizer.window", (win,), lambda rng, s: np.hanning(win).astype(np.float32))
    p.add(f"{base}.preprocessor.featurizer.fb", (1, pre["features"], pre["n_fft"] // 2 + 1), const(0.0))
    steps = int(math.log2(enc["subsampling_factor"]))
    freq = enc["feat_in"]
    for _ in range(steps):
        freq = freq // 2 + 1
    conv = f"{base}.encoder.pre_encode.conv"
    p.add(f"{conv}.0.weight", (ch, 1, 3, 3), normal(1.0 / 3.0))
    p.add(f"{conv}.0.bias", (ch,), normal(0.05))
    for i in range(steps - 1):
        dw, pw = 2 + 3 * i, 3 + 3 * i
        p.add(f"{conv}.{dw}.weight", (ch, 1, 3, 3), normal(1.0 / 3.0))
        p.add(f"{conv}.{dw}.bias", (ch,), normal(0.05))
        p.add(f"{conv}.{pw}.weight", (ch, ch, 1, 1), normal(math.sqrt(2.0 / ch)))
        p.add(f"{conv}.{pw}.bias", (ch,), normal(0.05))
    p.linear(f"{base}.encoder.pre_encode.out", d, ch * freq, bias=True)
    ff = d * enc["ff_expansion_factor"]
    heads = enc["n_heads"]
    bias = enc["use_bias"]
    for n in range(enc["n_layers"]):
        layer = f"{base}.encoder.layers.{n}"
        for which in ("feed_forward1", "feed_forward2"):
            p.layer_norm(f"{layer}.norm_{which}", d)
            p.linear(f"{layer}.{which}.linear1", ff, d, bias=bias)
            p.linear(f"{layer}.{which}.linear2", d, ff, bias=bias)
        p.layer_norm(f"{layer}.norm_self_att", d)
        for name in ("linear_q", "linear_k", "linear_v", "linear_out"):
            p.linear(f"{layer}.self_attn.{name}", d, d, bias=bias)
        p.linear(f"{layer}.self_attn.linear_pos", d, d)
        p.add(f"{layer}.self_attn.pos_bias_u", (heads, d // heads), normal(0.1))
        p.add(f"{layer}.self_attn.pos_bias_v", (heads, d // heads), normal(0.1))
        p.layer_norm(f"{layer}.norm_conv", d)
        p.add(f"{layer}.conv.pointwise_conv1.weight", (2 * d, d, 1), fan_in(d))
        p.add(f"{layer}.conv.depthwise_conv.weight", (d, 1, enc["conv_kernel_size"]), fan_in(enc["conv_kernel_size"]))
        p.layer_norm(f"{layer}.conv.batch_norm", d)
        p.add(f"{layer}.conv.pointwise_conv2.weight", (d, d, 1), fan_in(d))
        if bias:
            for name, size in (("pointwise_conv1", 2 * d), ("depthwise_conv", d), ("pointwise_conv2", d)):
                p.add(f"{layer}.conv.{name}.bias", (size,), normal(0.02))
        p.layer_norm(f"{layer}.norm_out", d)
    p.linear(f"{base}.proj", audio["output_dim"], d, bias=True)


def plan_rnnt(p: Plan, cfg: dict) -> None:
    audio = cfg["audio_config"]
    dec, joint = audio["decoder"], audio["joint"]
    hidden, vocab = dec["pred_hidden"], dec["vocab_size"]
    blank = cfg["rnnt_blank_id"]
    p.embedding("stt_model.rnnt_decoder.prediction.embed", vocab + 1, hidden, std=1.0)
    lstm = "stt_model.rnnt_decoder.prediction.dec_rnn.lstm"
    for n in range(dec["pred_rnn_layers"]):
        p.add(f"{lstm}.weight_ih_l{n}", (4 * hidden, hidden), fan_in(hidden))
        p.add(f"{lstm}.weight_hh_l{n}", (4 * hidden, hidden), fan_in(hidden))
        p.add(f"{lstm}.bias_ih_l{n}", (4 * hidden,), normal(0.05))
        p.add(f"{lstm}.bias_hh_l{n}", (4 * hidden,), normal(0.05))
    p.linear("stt_model.rnnt_joint.enc", joint["joint_hidden"], joint["encoder_hidden"], bias=True)
    p.linear("stt_model.rnnt_joint.pred", joint["joint_hidden"], joint["pred_hidden"], bias=True)

    def blank_wins_often(bias: np.ndarray) -> np.ndarray:
        bias = bias.copy()
        bias[blank] = 6.0  # blank beats most frames, so the transcript grows a few pieces at a time
        return bias

    out = "stt_model.rnnt_joint.joint_net.2"
    p.matrix(out, vocab + 1, joint["joint_hidden"], 3.0 / math.sqrt(joint["joint_hidden"]))
    p.add(f"{out}.bias", (vocab + 1,), normal(0.05), edit=blank_wins_often)


def plan_llm(p: Plan, cfg: dict) -> None:
    t = cfg["text_config"]
    d, vocab = t["hidden_size"], t["vocab_size"]
    pad, eos, silence = cfg["pad_token_id"], cfg["eos_token_id"], cfg["silence_token_id"]
    p.embedding("stt_model.embed_tokens", vocab, d, std=0.5)
    heads, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"] or d // t["num_attention_heads"]
    m_heads, m_dim = t["mamba_num_heads"], t["mamba_head_dim"]
    inner = m_heads * m_dim
    conv_dim = inner + 2 * t["n_groups"] * t["ssm_state_size"]
    for n, block in enumerate(t["hybrid_override_pattern"]):
        layer = f"stt_model.llm.layers.{n}"
        p.rms_norm(f"{layer}.norm", d)
        mixer = f"{layer}.mixer"
        if block == "M":
            p.linear(f"{mixer}.in_proj", inner + conv_dim + m_heads, d, bias=t["mamba_proj_bias"])
            p.add(f"{mixer}.conv1d.weight", (conv_dim, 1, t["conv_kernel"]), fan_in(t["conv_kernel"]))
            if t["use_conv_bias"]:
                p.add(f"{mixer}.conv1d.bias", (conv_dim,), normal(0.05))
            # dt = softplus(dt_raw + dt_bias) should start in [1e-3, 1e-1]: store the inverse softplus.
            p.add(f"{mixer}.dt_bias", (m_heads,),
                  lambda rng, s: np.log(np.expm1(np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), s)))).astype(
                      np.float32))
            p.add(f"{mixer}.A_log", (m_heads,),
                  lambda rng, s: np.log(rng.uniform(1.0, 16.0, s)).astype(np.float32), dtype="F32")
            p.add(f"{mixer}.D", (m_heads,), normal(0.1, 1.0))
            p.rms_norm(f"{mixer}.norm", inner)
            p.linear(f"{mixer}.out_proj", d, inner, bias=t["mamba_proj_bias"])
        elif block == "*":
            for name, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
                p.linear(f"{mixer}.{name}", rows, d, bias=t["attention_bias"])
            p.linear(f"{mixer}.o_proj", d, heads * hd, bias=t["attention_bias"])
        else:
            p.linear(f"{mixer}.up_proj", t["intermediate_size"], d, bias=t["mlp_bias"], gain=math.sqrt(2.0))
            p.linear(f"{mixer}.down_proj", d, t["intermediate_size"], bias=t["mlp_bias"], gain=0.5)
    p.rms_norm("stt_model.llm.norm_f", d)

    def tilt(rows: dict[int, float]) -> Callable[[np.ndarray], np.ndarray]:
        def edit(values: np.ndarray) -> np.ndarray:
            values = values.copy()
            for row, factor in rows.items():
                values[row] *= factor
            return values
        return edit

    # Wider pad/silence/EOS rows make those ids win often, as they do in a conversation; EOS exercises the
    # speech decoder's reset path.
    p.linear("stt_model.lm_head", vocab, d, gain=2.0, edit=tilt({pad: 3.0, silence: 2.0, eos: 1.8}))
    p.linear("stt_model.function_head", vocab, d, gain=2.0, edit=tilt({pad: 6.0}))


def plan_tts(p: Plan, cfg: dict) -> None:
    t = cfg["tts_config"]
    h, inter, latent = t["hidden_size"], t["intermediate_size"], t["latent_size"]
    heads, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    q, cb = t["num_quantizers"], t["codebook_size"]
    base = "tts_model.tts_model"

    def attention(prefix: str, hidden: int, n_heads: int, n_kv: int, head_dim: int) -> None:
        for name, rows in (("q_proj", n_heads * head_dim), ("k_proj", n_kv * head_dim), ("v_proj", n_kv * head_dim)):
            p.linear(f"{prefix}.{name}", rows, hidden)
        p.linear(f"{prefix}.o_proj", hidden, n_heads * head_dim)

    def mlp(prefix: str, hidden: int, intermediate: int) -> None:
        p.linear(f"{prefix}.gate_proj", intermediate, hidden)
        p.linear(f"{prefix}.up_proj", intermediate, hidden)
        p.linear(f"{prefix}.down_proj", hidden, intermediate)

    for n in range(t["num_hidden_layers"]):
        layer = f"{base}.backbone.layers.{n}"
        attention(f"{layer}.self_attn", h, heads, kv, hd)
        p.rms_norm(f"{layer}.self_attn.q_norm", hd, offset=True)
        p.rms_norm(f"{layer}.self_attn.k_norm", hd, offset=True)
        mlp(f"{layer}.mlp", h, inter)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            p.rms_norm(f"{layer}.{norm}", h, offset=True)
    p.rms_norm(f"{base}.backbone.norm", h, offset=True)
    p.add(f"{base}.bos_emb", (h,), normal(1.0))
    p.add(f"{base}.null_emb", (h,), normal(1.0))
    p.linear(f"{base}.embed_code", h, latent)

    ce = t["character_encoder"]
    ch = ce["hidden_size"]
    sub = f"{base}.embed_subword"
    for n in range(ce["num_hidden_layers"]):
        layer = f"{sub}.backbone.encoder.layers.{n}"
        attention(f"{layer}.self_attn", ch, ce["num_attention_heads"], ce["num_key_value_heads"], ce["head_dim"])
        for norm in ("pre_self_attn_layernorm", "post_self_attn_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            p.rms_norm(f"{layer}.{norm}", ch, offset=True)
        mlp(f"{layer}.mlp", ch, ce["intermediate_size"])
    p.rms_norm(f"{sub}.backbone.encoder.norm", ch, offset=True)
    # The character table stays dense in every release (its dtype sizes a buffer).
    p.add(f"{sub}.embed_tokens.weight", (ce["char_vocab_size"], ch), normal(1.0 / math.sqrt(ch)))
    p.linear(f"{sub}.proj_embedding", h, ch)
    p.add_int(f"{sub}.subword_flag_emb.pad_tensor", lambda rng: np.array(SUBWORD_VOCAB, dtype=np.int32))
    p.add_int(f"{sub}.subword_flag_emb.is_continuation",
              lambda rng: rng.integers(0, 2, SUBWORD_VOCAB + 1).astype(np.int32))
    p.embedding(f"{sub}.subword_flag_emb.cont_emb", 2, ch, std=0.5)
    p.add_int(f"{sub}.bos_eos_emb.pad_tensor", lambda rng: np.array(SUBWORD_VOCAB - 1, dtype=np.int32))

    def special_flags(rng: np.random.Generator) -> np.ndarray:
        flags = np.zeros(SUBWORD_VOCAB, dtype=np.int32)
        flags[cfg["bos_token_id"]], flags[cfg["eos_token_id"]] = 1, 2
        return flags

    p.add_int(f"{sub}.bos_eos_emb.special_flags", special_flags)
    p.embedding(f"{sub}.bos_eos_emb.special_emb", 3, ch, std=0.5)

    fusion = f"{base}.gated_fusion_audio_text"
    p.linear(f"{fusion}.audio_proj", h, h, bias=True)
    p.linear(f"{fusion}.text_proj", h, h, bias=True)
    p.add(f"{fusion}.gate", (h,), normal(0.5))
    p.add(f"{fusion}.residual_scale", (), normal(0.5, 1.0))
    p.rms_norm(f"{fusion}.final_norm", h, offset=True)
    p.add(f"{base}.audio_prompt_projection_W", (h, h), fan_in(h))

    mog = t["mog_head"]
    for n in range(mog["num_layers"]):
        layer = f"{base}.mog_head.mlp_stack.{n}"
        p.rms_norm(f"{layer}.pre_norm", h, offset=True)
        mlp(f"{layer}.mlp", h, mog["intermediate_size"])
        p.rms_norm(f"{layer}.post_norm", h, offset=True)
    p.add(f"{base}.mog_head.mlp_stack.{mog['num_layers']}.weight", (h,), normal(0.05))
    p.linear(f"{base}.mog_head.proj_logits", mog["num_predictions"], h, gain=3.0)
    # Read raw (reshaped to (components, rank, hidden)), so it stays dense in every release.
    p.add(f"{base}.mog_head.proj_mus.weight", (mog["num_predictions"] * mog["low_rank"], h), fan_in(h))
    p.linear(f"{base}.mog_head.proj_logs", 1, h, gain=0.3)
    p.linear(f"{base}.mog_head.proj_else", latent, h, gain=0.5)
    p.add(f"{base}.mog_head.low_mat", (mog["num_predictions"], latent, mog["low_rank"]), fan_in(mog["low_rank"]))
    p.add(f"{base}.rvq_embs", (q, cb, latent), normal(1.0 / math.sqrt(latent)))

    # Three control codes inside the codebook range, so replacing them by silence actually happens.
    p.add_int("tts_model._control_codes", lambda rng: rng.choice(cb, size=3, replace=False).astype(np.int32))
    p.add("tts_model.audio_prompt_latents.Aria", (1, PROMPT_FRAMES, h), normal(1.0))
    p.add_int("tts_model.codec_silence_tokens", lambda rng: rng.integers(0, cb, q).astype(np.int32))


def plan_codec(p: Plan, cfg: dict) -> None:
    c = cfg["codec_config"]
    chans = [c["base_channels"] * m for m in c["channel_multipliers"]]
    k = c["block_kernel_size"]
    stft = 2 * (c["n_fft"] // 2 + 1)
    base = "tts_model.audio_codec"

    def block(prefix: str, width: int) -> None:
        p.add(f"{prefix}.dwconv.weight", (width, 1, k), fan_in(k))
        p.add(f"{prefix}.dwconv.bias", (width,), normal(0.02))
        p.add(f"{prefix}.norm.weight", (width,), normal(0.05, 1.0))
        p.add(f"{prefix}.norm.bias", (width,), normal(0.02))
        p.add(f"{prefix}.pwconv1.weight", (4 * width, width, 1), fan_in(width))
        p.add(f"{prefix}.pwconv1.bias", (4 * width,), normal(0.02))
        p.add(f"{prefix}.pwconv2.weight", (width, 4 * width, 1), fan_in(4 * width, 0.5))
        p.add(f"{prefix}.pwconv2.bias", (width,), normal(0.02))

    index = 0
    p.add(f"{base}.encoder.layers.0.weight", (chans[0], stft, 1), fan_in(stft))
    for s, (width, rate) in enumerate(zip(chans, c["downsample_rates"], strict=True)):
        for _ in range(c["blocks_per_stage"]):
            index += 1
            block(f"{base}.encoder.layers.{index}", width)
        index += 1
        nxt = chans[s + 1] if s + 1 < len(chans) else c["latent_dim"]
        p.add(f"{base}.encoder.layers.{index}.weight", (nxt, width, rate), fan_in(width * rate))
    index = -1
    source = c["latent_dim"]
    for width, rate in zip(reversed(chans), reversed(c["downsample_rates"]), strict=True):
        index += 1
        # ConvTranspose1d in torch layout (in, out, kernel).
        p.add(f"{base}.decoder.layers.{index}.weight", (source, width, rate), fan_in(source))
        for _ in range(c["blocks_per_stage"]):
            index += 1
            block(f"{base}.decoder.layers.{index}", width)
        source = width
    p.add(f"{base}.decoder.layers.{index + 1}.weight", (stft, chans[0], 1), fan_in(chans[0], 0.5))
    for q in range(c["num_quantizers"]):
        p.add(f"{base}.prvq.mus_list.{q}", (c["codebook_size"], c["latent_dim"]),
              normal(1.0 / math.sqrt(c["latent_dim"])))
        p.add(f"{base}.prvq._variance_list.{q}.variance", (), const(1.0))


# --------------------------------------------------------------------------------------------------
# Quantization maps.

LLM_MIXER_LINEARS = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def llm_modules(cfg: dict) -> list[str]:
    out = ["stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head"]
    names = {"M": ("in_proj", "out_proj"), "*": ("q_proj", "k_proj", "v_proj", "o_proj"), "-": ("up_proj", "down_proj")}
    for n, block in enumerate(cfg["text_config"]["hybrid_override_pattern"]):
        out += [f"stt_model.llm.layers.{n}.mixer.{name}" for name in names[block]]
    return out


DENSE_ALWAYS = ("embed_subword.embed_tokens", "mog_head.proj_mus")


def mixed_bits_map(cfg: dict, plan_paths: list[str]) -> dict[str, int]:
    """Widths in the spirit of the JANG_4 bundle: sensitive modules wider, the bulk at 4 bits."""
    widths: dict[str, int] = {}
    for path in plan_paths:
        if any(tag in path for tag in DENSE_ALWAYS):
            continue
        if path in llm_modules(cfg)[:3] or ".embed_subword." in path:
            widths[path] = 8
        elif (".mixer.q_proj" in path or ".mixer.k_proj" in path or ".mixer.v_proj" in path
              or ".mixer.o_proj" in path or path.endswith(("perception.proj", "pre_encode.out", "embed_code"))):
            widths[path] = 6
        elif ".mog_head." in path or "rnnt" in path or "gated_fusion" in path or ".layers.0." in path:
            widths[path] = 5
        else:
            widths[path] = 4
    return widths


def quantizable_paths(cfg: dict) -> list[str]:
    """Every Linear/Embedding module path whose input width divides into groups of 64."""
    probe = Plan(0, {})
    for planner in (plan_perception, plan_rnnt, plan_llm, plan_tts, plan_codec):
        planner(probe, cfg)
    shapes = {t.key: t.shape for t in probe.tensors}
    paths = []
    for key, shape in shapes.items():
        if not key.endswith(".weight") or len(shape) != 2:
            continue
        path = key[: -len(".weight")]
        if shape[1] % GROUP_SIZE == 0 and not path.endswith(("norm", "layernorm")) and "lstm" not in path:
            paths.append(path)
    return paths


def build_plan(cfg: dict, seed: int, quant: dict[str, int]) -> Plan:
    plan = Plan(seed, quant)
    for planner in (plan_perception, plan_rnnt, plan_llm, plan_tts, plan_codec):
        planner(plan, cfg)
    return plan


def write_checkpoint(out: Path, preset: str, seed: int, bits: int | None = None, mixed_bits: bool = False,
                     max_shard_bytes: int = 5 << 30, workers: int | None = None) -> Path:
    """The preset's random checkpoint in `out`; tensors are generated on `workers` threads (default: the CPU
    count, at most 16), which changes no byte."""
    workers = workers or min(os.cpu_count() or 1, 16)
    cfg = preset_config(preset)
    if bits is not None and mixed_bits:
        raise ValueError("--bits and --mixed-bits are exclusive")
    quant: dict[str, int] = {}
    if bits is not None:
        quant = {path: bits for path in llm_modules(cfg)}
    elif mixed_bits:
        quant = mixed_bits_map(cfg, quantizable_paths(cfg))
    if quant:
        default = bits if bits is not None else 4
        qmap: dict = {"group_size": GROUP_SIZE, "bits": default}
        qmap.update({path: {"group_size": GROUP_SIZE, "bits": b} for path, b in quant.items()})
        cfg["quantization"] = qmap
        cfg["quantization_config"] = qmap
    plan = build_plan(cfg, seed, quant)

    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in plan.tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    if len(shards) == 1:
        write_file(out / "model.safetensors", shards[0], workers=workers)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_file(out / name, shard, workers=workers)
            weight_map.update({t.key: name for t in shard})
        total = sum(t.nbytes for t in plan.tensors)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    (out / "config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    text = cfg["text_config"]
    tokenizer, tokenizer_config = build_tokenizer(
        text["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"], cfg["silence_token_id"], cfg["pad_token_id"]
    )
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bits", type=int, choices=(4, 8), help="quantize the language model at this width")
    parser.add_argument("--mixed-bits", action="store_true", help="4/5/6/8-bit per-module map over all networks")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="split into shards of at most this size")
    args = parser.parse_args(argv)
    if args.bits and args.mixed_bits:
        parser.error("--bits and --mixed-bits are exclusive")
    path = write_checkpoint(args.out, args.preset, args.seed, args.bits, args.mixed_bits,
                            int(args.max_shard_gb * (1 << 30)))
    print(f"wrote {args.preset} checkpoint (seed {args.seed}) to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
