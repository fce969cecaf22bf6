"""`config.json` of a VoiceChat checkpoint as typed dataclasses.

Defaults equal the released 11B model, so a partial file fills in the real values. Unknown keys are
ignored (converted checkpoints carry extra bookkeeping); a wrong value fails loudly, naming the field:

    >>> VoiceChatConfig.from_dict({"speaker": "Bob"})
    Traceback (most recent call last):
    ConfigError: config.json: speaker: only the built-in voice 'Aria' exists, got 'Bob'
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VALID_BLOCKS = {"M": "mamba", "*": "attention", "-": "mlp"}
QUANT_BITS = (2, 3, 4, 5, 6, 8)


class ConfigError(ValueError):
    """A config.json value that cannot describe a working model."""


def _fail(path: str, message: str) -> typing.NoReturn:
    raise ConfigError(f"config.json: {path}: {message}")


def _coerce(value: Any, annotation: Any, path: str) -> Any:
    """Check one JSON value against a field annotation; ints are accepted where floats are."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            _fail(path, f"expected an object, got {type(value).__name__}")
        return _from_dict(annotation, value, path)
    if annotation is Any:
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            _fail(path, f"expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, f"expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(path, f"expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            _fail(path, f"expected a string, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            _fail(path, f"expected a list, got {value!r}")
        (item,) = typing.get_args(annotation)[:1] or (Any,)
        items = [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            _fail(path, f"expected an object, got {value!r}")
        return dict(value)
    return value


def _from_dict(cls: type, values: dict, path: str = ""):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name not in values:
            continue
        sub = f"{path}.{f.name}" if path else f.name
        kwargs[f.name] = _coerce(values[f.name], hints[f.name], sub)
    obj = cls(**kwargs)
    obj.validate(path)
    return obj


def _positive(obj: Any, path: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            _fail(f"{path}.{name}" if path else name, f"must be positive, got {value!r}")


@dataclass
class PreprocessorConfig:
    """Log-mel frontend (NeMo AudioToMelSpectrogramPreprocessor at inference)."""

    sample_rate: int = 16_000
    features: int = 128
    n_fft: int = 512
    window_size: float = 0.025
    window_stride: float = 0.01
    window: str = "hann"
    preemph: float = 0.97
    log: bool = True
    normalize: str = "NA"
    dither: float = 1e-5
    log_zero_guard_value: float = 2.0**-24
    pad_to: int = 0
    pad_value: float = 0.0
    pad_mode: str = "reflect"

    @property
    def win_length(self) -> int:
        return int(self.window_size * self.sample_rate)

    @property
    def hop_length(self) -> int:
        return int(self.window_stride * self.sample_rate)

    def validate(self, path: str) -> None:
        _positive(self, path, "sample_rate", "features", "n_fft", "window_size", "window_stride")
        if self.win_length > self.n_fft:
            _fail(f"{path}.window_size", f"window of {self.win_length} samples exceeds n_fft {self.n_fft}")
        if self.window != "hann":
            _fail(f"{path}.window", f"only 'hann' is supported, got {self.window!r}")
        if self.normalize not in ("NA", "None", "none", ""):
            _fail(f"{path}.normalize", f"only unnormalized features ('NA') are supported, got {self.normalize!r}")
        if self.pad_to != 0:
            _fail(f"{path}.pad_to", f"only 0 is supported, got {self.pad_to}")
        if self.pad_mode != "reflect":
            _fail(f"{path}.pad_mode", f"only 'reflect' is supported, got {self.pad_mode!r}")


def _context_pairs(value: Any, path: str) -> tuple[tuple[int, int], ...]:
    """`[70, 0]` and `[[70, 0], ...]` both describe attention contexts; normalise to pairs."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
        if len(value) != 2:
            _fail(path, f"expected [left, right] or a list of them, got {list(value)!r}")
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        _fail(path, f"expected [left, right] or a list of them, got {value!r}")
    pairs = []
    for i, pair in enumerate(value):
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
        ):
            _fail(f"{path}[{i}]", f"expected [left, right] integers, got {pair!r}")
        if pair[0] < -1 or pair[1] < 0:
            _fail(f"{path}[{i}]", f"left must be >= -1 and right >= 0, got {list(pair)}")
        pairs.append((int(pair[0]), int(pair[1])))
    return tuple(pairs)


@dataclass
class EncoderConfig:
    """Cache-aware FastConformer."""

    feat_in: int = 128
    n_layers: int = 24
    d_model: int = 1024
    n_heads: int = 8
    ff_expansion_factor: int = 4
    subsampling_factor: int = 8
    subsampling_conv_channels: int = 256
    conv_kernel_size: int = 9
    causal_downsampling: bool = True
    conv_context_size: Any = "causal"
    conv_norm_type: str = "layer_norm"
    self_attention_model: str = "rel_pos"
    att_context_style: str = "chunked_limited"
    att_context_size: Any = ((70, 0),)
    pos_emb_max_len: int = 5000
    use_bias: bool = False
    xscaling: bool = False

    @property
    def left_context(self) -> int:
        return self.att_context_size[0][0]

    @property
    def right_context(self) -> int:
        return self.att_context_size[0][1]

    @property
    def subsampling_steps(self) -> int:
        return int(math.log2(self.subsampling_factor))

    @property
    def subsampled_features(self) -> int:
        """Frequency bins left after the stride-2 stack: `floor(n / 2) + 1` per step (pad 2 left, 1 right)."""
        n = self.feat_in
        for _ in range(self.subsampling_steps):
            n = n // 2 + 1
        return n

    @property
    def conv_padding(self) -> tuple[int, int]:
        if self.conv_context_size == "causal":
            return self.conv_kernel_size - 1, 0
        left, right = self.conv_context_size
        return int(left), int(right)

    def validate(self, path: str) -> None:
        self.att_context_size = _context_pairs(self.att_context_size, f"{path}.att_context_size")
        _positive(self, path, "feat_in", "n_layers", "d_model", "n_heads", "ff_expansion_factor",
                  "subsampling_conv_channels", "conv_kernel_size", "pos_emb_max_len")
        if self.d_model % self.n_heads:
            _fail(f"{path}.n_heads", f"d_model {self.d_model} is not divisible by {self.n_heads} heads")
        if self.subsampling_factor < 2 or self.subsampling_factor & (self.subsampling_factor - 1):
            _fail(f"{path}.subsampling_factor", f"must be a power of two >= 2, got {self.subsampling_factor}")
        if self.conv_context_size != "causal":
            ok = isinstance(self.conv_context_size, (list, tuple)) and len(self.conv_context_size) == 2
            if not ok or sum(self.conv_context_size) != self.conv_kernel_size - 1:
                _fail(f"{path}.conv_context_size",
                      f"expected 'causal' or [left, right] summing to kernel-1, got {self.conv_context_size!r}")
        for name, allowed in (
            ("conv_norm_type", "layer_norm"),
            ("self_attention_model", "rel_pos"),
            ("att_context_style", "chunked_limited"),
        ):
            if getattr(self, name) != allowed:
                _fail(f"{path}.{name}", f"only {allowed!r} is supported, got {getattr(self, name)!r}")
        if not self.causal_downsampling:
            _fail(f"{path}.causal_downsampling", "only causal downsampling is supported")


@dataclass
class DecoderConfig:
    """RNNT prediction network."""

    pred_hidden: int = 640
    pred_rnn_layers: int = 2
    vocab_size: int = 1024
    blank_as_pad: bool = True

    def validate(self, path: str) -> None:
        _positive(self, path, "pred_hidden", "pred_rnn_layers", "vocab_size")


@dataclass
class JointConfig:
    """RNNT joint network."""

    joint_hidden: int = 640
    activation: str = "relu"
    encoder_hidden: int = 1024
    pred_hidden: int = 640
    num_classes: int = 1024

    def validate(self, path: str) -> None:
        _positive(self, path, "joint_hidden", "encoder_hidden", "pred_hidden", "num_classes")
        if self.activation not in ("relu", "sigmoid", "tanh"):
            _fail(f"{path}.activation", f"expected relu, sigmoid or tanh, got {self.activation!r}")


@dataclass
class AudioConfig:
    preprocessor: PreprocessorConfig = field(default_factory=PreprocessorConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    joint: JointConfig = field(default_factory=JointConfig)
    output_dim: int = 4480
    max_symbols: int = 10

    def validate(self, path: str) -> None:
        _positive(self, path, "output_dim", "max_symbols")
        if self.preprocessor.features != self.encoder.feat_in:
            _fail(f"{path}.encoder.feat_in",
                  f"{self.encoder.feat_in} differs from preprocessor.features {self.preprocessor.features}")
        if self.joint.encoder_hidden != self.encoder.d_model:
            _fail(f"{path}.joint.encoder_hidden",
                  f"{self.joint.encoder_hidden} differs from encoder.d_model {self.encoder.d_model}")
        if self.joint.pred_hidden != self.decoder.pred_hidden:
            _fail(f"{path}.joint.pred_hidden",
                  f"{self.joint.pred_hidden} differs from decoder.pred_hidden {self.decoder.pred_hidden}")
        if self.joint.num_classes != self.decoder.vocab_size:
            _fail(f"{path}.joint.num_classes",
                  f"{self.joint.num_classes} differs from decoder.vocab_size {self.decoder.vocab_size}")


@dataclass
class TextConfig:
    """Nemotron-H hybrid language model."""

    model_type: str = "nemotron_h"
    vocab_size: int = 131_072
    hidden_size: int = 4480
    intermediate_size: int = 15_680
    num_hidden_layers: int = 56
    max_position_embeddings: int = 131_072
    num_attention_heads: int = 40
    num_key_value_heads: int = 8
    head_dim: int | None = 128
    attention_bias: bool = False
    mamba_num_heads: int = 128
    mamba_head_dim: int = 80
    mamba_proj_bias: bool = False
    ssm_state_size: int = 128
    conv_kernel: int = 4
    n_groups: int = 8
    mlp_bias: bool = False
    use_bias: bool = False
    use_conv_bias: bool = True
    layer_norm_epsilon: float = 1e-5
    hybrid_override_pattern: str = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
    time_step_limit: list[float] | None = None

    @property
    def block_types(self) -> str:
        return self.hybrid_override_pattern

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def dt_limits(self) -> tuple[float, float]:
        if self.time_step_limit is None:
            return 0.0, math.inf
        return float(self.time_step_limit[0]), float(self.time_step_limit[1])

    def validate(self, path: str) -> None:
        if isinstance(self.hybrid_override_pattern, list):
            self.hybrid_override_pattern = "".join(self.hybrid_override_pattern)
        _positive(self, path, "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                  "conv_kernel", "n_groups")
        bad = sorted(set(self.hybrid_override_pattern) - set(VALID_BLOCKS))
        if bad:
            _fail(f"{path}.hybrid_override_pattern", f"unknown block types {bad}; expected M, * or -")
        if len(self.hybrid_override_pattern) != self.num_hidden_layers:
            _fail(f"{path}.num_hidden_layers",
                  f"{self.num_hidden_layers} differs from the {len(self.hybrid_override_pattern)} "
                  "blocks of hybrid_override_pattern")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail(f"{path}.num_key_value_heads",
                  f"{self.num_attention_heads} heads are not divisible into {self.num_key_value_heads} groups")
        if self.mamba_num_heads % self.n_groups:
            _fail(f"{path}.n_groups", f"{self.mamba_num_heads} mamba heads not divisible by {self.n_groups} groups")
        if self.time_step_limit is not None and len(self.time_step_limit) != 2:
            _fail(f"{path}.time_step_limit", f"expected two numbers, got {self.time_step_limit!r}")


@dataclass
class CharacterEncoderConfig:
    """The one-layer T5Gemma encoder over a subword's characters."""

    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float = 50.0
    rope_base: float = 10_000.0
    char_vocab_size: int = 257

    def validate(self, path: str) -> None:
        _positive(self, path, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "char_vocab_size")


@dataclass
class MoGConfig:
    """Mixture-of-Gaussians head of EAR-TTS."""

    intermediate_size: int = 4608
    low_rank: int = 64
    min_log_std: float = -4.0
    num_layers: int = 3
    num_predictions: int = 1024
    eps: float = 1e-6

    def validate(self, path: str) -> None:
        _positive(self, path, "intermediate_size", "low_rank", "num_layers", "num_predictions")


@dataclass
class TTSConfig:
    """EAR-TTS: Gemma-3-style backbone, character-aware conditioning, MoG head."""

    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    sliding_window: int = 7500
    sliding_window_pattern: int = 6
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    rope_global_base_freq: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    latent_size: int = 512
    num_quantizers: int = 31
    codebook_size: int = 1024
    num_delay_speech_tokens: int = 2
    num_iterations: int = 8
    guidance_scale: float = 0.2
    top_p: float = 0.95
    noise_scale: float = 0.001
    exponent: float = 3.0
    disable_eos_prediction: bool = True
    use_gated_fusion_for_text_audio: bool = True
    use_subword_flag_emb: bool = True
    use_bos_eos_emb: bool = True
    use_audio_prompt_frozen_projection: bool = True
    audio_prompt_duration: float = 3.0
    character_encoder: CharacterEncoderConfig = field(default_factory=CharacterEncoderConfig)
    mog_head: MoGConfig = field(default_factory=MoGConfig)

    def is_global_layer(self, index: int) -> bool:
        """Every `sliding_window_pattern`-th layer attends globally; the rest use the sliding window."""
        return (index + 1) % self.sliding_window_pattern == 0

    def validate(self, path: str) -> None:
        _positive(self, path, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "sliding_window", "sliding_window_pattern",
                  "latent_size", "num_quantizers", "codebook_size", "num_iterations")
        if not 0.0 < self.top_p <= 1.0:
            _fail(f"{path}.top_p", f"must be in (0, 1], got {self.top_p}")
        for flag in ("use_gated_fusion_for_text_audio", "use_subword_flag_emb", "use_bos_eos_emb"):
            if not getattr(self, flag):
                _fail(f"{path}.{flag}", "only true is supported (the released model's setting)")


@dataclass
class CodecConfig:
    """The 22.05 kHz, 31-codebook codec."""

    sample_rate: int = 22_050
    base_channels: int = 384
    channel_multipliers: list[int] = field(default_factory=lambda: [1, 2, 4])
    downsample_rates: list[int] = field(default_factory=lambda: [7, 7, 9])
    blocks_per_stage: int = 3
    block_kernel_size: int = 7
    latent_dim: int = 512
    n_fft: int = 16
    hop_length: int = 4
    num_quantizers: int = 31
    codebook_size: int = 1024

    @property
    def waveform_to_token_ratio(self) -> int:
        """Output samples per code frame: hop times every downsampling rate (4*7*7*9 = 1764)."""
        return self.hop_length * math.prod(self.downsample_rates)

    @property
    def stft_channels(self) -> int:
        """Real and imaginary parts of the n_fft/2 + 1 bins (18 for n_fft 16)."""
        return 2 * (self.n_fft // 2 + 1)

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.waveform_to_token_ratio

    @property
    def stage_channels(self) -> list[int]:
        return [self.base_channels * m for m in self.channel_multipliers]

    def validate(self, path: str) -> None:
        _positive(self, path, "sample_rate", "base_channels", "blocks_per_stage", "block_kernel_size",
                  "latent_dim", "n_fft", "hop_length", "num_quantizers", "codebook_size")
        if len(self.channel_multipliers) != len(self.downsample_rates):
            _fail(f"{path}.channel_multipliers",
                  f"{len(self.channel_multipliers)} stages differ from {len(self.downsample_rates)} downsample_rates")


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int
    mode: str = "affine"


@dataclass
class QuantizationConfig:
    """Per-module quantization: a default plus entries `{"module.path": {"bits": b, "group_size": g}}`."""

    group_size: int = 64
    bits: int = 4
    mode: str = "affine"
    modules: dict[str, QuantSpec | None] = field(default_factory=dict)

    @classmethod
    def parse(cls, values: dict, path: str = "quantization") -> QuantizationConfig:
        if not isinstance(values, dict):
            _fail(path, f"expected an object, got {values!r}")
        base = cls()
        modules: dict[str, QuantSpec | None] = {}
        for key, value in values.items():
            if key in ("group_size", "bits"):
                setattr(base, key, _coerce(value, int, f"{path}.{key}"))
            elif key == "mode":
                base.mode = _coerce(value, str, f"{path}.mode")
            elif value is False:
                modules[key] = None
            elif isinstance(value, dict):
                bits = _coerce(value.get("bits", base.bits), int, f"{path}.{key}.bits")
                group = _coerce(value.get("group_size", base.group_size), int, f"{path}.{key}.group_size")
                modules[key] = QuantSpec(bits, group, value.get("mode", base.mode))
        base.modules = modules
        base.validate(path)
        return base

    def validate(self, path: str) -> None:
        specs = [QuantSpec(self.bits, self.group_size, self.mode)]
        specs += [s for s in self.modules.values() if s is not None]
        for spec in specs:
            if spec.bits not in QUANT_BITS:
                _fail(path, f"bits must be one of {QUANT_BITS}, got {spec.bits}")
            if spec.group_size not in (32, 64, 128):
                _fail(path, f"group_size must be 32, 64 or 128, got {spec.group_size}")
            if spec.mode != "affine":
                _fail(path, f"only affine quantization is supported, got {spec.mode!r}")

    def for_module(self, module_path: str) -> QuantSpec | None:
        """The spec listed for a module, or None when the map does not quantize it."""
        return self.modules.get(module_path)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"group_size": self.group_size, "bits": self.bits}
        for key, spec in self.modules.items():
            out[key] = False if spec is None else {"group_size": spec.group_size, "bits": spec.bits}
        return out


@dataclass
class VoiceChatConfig:
    """The whole `config.json`."""

    text_config: TextConfig = field(default_factory=TextConfig)
    audio_config: AudioConfig = field(default_factory=AudioConfig)
    tts_config: TTSConfig = field(default_factory=TTSConfig)
    codec_config: CodecConfig = field(default_factory=CodecConfig)
    model_type: str = "nemotron_voicechat"
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 12
    silence_token_id: int = 11
    rnnt_blank_id: int = 1024
    input_sample_rate: int = 16_000
    output_sample_rate: int = 22_050
    frame_duration: float = 0.08
    function_channel_weight: float = 2.0
    default_system_prompt: str = ""
    speaker: str = "Aria"
    rnnt_vocabulary: list[str] = field(default_factory=list)
    quantization: QuantizationConfig | None = None

    # Derived sizes, computed once here and imported everywhere else.
    @property
    def input_frame_samples(self) -> int:
        """16 kHz samples per 80 ms input frame (1280)."""
        return round(self.input_sample_rate * self.frame_duration)

    @property
    def output_frame_samples(self) -> int:
        """22.05 kHz samples per code frame (1764)."""
        return self.codec_config.waveform_to_token_ratio

    @property
    def special_text_ids(self) -> frozenset[int]:
        """Ids never shown as text: pad, silence, BOS, EOS."""
        return frozenset({self.pad_token_id, self.silence_token_id, self.bos_token_id, self.eos_token_id})

    @classmethod
    def from_dict(cls, values: dict) -> VoiceChatConfig:
        if not isinstance(values, dict):
            raise ConfigError(f"config.json: expected a JSON object, got {type(values).__name__}")
        values = dict(values)
        quant = values.pop("quantization", None) or values.pop("quantization_config", None)
        values.pop("quantization_config", None)
        config = _from_dict(cls, values)
        if quant:
            config.quantization = QuantizationConfig.parse(quant)
        return config

    @classmethod
    def load(cls, model_dir: str | Path) -> VoiceChatConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: not found; --model must point at a converted VoiceChat checkpoint folder")
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(values)

    def validate(self, path: str) -> None:
        if self.model_type != "nemotron_voicechat":
            _fail("model_type", f"expected 'nemotron_voicechat', got {self.model_type!r}")
        if self.speaker != "Aria":
            _fail("speaker", f"only the built-in voice 'Aria' exists, got {self.speaker!r}")
        _positive(self, path, "input_sample_rate", "output_sample_rate", "frame_duration")
        if abs(self.input_sample_rate * self.frame_duration - self.input_frame_samples) > 1e-6:
            _fail("frame_duration", f"{self.frame_duration} s is not a whole number of input samples")
        if self.audio_config.output_dim != self.text_config.hidden_size:
            _fail("audio_config.output_dim",
                  f"{self.audio_config.output_dim} differs from text_config.hidden_size {self.text_config.hidden_size}")
        vocab = self.audio_config.decoder.vocab_size
        if self.rnnt_blank_id != vocab:
            _fail("rnnt_blank_id", f"{self.rnnt_blank_id} must equal audio_config.decoder.vocab_size {vocab}")
        if self.rnnt_vocabulary and len(self.rnnt_vocabulary) != vocab:
            _fail("rnnt_vocabulary", f"has {len(self.rnnt_vocabulary)} pieces, audio_config.decoder.vocab_size "
                                     f"is {vocab}")
        tts, codec = self.tts_config, self.codec_config
        if codec.latent_dim != tts.latent_size:
            _fail("codec_config.latent_dim",
                  f"{codec.latent_dim} differs from tts_config.latent_size {tts.latent_size}")
        if codec.num_quantizers != tts.num_quantizers or codec.codebook_size != tts.codebook_size:
            _fail("codec_config.num_quantizers",
                  f"codec {codec.num_quantizers}x{codec.codebook_size} differs from tts_config "
                  f"{tts.num_quantizers}x{tts.codebook_size}")
        if codec.sample_rate != self.output_sample_rate:
            _fail("codec_config.sample_rate",
                  f"{codec.sample_rate} differs from output_sample_rate {self.output_sample_rate}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "silence_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.text_config.vocab_size:
                _fail(name, f"{value} is outside the text vocabulary of {self.text_config.vocab_size}")
