"""Open a converted VoiceChat checkpoint and load one service's tensors, in MLX layout.

A service asks for key prefixes (`stt_model.perception.`, ...); only those tensors are read from the
safetensors shards (memory-mapped, byte ranges by key). The torch-export layouts the converted files
carry are turned into MLX layouts on the way, each conversion gated on the tensor's shape so that an
already converted file passes unchanged:

    stt_model.perception...conv.N.weight (O, I, kh, kw)  -> (O, kh, kw, I)
    perception / Mamba / codec Conv1d     (O, I, K)       -> (O, K, I)
    codec decoder stage-start ConvTranspose1d (I, O, K)   -> (O, K, I)
    LSTM weight_ih_l{n} / weight_hh_l{n} / bias_ih_l{n} + bias_hh_l{n} -> {n}.Wx / {n}.Wh / {n}.bias
    prvq._variance_list.{q}.variance -> prvq.variance_list.{q}.variance
    tts_model._control_codes -> tts_model.control_codes
    stt_model.perception.preprocessor.* -> dropped (the frontend is rebuilt in code)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.common.config import ConfigError, QuantSpec, VoiceChatConfig
from services.common.safetensors_io import MappedFile, SafetensorsError, TensorInfo, read_header

if TYPE_CHECKING:
    import mlx.core as mx


class CheckpointError(ValueError):
    """A checkpoint folder that cannot serve: missing files or tensors, or shapes that disagree."""


_LSTM = re.compile(r"^(?P<stem>.*\.dec_rnn\.lstm)\.(?P<kind>weight_ih|weight_hh|bias_ih|bias_hh)_l(?P<n>\d+)$")
_PERCEPTION_CONV = re.compile(r"^stt_model\.perception\.encoder\.pre_encode\.conv\.\d+\.weight$")
_CODEC_LAYER = re.compile(r"^tts_model\.audio_codec\.(?P<part>encoder|decoder)\.layers\.(?P<i>\d+)\.(?P<rest>.+)$")


def _to_mlx(array: np.ndarray, dtype: str) -> mx.array:
    import mlx.core as mx

    if dtype == "BF16":
        return mx.array(array).view(mx.bfloat16)
    return mx.array(array)


class Checkpoint:
    """A checkpoint folder: `config.json`, `model*.safetensors` (+ index), tokenizer files.

    Opening one reads only `config.json` and the shards' headers, without MLX (the orchestrator checks a
    `--model` folder this way); MLX is imported when tensors are read.
    """

    def __init__(self, model_dir: str | Path):
        self.path = Path(model_dir).expanduser()
        if not self.path.is_dir():
            raise CheckpointError(
                f"{self.path}: no such folder; --model must point at a converted VoiceChat checkpoint"
            )
        try:
            self.config = VoiceChatConfig.load(self.path)
        except ConfigError as exc:
            raise CheckpointError(str(exc)) from None
        self.tensors = self._index()
        self._maps: dict[Path, MappedFile] = {}

    # ---- discovery -------------------------------------------------------------------------------------

    def _index(self) -> dict[str, TensorInfo]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
            files = sorted({self.path / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{self.path}: shards listed in {index.name} are missing: {', '.join(missing)}")
        else:
            files = sorted(self.path.glob("model*.safetensors"))
            if not files:
                raise CheckpointError(
                    f"{self.path}: no model*.safetensors files; is this a converted VoiceChat checkpoint?"
                )
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            try:
                tensors.update(read_header(file))
            except SafetensorsError as exc:
                raise CheckpointError(str(exc)) from None
        return tensors

    def keys(self, prefixes: Iterable[str] = ("",)) -> list[str]:
        """Stored keys under the prefixes; a prefix also matches the converted spelling of renamed keys."""
        prefixes = tuple(prefixes)
        prefixes += tuple(_renamed(p) for p in prefixes)
        return [k for k in self.tensors if k.startswith(prefixes) or _renamed(k).startswith(prefixes)]

    def read_raw(self, key: str) -> mx.array:
        """One stored tensor as written (no layout conversion)."""
        info = self.tensors.get(key)
        if info is None:
            raise CheckpointError(f"{self.path}: missing tensor {key!r}")
        mapped = self._maps.get(info.path)
        if mapped is None:
            mapped = self._maps[info.path] = MappedFile(info.path)
        return _to_mlx(mapped.array(info), info.dtype)

    def close(self) -> None:
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()

    # ---- loading -------------------------------------------------------------------------------------------

    def load(self, prefixes: Sequence[str]) -> Weights:
        """Every tensor under `prefixes`, converted to MLX layout, keyed by MLX-layout names."""
        keys = self.keys(prefixes)
        if not keys:
            raise CheckpointError(f"{self.path}: no tensors under {', '.join(prefixes)}")
        out: dict[str, mx.array] = {}
        lstm_bias: dict[str, list[mx.array]] = {}
        for key in keys:
            if key.startswith("stt_model.perception.preprocessor."):
                continue
            value = self.read_raw(key)
            match = _LSTM.match(key)
            if match:
                stem, kind, n = match["stem"], match["kind"], match["n"]
                if kind.startswith("bias"):
                    lstm_bias.setdefault(f"{stem}.{n}.bias", []).append(value)
                else:
                    out[f"{stem}.{n}.{'Wx' if kind == 'weight_ih' else 'Wh'}"] = value
                continue
            name = _renamed(key)
            out[name] = self._convert(name, value)
        for key, parts in lstm_bias.items():
            out[key] = parts[0] + parts[1] if len(parts) == 2 else parts[0]
        return Weights(self, out)

    def _convert(self, key: str, value: mx.array) -> mx.array:
        if value.ndim == 4 and _PERCEPTION_CONV.match(key):
            return _gate_conv2d(key, value)
        if value.ndim != 3 or not key.endswith(".weight"):
            return value
        kernel = self._conv1d_kernel(key)
        if kernel is None:
            return value
        size, transposed = kernel
        return _gate_conv1d(key, value, size, transposed)

    def _conv1d_kernel(self, key: str) -> tuple[int, bool] | None:
        """Kernel size of a 1-D convolution weight, and whether it is a transposed convolution."""
        cfg = self.config
        if key.startswith("stt_model.perception.encoder.layers."):
            if ".depthwise_conv." in key:
                return cfg.audio_config.encoder.conv_kernel_size, False
            if ".pointwise_conv" in key:
                return 1, False
            return None
        if key.startswith("stt_model.llm.") and key.endswith(".mixer.conv1d.weight"):
            return cfg.text_config.conv_kernel, False
        match = _CODEC_LAYER.match(key)
        if not match:
            return None
        codec = cfg.codec_config
        i, rest = int(match["i"]), match["rest"]
        if ".dwconv." in f".{rest}":
            return codec.block_kernel_size, False
        if rest.startswith(("pwconv1", "pwconv2")):
            return 1, False
        stage = codec.blocks_per_stage + 1
        rates = codec.downsample_rates
        if match["part"] == "encoder":
            if i == 0:
                return 1, False
            return rates[(i - 1) // stage], False
        if i < stage * len(rates):
            return list(reversed(rates))[i // stage], True
        return 1, False

    # ---- quantization ----------------------------------------------------------------------------------

    def quant_spec(self, module: str) -> QuantSpec | None:
        """How a module's weight is stored: the config map's entry, else inferred when `.scales` exist."""
        quant = self.config.quantization
        spec = quant.for_module(module) if quant else None
        if spec is not None or f"{module}.scales" not in self.tensors:
            return spec
        group = quant.group_size if quant else 64
        weight, scales = self.tensors[f"{module}.weight"], self.tensors[f"{module}.scales"]
        bits = weight.shape[-1] * 32 // (scales.shape[-1] * group)
        return QuantSpec(bits, group)


def _renamed(key: str) -> str:
    """The converted name of a key the torch export spells differently."""
    key = key.replace("prvq._variance_list.", "prvq.variance_list.")
    return "tts_model.control_codes" + key[len("tts_model._control_codes"):] if key.startswith(
        "tts_model._control_codes") else key


def _gate_conv2d(key: str, value: mx.array) -> mx.array:
    """(O, I, kh, kw) -> (O, kh, kw, I) unless the square kernel axes already sit at 1 and 2."""
    o, a, b, c = value.shape
    if b == c and a != b:
        return value.transpose(0, 2, 3, 1)
    if a == b:
        return value
    raise CheckpointError(f"tensor {key!r}: shape {tuple(value.shape)} is neither (O, I, k, k) nor (O, k, k, I)")


def _gate_conv1d(key: str, value: mx.array, kernel: int, transposed: bool) -> mx.array:
    """Torch Conv1d (O, I, K) or ConvTranspose1d (I, O, K) -> MLX (O, K, I); MLX layout passes through."""
    shape = tuple(value.shape)
    if shape[1] == kernel:  # already (O, K, I); when both axes equal the kernel the layouts coincide
        return value
    if shape[2] == kernel:
        return value.transpose(1, 2, 0) if transposed else value.transpose(0, 2, 1)
    raise CheckpointError(f"tensor {key!r}: shape {shape} has no axis of the kernel size {kernel} config.json implies")


class Weights:
    """A service's tensors in MLX layout, with lookups that fail naming the key and the shapes."""

    def __init__(self, checkpoint: Checkpoint, arrays: dict[str, mx.array]):
        self.checkpoint = checkpoint
        self.arrays = arrays

    def __contains__(self, key: str) -> bool:
        return key in self.arrays

    def __len__(self) -> int:
        return len(self.arrays)

    def keys(self) -> list[str]:
        return list(self.arrays)

    def get(self, key: str, shape: Sequence[int] | None = None) -> mx.array:
        value = self.arrays.get(key)
        if value is None:
            raise CheckpointError(f"{self.checkpoint.path}: missing tensor {key!r}")
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.checkpoint.path}: tensor {key!r} has shape {tuple(value.shape)}, "
                f"but config.json implies {tuple(shape)}"
            )
        return value

    def quant_spec(self, module: str) -> QuantSpec | None:
        if f"{module}.scales" not in self.arrays:
            return None
        return self.checkpoint.quant_spec(module)

    def quantized_modules(self) -> list[str]:
        return [key[: -len(".scales")] for key in self.arrays if key.endswith(".scales")]

    def dequantized(self, dtype: mx.Dtype | None = None) -> Weights:
        """Every quantized module as a dense `dtype` (default bfloat16) weight (`mx.dequantize`, as the reference's
        dequantizer computes it): on a GPU with memory to spare, dense matmuls batch across sessions where 4-bit
        ones do not."""
        import mlx.core as mx

        dtype = mx.bfloat16 if dtype is None else dtype
        arrays = dict(self.arrays)
        for module in self.quantized_modules():
            spec = self.quant_spec(module)
            weight = mx.dequantize(arrays.pop(f"{module}.weight"), arrays.pop(f"{module}.scales"),
                                   arrays.pop(f"{module}.biases"), group_size=spec.group_size, bits=spec.bits,
                                   mode=spec.mode)
            arrays[f"{module}.weight"] = weight.astype(dtype)
        return Weights(self.checkpoint, arrays)
