"""One long conversation through `orchestrator serve` and its four gRPC services: whether per-frame cost and each
process's memory stay flat as the conversation ages.

    python -m bench.long_session --model DIR [--minutes 60] [--at 1,10,30,60] [--pace live|burst]
                                 [--mps] [--max-context N] [--service-flags NAME=FLAGS] [--serve-flags FLAGS]
                                 [--input WAV] [--latency-budget-ms MS] [--json]

The four services run as child processes (each with --metrics-port 0; --max-context N, when given, goes to the
language and speech services; --mps: they share the GPU through an MPS daemon), `orchestrator serve --services
...` over them, and one gRPC Converse conversation sends M minutes of the input looped, and 5 s more so that the
last sample sees the session open (bench.load's client), paced like a live microphone (`live`, the default) or
as fast as the server takes it (`burst`). When the conversation's audio passes each minute of --at, every
process's memory is sampled: its resident set (RSS, from the OS) and, for the services, MLX's active, cache and
peak bytes from its /metrics. Per minute of --at, over the minute of frames before it: the interval between
consecutive audio frames (p50/p95: the per-frame cost, what `burst` measures) and the duplex latency of
orchestrator/latency.py (p50/p95/max: how far behind a live microphone, what `live` measures; at `burst` the
audio runs ahead of that schedule, so the latency and deadline misses are not reported: "-" in the table, null in
the JSON), and the bytes of server messages the client received a frame (KB/frm: the text events' share stops
growing once a channel's text passes the server's --text-window; `--serve-flags "--text-window 0"` shows it
unbounded). Each row is also printed to stderr the moment it is taken, so a run stopped early (a time limit) still
shows the minutes it reached.

Flat means a row at minute 60 reads like the row at minute 10: no interval, latency or KB/frm growth, and no
memory growth once the attention caches reach their bound (a session's prompt plus --max-context positions; a
frame adds one position to the language model and one to the speech backbone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.load import EXAMPLE, FRAME_S, Outcome, conversations, grpc_conversation, orchestrator
from orchestrator.audio import read_audio
from orchestrator.latency import add_budget_flag, replay
from orchestrator.launcher import ServiceProcess, launched
from orchestrator.profile import percentile
from services.common.metrics import scrape

NETWORK = ("perception", "llm", "tts", "codec")
BOUNDED = ("llm", "tts")  # the services whose attention caches take --max-context
FRAMES_PER_MINUTE = round(60 / FRAME_S)
MLX_KINDS = ("active", "cache", "peak")
TAIL_S = 5.0  # audio past the last minute sampled
# the figures measured against the live microphone's schedule: meaningless, so not reported, unless pace is live
SCHEDULED = ("latency_p50_ms", "latency_p95_ms", "latency_max_ms", "deadline_misses")


@dataclass
class Memory:
    """One process's memory at a moment, bytes: rss from the OS; the MLX counters from a service's /metrics;
    the orchestrator's thread count (each thread may allocate from a malloc arena of its own)."""

    rss: float | None
    active: float | None = None
    cache: float | None = None
    peak: float | None = None
    threads: int | None = None


@dataclass
class Sample:
    """What was seen when the conversation's audio passed `minute`: frames answered by then, every process's
    memory, and the per-frame figures of the minute of frames before it (filled once the run is over)."""

    minute: float
    frames: int
    wall_s: float
    memory: dict[str, Memory]
    figures: dict[str, float | None] = field(default_factory=dict)


def _status_number(pid: int, key: str) -> float | None:
    """The first number of the `key:` line of a process's /proc status (Linux); None when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def thread_count(pid: int) -> int | None:
    """A process's threads (Linux /proc); None elsewhere."""
    threads = _status_number(pid, "Threads")
    return None if threads is None else int(threads)


def rss_bytes(pid: int) -> float | None:
    """A process's resident set in bytes (Linux /proc, else `ps`); None when it cannot be read."""
    kib = _status_number(pid, "VmRSS")
    if kib is not None:
        return kib * 1024
    try:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, check=True)
        return float(out.stdout.strip()) * 1024
    except (OSError, ValueError, subprocess.CalledProcessError):
        return None


