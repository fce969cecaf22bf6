"""Time the language model's float32 x bf16 products at its real shapes, and check their accuracy.

    python -m bench.matmuls --model DIR [--rows 1,16] [--repeats 20] [--against TREE] [--json]

The language model is loaded as the many-conversation configuration runs it (`--weights-dtype bfloat16
--split-matmuls`, a CUDA GPU). For each distinct shape of its routed projections, at each row count: the time of
one product by `split_matmul` (`repeats` independent calls queued at once, so launches hide behind the kernels),
by cuBLAS's float32 GEMM on a float32 copy of the weight, and, with `--against TREE`, by the `split_matmul` of
another checkout (side by side in one run), each timed twice, the products in one order and then the reverse, the
lower kept (whichever runs first at a shape and row count is slower: on an H100 the order alone moved the step's
total at 1 and 16 rows by 30-40%); the weight's read rate; and, at the largest row count, each one's
largest error against a float64 product (over the first `CHECK_COLUMNS` columns, relative to their largest
value) and whether the first and the last row alone equal their results in the batch, bit for bit. The step's
total weighs each shape by how many projections have it: one frame step's products, one after another.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from services.common import layers, split_matmul
from services.common.loading import LoadOptions, process_settings
from services.llm.engine import LanguageEngine

CHECK_COLUMNS = 4096
Product = Callable[[mx.array, mx.array], mx.array]


def routed_shapes(model: Path) -> tuple[Counter, dict[tuple[int, int], mx.array]]:
    """How many routed projections of each (N, K) the language model has, and one weight of each shape."""
    engine = LanguageEngine.load(model, options=LoadOptions("bfloat16", split_matmuls=True))
    found = [m for m in layers.linears([engine.model.backbone, engine.model.lm_head, engine.model.function_head])
             if m.split]
    counts = Counter(tuple(m.weight.shape) for m in found)
    weights = {}
    for m in found:
        weights.setdefault(tuple(m.weight.shape), m.weight)
    return counts, weights


def timed(product: Product, x: mx.array, weight: mx.array, repeats: int) -> float:
    """Milliseconds per call, `repeats` calls queued and evaluated together (after one untimed)."""
    mx.eval(product(x, weight))
    mx.synchronize()
    start = time.perf_counter()
    mx.eval([product(x, weight) for _ in range(repeats)])
    mx.synchronize()
    return (time.perf_counter() - start) * 1000.0 / repeats


def accuracy(product: Product, x: mx.array, weight: mx.array) -> tuple[float, bool]:
    """Largest error against float64 over the first CHECK_COLUMNS columns (relative to their largest value),
    and whether the first and the last row alone give their batch results bit for bit."""
    y = np.array(product(x, weight))[:, :CHECK_COLUMNS]
    cols = np.array(weight[:CHECK_COLUMNS].astype(mx.float32)).astype(np.float64)
    exact = np.array(x).astype(np.float64) @ cols.T
    error = float(np.abs(y - exact).max() / np.abs(exact).max())
    alone = all(np.array_equal(np.array(product(x[i:i + 1], weight))[:, :CHECK_COLUMNS], y[i:i + 1])
                for i in (0, x.shape[0] - 1))
    return error, alone


def _float32(x: mx.array, weight32: mx.array) -> mx.array:
    return x @ weight32.T


def load_against(tree: Path) -> Product:
    """`split_matmul` from another checkout's `services/common/split_matmul.py`."""
    spec = importlib.util.spec_from_file_location("against_split_matmul",
                                                  tree / "services" / "common" / "split_matmul.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass in the module looks its module up while it is being made
    spec.loader.exec_module(module)
    return module.split_matmul


def measure(model: Path, rows: list[int], repeats: int, against: Product | None) -> dict:
    """The per-shape times, read rates and accuracy, and the step's totals (keys of `ms` and `step_ms`: the row
    counts as strings, as JSON keeps them)."""
    counts, weights = routed_shapes(model)
    products: dict[str, Product] = {"kernel": split_matmul.split_matmul}
    if against is not None:
        products["against"] = against
    products["float32"] = _float32
    rng = np.random.default_rng(0)
    shapes = []
    for shape, weight in sorted(weights.items()):
        weight32 = weight.astype(mx.float32)
        mx.eval(weight32)
        operands = {name: weight32 if name == "float32" else weight for name in products}
        entry = {"n": shape[0], "k": shape[1], "count": counts[shape], "ms": {}, "tb_per_s": {}, "error": {},
                 "alone_equal": {}}
        for m in rows:
            x = mx.array(rng.standard_normal((m, shape[1])).astype(np.float32))
            names = list(products)
            for name in names + names[::-1]:  # each timed once in each place of the order; the lower kept
                w = operands[name]
                ms = min(timed(products[name], x, w, repeats), entry["ms"].get(name, {}).get(str(m), math.inf))
                entry["ms"].setdefault(name, {})[str(m)] = ms
                entry["tb_per_s"].setdefault(name, {})[str(m)] = shape[0] * shape[1] * w.itemsize / ms / 1e9
            if m == max(rows):
                for name, product in products.items():
                    entry["error"][name], entry["alone_equal"][name] = accuracy(product, x, operands[name])
        del weight32, operands
        mx.clear_cache()
        shapes.append(entry)
    step = {name: {str(m): sum(e["count"] * e["ms"][name][str(m)] for e in shapes) for m in rows}
            for name in products}
    return {"rows": rows, "shapes": shapes, "step_ms": step}


def table(result: dict) -> str:
    names = list(result["step_ms"])
    head = "| weight (N x K) | count | " + " | ".join(
        f"{name} {m} rows ms (TB/s)" for m in result["rows"] for name in names) + " | " + " | ".join(
        f"{name} error (alone equal)" for name in names) + " |"
    lines = [head, "|" + " --- |" * (2 + len(names) * (len(result["rows"]) + 1))]
    for e in result["shapes"]:
        cells = [f"{e['n']} x {e['k']}", str(e["count"])]
        cells += [f"{e['ms'][name][str(m)]:.3f} ({e['tb_per_s'][name][str(m)]:.2f})" for m in result["rows"]
                  for name in names]
        cells += [f"{e['error'][name]:.1e} ({'yes' if e['alone_equal'][name] else 'NO'})" for name in names]
        lines.append("| " + " | ".join(cells) + " |")
    cells = ["one step", str(sum(e["count"] for e in result["shapes"]))]
    cells += [f"{result['step_ms'][name][str(m)]:.2f}" for m in result["rows"] for name in names]
    lines.append("| " + " | ".join(cells + [""] * len(names)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    process_settings()  # before this process's engines (or the services it starts) run
    parser = argparse.ArgumentParser(prog="python -m bench.matmuls", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rows", default="1,16", help="row counts, comma-separated (default 1,16)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--against", type=Path, help="another checkout whose split_matmul runs side by side")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    split_matmul.require()
    rows = sorted({int(r) for r in args.rows.split(",")})
    result = measure(args.model, rows, args.repeats, load_against(args.against) if args.against else None)
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
