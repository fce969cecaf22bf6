"""Our stack against the reference, side by side in one run, on the same checkpoint, input and seed.

    python -m bench.rtf offline --model DIR [--reference-python .ref/bin/python] [--lengths 10,30,60]
                                [--repeat N] [--no-full-history] [--json]

offline: one turn over the bundled question padded with silence to each length. Ours runs the engines
in-process with persistent language caches; the reference runs its default full-history path (the language
model recomputed over the whole history at every position) and its cached path. Runs alternate between the two
stacks so machine noise falls on both. Prints seconds per turn, ms per frame, and ours/reference ratios; the
growth of cost with length shows linear (ours) against quadratic (the reference's default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.reference_driver import question_padded
from orchestrator.clients import local_clients
from orchestrator.timeline import run_offline

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REFERENCE = ROOT / ".ref" / "bin" / "python"


def ours_offline(clients, seconds: float) -> tuple[float, int]:
    audio = question_padded(seconds)
    start = time.perf_counter()
    result = run_offline(clients, audio, seed=0)
    return time.perf_counter() - start, int(result.text_tokens.shape[0])


def reference_offline(python: Path, model: Path, seconds: float, cached: bool) -> tuple[float, int]:
    command = [str(python), str(ROOT / "bench" / "reference_driver.py"), "offline", "--model", str(model),
               "--seconds", str(seconds)] + (["--cached"] if cached else [])
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report["runs_s"][0], report["frames"]


def offline_table(model: Path, python: Path | None, lengths: list[float], repeat: int, full_history: bool) -> list:
    clients = local_clients(model)
    ours_offline(clients, 2.0)  # load and warm before timing
    rows = []
    for seconds in lengths:
        timings: dict[str, list[float]] = {"ours (cached)": []}
        if python is not None:
            timings["reference (cached)"] = []
            if full_history:
                timings["reference (full history)"] = []
        frames = 0
        for _ in range(repeat):  # alternate stacks so noise lands on both
            elapsed, frames = ours_offline(clients, seconds)
            timings["ours (cached)"].append(elapsed)
            if python is not None:
                timings["reference (cached)"].append(reference_offline(python, model, seconds, True)[0])
                if full_history:
                    timings["reference (full history)"].append(reference_offline(python, model, seconds, False)[0])
        for name, values in timings.items():
            rows.append({"input_s": seconds, "stack": name, "frames": frames, "turn_s": statistics.median(values),
                         "ms_per_frame": 1000.0 * statistics.median(values) / frames})
    return rows


def print_offline(rows: list) -> None:
    ours = {r["input_s"]: r["turn_s"] for r in rows if r["stack"].startswith("ours")}
    print(f"{'input':>7}  {'stack':<26} {'frames':>6} {'turn s':>9} {'ms/frame':>9} {'ours/this':>10}")
    for r in rows:
        ratio = ours[r["input_s"]] / r["turn_s"]
        print(f"{r['input_s']:6.0f}s  {r['stack']:<26} {r['frames']:6d} {r['turn_s']:9.2f} {r['ms_per_frame']:9.2f} "
              f"{ratio:10.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["offline"])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--reference-python", type=Path,
                        default=DEFAULT_REFERENCE if DEFAULT_REFERENCE.exists() else None,
                        help="the reference's Python (default .ref/bin/python when present); omit to time ours only")
    parser.add_argument("--lengths", default="10,30,60", help="input lengths in seconds, comma separated")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-full-history", action="store_true", help="skip the reference's slow default path")
    parser.add_argument("--ours-only", action="store_true", help="time our stack only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    lengths = [float(x) for x in args.lengths.split(",") if x.strip()]
    python = None if args.ours_only else args.reference_python
    rows = offline_table(args.model, python, lengths, args.repeat, not args.no_full_history)
    if args.json:
        print(json.dumps({"mode": "offline", "rows": rows}, indent=2))
    else:
        print_offline(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