def service_memory(name: str, child: ServiceProcess) -> Memory:
    """A service's RSS and its MLX counters (voicechat_memory_bytes{service, kind})."""
    samples = scrape(child.metrics_url) if child.metrics_url else {}
    mlx = {kind: samples.get(("voicechat_memory_bytes", frozenset({"service": name, "kind": kind}.items())))
           for kind in MLX_KINDS}
    return Memory(rss_bytes(child.process.pid), **mlx)


def window_figures(outcome: Outcome, end_frame: int, budget_s: float, pace: str) -> dict[str, float | None]:
    """Interval and latency figures (ms) of the minute of audio frames before `end_frame`; the SCHEDULED ones
    None unless `pace` is live."""
    _, timings = replay(outcome.first_sent, outcome.arrivals, FRAME_S, budget_s)
    start = max(end_frame - FRAMES_PER_MINUTE, 0)
    window = timings[start:end_frame]
    gaps = [t.gap_s * 1e3 for t in window if t.gap_s is not None]
    latencies = [t.latency_s * 1e3 for t in window]

    def pick(values: list[float], q: float) -> float | None:
        return percentile(values, q) if values else None

    before = outcome.bytes_at[start - 1] if start and len(outcome.bytes_at) >= start else 0
    received = outcome.bytes_at[end_frame - 1] - before if window and len(outcome.bytes_at) >= end_frame else None
    figures = {"frames": len(window), "interval_p50_ms": pick(gaps, 0.5), "interval_p95_ms": pick(gaps, 0.95),
               "latency_p50_ms": pick(latencies, 0.5), "latency_p95_ms": pick(latencies, 0.95),
               "latency_max_ms": max(latencies) if latencies else None,
               "deadline_misses": sum(t.late for t in window),
               "received_kb_per_frame": None if received is None else received / len(window) / 1e3}
    if pace != "live":
        figures.update(dict.fromkeys(SCHEDULED))
    return figures


async def converse(address: str, samples, pace: str, minutes: list[float], measure, budget_s: float,
                   progress=None) -> tuple[Outcome, list[Sample]]:
    """The conversation, and `measure()` (every process's memory) each time its answered frames pass a minute;
    each sample, its figures filled from the frames answered so far, goes to `progress(sample)` as it is taken."""
    # a few seconds past the last sample, so that it sees the session still open
    [talk] = conversations(samples, 1, max(minutes) * 60 + TAIL_S)
    outcome = Outcome("grpc")
    start = time.monotonic()
    task = asyncio.ensure_future(grpc_conversation(address, talk, pace=pace, outcome=outcome))
    taken: list[Sample] = []
    pending = sorted(minutes)
    while pending:
        due = round(pending[0] * FRAMES_PER_MINUTE)
        if outcome.frames >= due or task.done():
            memory = await asyncio.to_thread(measure)
            sample = Sample(pending.pop(0), outcome.frames, time.monotonic() - start, memory)
            sample.figures = window_figures(outcome, sample.frames, budget_s, pace)
            taken.append(sample)
            if progress is not None:
                progress(sample)
            continue
        await asyncio.sleep(0.05)
    return await task, taken


