"""Memory of one offline turn against the length of its input: does anything grow with the turn?

    python -m bench.offline_memory --model DIR [--minutes 1,5,20] [--json]

For each length, the bundled question repeated to that many minutes is written to a temporary WAV and
`orchestrator offline` runs on it, starting the four services as its children (as a user runs it). While it
runs, the peak resident memory (VmHWM) of the orchestrator and of each service process is read from /proc;
printed per length in MB, with the turn's wall seconds. Flat columns mean memory does not grow with the input.
Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ROOT / "examples" / "question.wav"
ROLES = ("orchestrator", "perception", "llm", "tts", "codec")


def long_input(minutes: float, folder: Path) -> Path:
    """The question repeated to `minutes` minutes (16-bit WAV at its own rate)."""
    samples, rate = sf.read(QUESTION, dtype="int16")
    total = round(minutes * 60 * rate)
    path = folder / f"input-{minutes:g}min.wav"
    sf.write(path, np.resize(samples, total), rate, subtype="PCM_16")
    return path


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM of `pid` in MB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def role_of(pid: int) -> str | None:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    return next((name for name in ROLES[1:] if f"services.{name} " in command), None)


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def measure(model: str, minutes: float, folder: Path) -> dict:
    """One turn over `minutes` of input: its wall seconds, exit code and each process's peak RSS (MB)."""
    wav = long_input(minutes, folder)
    out = folder / f"answer-{minutes:g}min.wav"
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "offline", str(wav), "--model", model,
                                "--output-audio", str(out), "--force", "--json"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[str, float] = {}
    while process.poll() is None:
        for pid, role in [(process.pid, "orchestrator"), *((c, role_of(c)) for c in children(process.pid))]:
            value = peak_rss_mb(pid) if role else None
            if value is not None:
                peaks[role] = max(peaks.get(role, 0.0), value)
        time.sleep(0.2)
    stdout, stderr = process.communicate()
    row = {"minutes": minutes, "seconds": round(time.monotonic() - start, 1), "exit": process.returncode,
           "peak_rss_mb": {role: round(peaks[role], 1) for role in ROLES if role in peaks}}
    if process.returncode:
        row["error"] = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    else:
        row["answer_seconds"] = round(sf.info(out).duration, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.offline_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--minutes", default="1,5,20", help="input lengths in minutes (default 1,5,20)")
    parser.add_argument("--json", action="store_true", help="one JSON object per length")
    args = parser.parse_args(argv)
    lengths = [float(m) for m in args.minutes.split(",")]
    if not Path("/proc/self/status").exists():
        parser.error("reads peak memory from /proc: Linux only")
    if not args.json:
        print(f"{'minutes':>7} {'seconds':>8} " + " ".join(f"{role:>12}" for role in ROLES) + "   (peak RSS, MB)")
    with tempfile.TemporaryDirectory(prefix="offline-memory-") as folder:
        for minutes in lengths:
            row = measure(args.model, minutes, Path(folder))
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            peaks = row["peak_rss_mb"]
            print(f"{minutes:>7g} {row['seconds']:>8.1f} "
                  + " ".join(f"{peaks.get(role, float('nan')):>12.1f}" for role in ROLES)
                  + (f"   failed: {row['error']}" if row["exit"] else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
