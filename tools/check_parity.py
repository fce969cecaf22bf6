"""Check that this stack answers an input file exactly as the reference implementation does, on any checkpoint.

    python -m tools.check_parity --model DIR INPUT [INPUT ...] [--mode offline|stream|both] [--seed N] [-p TEXT]
        [--extra-decoding-seconds S] [--service-flags NAME=FLAGS ...] [--reference-model DIR]
        [--reference-python .ref/bin/python] [--json]

Runs the turn with our orchestrator (`offline` or `stream`; engines in-process, or with `--service-flags` the
four services as child processes started with those flags, so a service option such as `llm=--float32-weights`
is checked too) and with the reference (on `--reference-model`, default the same checkpoint: the dequantized copy
`tools/dequantize_checkpoint.py` writes is the reference for `llm=--weights-dtype=bfloat16`)
(`tools/reference_turn.py` under the reference's own Python: `python3 -m venv .ref && .ref/bin/pip install
mlx-vlm==0.7.10 mlx-audio==0.6.2`), one after the other, and prints a table per mode: the text and function ids
and the speech codes must be equal, the user transcript, the assistant text and the function text too, and the
speech samples within 1e-4 (`--json`: one JSON object instead). Exit status 0 when every turn is, 1 when one
is not (its first differing frame is named), 2 when a run fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REFERENCE = ROOT / ".ref" / "bin" / "python"
AUDIO_TOLERANCE = 1e-4  # the float tolerance the parity tests hold the decoded speech to
IDS = (("text ids", "text_tokens"), ("function ids", "function_tokens"), ("speech codes", "audio_codes"))
TEXTS = (("user transcript", "transcript"), ("assistant text", "text"), ("function text", "function_text"))


class RunFailed(RuntimeError):
    pass


@dataclass
class Row:
    what: str
    ours: str
    reference: str
    verdict: str
    equal: bool


def _shape(a: np.ndarray) -> str:
    return " x ".join(str(n) for n in a.shape)


def _quote(text: str, width: int = 28) -> str:
    text = json.dumps(text, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 4] + '..."'


def compare(ours: dict, reference: dict) -> list[Row]:
    """Rows of the comparison of two turns: arrays under the IDS keys and "audio", strings under TEXTS."""
    rows = []
    for what, key in IDS:
        a, b = np.asarray(ours[key]), np.asarray(reference[key])
        if a.shape == b.shape and np.array_equal(a, b):
            verdict, equal = "equal", True
        elif a.shape[1:] != b.shape[1:]:
            verdict, equal = "different shapes", False
        else:
            common = min(len(a), len(b))
            differ = np.nonzero((a[:common] != b[:common]).reshape(common, -1).any(axis=1))[0]
            first = int(differ[0]) if len(differ) else common
            verdict, equal = f"differ from frame {first}", False
        rows.append(Row(what, _shape(a), _shape(b), verdict, equal))
    for what, key in TEXTS:
        equal = ours[key] == reference[key]
        rows.append(Row(what, _quote(ours[key]), _quote(reference[key]), "equal" if equal else "differ", equal))
    a, b = np.asarray(ours["audio"], np.float32).reshape(-1), np.asarray(reference["audio"], np.float32).reshape(-1)
    if a.shape != b.shape:
        rows.append(Row("speech samples", str(len(a)), str(len(b)), "different lengths", False))
    else:
        diff = float(np.abs(a - b).max()) if len(a) else 0.0
        rows.append(Row("speech samples", str(len(a)), str(len(b)), f"max |diff| {diff:.2e}",
                        diff <= AUDIO_TOLERANCE))
    return rows


def table(title: str, rows: list[Row]) -> str:
    head = ("", "ours", "reference", "")
    cells = [head] + [(r.what, r.ours, r.reference, r.verdict) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = [title] + [("  " + "  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3]).rstrip()
                       for c in cells]
    return "\n".join(lines)


def _load(path: Path) -> dict:
    data = np.load(path)
    turn = {key: data[key] for key in ("text_tokens", "function_tokens", "audio_codes", "audio")}
    meta = json.loads(str(data["meta"]))
    turn.update({key: meta[key] for _, key in TEXTS})
    return turn


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise RunFailed(f"{what} failed (exit {done.returncode}): {last[0]}")


def ours(mode: str, source: Path, args: argparse.Namespace, folder: Path) -> dict:
    dump = folder / f"ours-{mode}.npz"
    command = [sys.executable, "-m", "orchestrator.cli", mode, str(source), "--model", str(args.model),
               "--seed", str(args.seed), "--extra-decoding-seconds", str(args.extra_decoding_seconds),
               "--output-audio", str(folder / f"ours-{mode}.wav"), "--dump", str(dump), "--force"]
    for flags in args.service_flags:
        command += ["--service-flags", flags]
    if not args.service_flags:
        command.append("--in-process")
    if args.system_prompt is not None:  # one argument, so a prompt may start with "-"
        command.append(f"--system-prompt={args.system_prompt}")
    _run(command, f"our {mode} turn")
    return _load(dump)


def reference(mode: str, source: Path, args: argparse.Namespace, folder: Path) -> dict:
    out = folder / f"reference-{mode}.npz"
    command = [str(args.reference_python), str(ROOT / "tools" / "reference_turn.py"), mode, "--model",
               str(args.reference_model or args.model), "--input", str(source), "--out", str(out),
               "--seed", str(args.seed), "--extra-decoding-seconds", str(args.extra_decoding_seconds)]
    if args.system_prompt is not None:
        command.append(f"--system-prompt={args.system_prompt}")
    _run(command, f"the reference's {mode} turn")
    return _load(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.check_parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", type=Path, nargs="+", metavar="input", help="audio files (any rate, mono or stereo)")
    parser.add_argument("--model", type=Path, required=True, help="converted checkpoint folder")
    parser.add_argument("--mode", choices=["offline", "stream", "both"], default="offline")
    parser.add_argument("--seed", type=int, default=0, help="speech sampling seed (default 0)")
    parser.add_argument("-p", "--system-prompt", default=None,
                        help="system prompt (default: the checkpoint's, as both implementations default)")
    parser.add_argument("--extra-decoding-seconds", type=float, default=3.0)
    parser.add_argument("--service-flags", action="append", default=[], metavar="NAME=FLAGS",
                        help="start our four services with these flags (NAME one of perception, llm, tts, codec or "
                             "all; repeatable) instead of running the engines in-process")
    parser.add_argument("--reference-model", type=Path, default=None,
                        help="the checkpoint the reference runs (default --model)")
    parser.add_argument("--reference-python", type=Path, default=DEFAULT_REFERENCE,
                        help=f"the reference's Python (default {DEFAULT_REFERENCE.relative_to(ROOT)})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args(argv)
    if not args.reference_python.exists():
        parser.error(f"--reference-python {args.reference_python}: no such file; install the reference with "
                     "python3 -m venv .ref && .ref/bin/pip install mlx-vlm==0.7.10 mlx-audio==0.6.2")
    named = [(path, "input") for path in args.inputs] + [(args.model, "--model"),
                                                          (args.reference_model, "--reference-model")]
    for path, what in named:
        if path is not None and not path.exists():
            parser.error(f"{what} {path}: no such file or folder")
    modes = ["offline", "stream"] if args.mode == "both" else [args.mode]
    turns = []
    with tempfile.TemporaryDirectory(prefix="check-parity-") as tmp:
        for source in args.inputs:
            for mode in modes:
                try:
                    mine, theirs = ours(mode, source, args, Path(tmp)), reference(mode, source, args, Path(tmp))
                except RunFailed as exc:
                    print(f"error: {source}: {exc}", file=sys.stderr)
                    return 2
                rows = compare(mine, theirs)
                same = all(r.equal for r in rows)
                frames = len(mine["text_tokens"])
                turns.append({"input": str(source), "mode": mode, "seed": args.seed, "frames": frames,
                              "identical": same, "rows": [dataclasses.asdict(r) for r in rows]})
                if not args.json:
                    print(table(f"{mode} turn on {source} (seed {args.seed}, {frames} frames):", rows))
                    print(f"  {'identical to the reference' if same else 'NOT identical to the reference'}\n")
    identical = all(turn["identical"] for turn in turns)
    if args.json:
        print(json.dumps({"identical": identical, "turns": turns}, ensure_ascii=False))
    elif len(turns) > 1:
        print(f"{sum(turn['identical'] for turn in turns)} of {len(turns)} turns identical to the reference")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
