"""Write a copy of a checkpoint with its quantized modules dequantized to dense bfloat16.

    python -m tools.dequantize_checkpoint --model IN --out OUT

Every other tensor is copied byte for byte in its stored layout; `config.json` loses the quantization entries of
the dequantized modules. The copy is what the language service's `--weights-dtype bfloat16` computes with, so
running the reference on it gives the goldens for that mode.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from services.common.checkpoint import Checkpoint
from services.common.safetensors_io import PlannedTensor, write_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _stored(value: mx.array) -> tuple[str, np.ndarray]:
    if value.dtype == mx.bfloat16:
        return "BF16", np.array(value.view(mx.uint16))
    return {mx.float32: "F32", mx.int32: "I32", mx.uint32: "U32", mx.float16: "F16"}[value.dtype], np.array(value)


def dequantize_checkpoint(source: Path, out: Path) -> Path:
    checkpoint = Checkpoint(source)
    try:
        modules = sorted(key[: -len(".scales")] for key in checkpoint.tensors if key.endswith(".scales"))
        dense: dict[str, mx.array] = {}
        for module in modules:
            spec = checkpoint.quant_spec(module)
            dense[f"{module}.weight"] = mx.dequantize(
                checkpoint.read_raw(f"{module}.weight"), checkpoint.read_raw(f"{module}.scales"),
                checkpoint.read_raw(f"{module}.biases"), group_size=spec.group_size, bits=spec.bits, mode=spec.mode,
            ).astype(mx.bfloat16)
        dropped = {f"{m}.{part}" for m in modules for part in ("scales", "biases")}
        planned = []
        for key in checkpoint.tensors:
            if key in dropped:
                continue
            dtype, data = _stored(dense[key] if key in dense else checkpoint.read_raw(key))
            planned.append(PlannedTensor(key, dtype, tuple(data.shape), lambda data=data: data))
        out.mkdir(parents=True, exist_ok=True)
        write_file(out / "model.safetensors", planned)
    finally:
        checkpoint.close()
    config = json.loads((source / "config.json").read_text())
    for name in ("quantization", "quantization_config"):
        table = config.get(name)
        if isinstance(table, dict):
            for module in modules:
                table.pop(module, None)
            if not any(isinstance(v, dict) for v in table.values()):
                config.pop(name)
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint to read")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the dense copy to")
    args = parser.parse_args(argv)
    dequantize_checkpoint(args.model, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