def run(model: Path, minutes: list[float], pace: str, flags: dict[str, list[str]], samples,
        budget_s: float, progress=None, mps: bool = False,
        serve_flags: list[str] | None = None) -> tuple[Outcome, list[Sample]]:
    """Start the services (sharing the GPU through an MPS daemon with `mps`) and the orchestrator (with
    `serve_flags` besides its own), hold the conversation, stop them all."""
    served: list[subprocess.Popen] = []
    service_flags = {name: ["--metrics-port", "0", *flags.get(name, [])] for name in NETWORK}
    with launched(model, NETWORK, service_flags, mps=mps) as children:
        services = {name: procs[0] for name, procs in children.items()}
        deadline = time.monotonic() + 10
        while not all(child.metrics_url for child in services.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        addresses = ",".join(f"{name}={child.address}" for name, child in services.items())
        seconds = max(minutes) * 60 + TAIL_S + 60

        def measure() -> dict[str, Memory]:
            memory = {name: service_memory(name, child) for name, child in services.items()}
            memory["orchestrator"] = Memory(rss_bytes(served[0].pid), threads=thread_count(served[0].pid))
            return memory

        with orchestrator(model, 1, ["--services", addresses, "--max-streaming-seconds", str(seconds),
                                     *(serve_flags or [])], served) as (address, _):
            outcome, taken = asyncio.run(converse(address, samples, pace, minutes, measure, budget_s, progress))
    return outcome, taken


HEADER = (f"{'minute':>6} {'frames':>7} {'wall s':>7} {'int p50':>8} {'int p95':>8} {'lat p50':>8} {'lat p95':>8} "
          f"{'lat max':>8} {'KB/frm':>8}   memory MB (rss / mlx active / mlx peak)")


def sample_row(s: Sample) -> str:
    f = s.figures
    cells = " ".join("       -" if f.get(k) is None else f"{f[k]:8.1f}" for k in
                     ("interval_p50_ms", "interval_p95_ms", "latency_p50_ms", "latency_p95_ms", "latency_max_ms",
                      "received_kb_per_frame"))
    memory = "  ".join(f"{name} {_mb(m.rss)}" + ("" if m.active is None else f"/{_mb(m.active)}/{_mb(m.peak)}")
                       + ("" if m.threads is None else f" ({m.threads} threads)") for name, m in s.memory.items())
    return f"{s.minute:6g} {s.frames:7d} {s.wall_s:7.1f} {cells}   {memory}"


def print_samples(taken: list[Sample]) -> None:
    print(HEADER)
    for s in taken:
        print(sample_row(s))


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_session", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--minutes", type=float, default=None,
                        help="audio in the conversation, minutes (default the last of --at)")
    parser.add_argument("--at", default="1,10,30,60", help="minutes at which to sample (default 1,10,30,60)")
    parser.add_argument("--pace", choices=["live", "burst"], default="live",
                        help="live microphone (default) or as fast as the server takes it")
    parser.add_argument("--max-context", type=int, default=None, metavar="N",
                        help="--max-context for the language and speech services (default theirs)")
    parser.add_argument("--service-flags", action="append", default=[], metavar="NAME=FLAGS",
                        help="extra flags for a service (NAME one of the four or all), repeatable")
    parser.add_argument("--serve-flags", default="", metavar="FLAGS",
                        help="extra flags for `orchestrator serve`, one string (e.g. \"--text-window 0\")")
    parser.add_argument("--input", type=Path, default=EXAMPLE, help="speech to loop (default the bundled question)")
    parser.add_argument("--mps", action="store_true",
                        help="the services share the GPU through a CUDA MPS daemon started for them (NVIDIA only)")
    add_budget_flag(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    from orchestrator.connect import parse_service_flags, service_flags

    try:
        at = sorted({float(m) for m in args.at.split(",") if m.strip()})
        flags = service_flags([parse_service_flags(text) for text in args.service_flags])
    except ValueError as exc:
        parser.error(f"--at / --service-flags: {exc}")
    minutes = args.minutes if args.minutes is not None else (at[-1] if at else 0)
    if not at or at[0] <= 0 or not minutes > 0:
        parser.error("--at needs positive minutes, and --minutes must be positive")
    at = [m for m in at if m <= minutes] or [minutes]
    if args.max_context is not None:
        if args.max_context < 0:
            parser.error(f"--max-context {args.max_context}: must be 0 (no bound) or more")
        for name in BOUNDED:
            flags[name] += ["--max-context", str(args.max_context)]
    samples = read_audio(args.input)
    at_end = at if at[-1] == minutes else [*at, minutes]
    # each row also goes to stderr when it is taken: a run cut short by a time limit keeps the rows it reached
    print(HEADER, file=sys.stderr, flush=True)
    outcome, taken = run(args.model, at_end, args.pace, flags, samples, args.latency_budget_s,
                         lambda sample: print(sample_row(sample), file=sys.stderr, flush=True), args.mps,
                         shlex.split(args.serve_flags))
    ok = outcome.done and not outcome.errors and not outcome.lost
    if args.json:
        print(json.dumps({"minutes": minutes, "pace": args.pace, "max_context": args.max_context,
                          "frames": outcome.frames, "done": outcome.done, "errors": outcome.errors,
                          "samples": [asdict(s) for s in taken]}, indent=2))
    else:
        print(f"{outcome.frames} frames ({minutes:g} min of audio, {args.pace}), errors {len(outcome.errors)}")
        print_samples(taken)
        for error in outcome.errors:
            print(f"error: {error}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
