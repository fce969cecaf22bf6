"""Our stack against the reference, side by side in one run, on the same checkpoint, input and seed.

    python -m bench.rtf offline --model DIR [--reference-python .ref/bin/python] [--lengths 10,30,60]
                                [--repeat N] [--no-full-history] [--json]
    python -m bench.rtf online --model DIR [--reference-python ...] [--seconds 10] [--grpc]
                               [--service-flags NAME=FLAGS ...] [--service-env NAME=VAR=VALUE ...] [--mps]
                               [--grpc-only] [--send-ahead N] [--json]

offline: one turn over the bundled question padded with silence to each length. Ours runs the engines
in-process with persistent language caches; the reference runs its default full-history path (the language
model recomputed over the whole history at every position) and its cached path. Runs alternate between the two
stacks so machine noise falls on both. Prints seconds per turn, ms per frame, and ours/reference ratios; the
growth of cost with length shows linear (ours) against quadratic (the reference's default).

online: one streaming session over the same input pushed in 1280-sample frames as fast as it is taken: ours
pipelined and sequential (in-process, and over gRPC with --grpc) against the reference's streaming session.
The first --drop frames (cold: compilation, warm-up) are left out of the statistics, and ours completes them
before the timed frames are pushed, so every stage starts the timed frames together.
Rows: per-stage p50/p95, frame interval p50/p95, real-time factor, first-audio latency, peak memory, and the
ratio ours/reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.reference_driver import question_padded
from orchestrator.connect import parse_service_env, parse_service_flags, service_envs, service_flags
from orchestrator.local import local_clients
from orchestrator.timeline import run_offline
from services.common.loading import process_settings

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


def ours_online(model: Path, seconds: float, pipelined: bool, grpc: bool, drop: int,
                flags: dict[str, list[str]] | None = None, send_ahead: int = 2, mps: bool = False,
                envs: dict[str, dict[str, str]] | None = None) -> dict:
    import resource

    import mlx.core as mx

    from orchestrator.launcher import grpc_target, launched
    from orchestrator.session import OnlineSession, transcript_vocabulary
    from orchestrator.stream_clients import connect_streams, grpc_stream_clients
    from orchestrator.text import TextDecoder
    from services.common.config import VoiceChatConfig

    config = VoiceChatConfig.load(model)
    audio = question_padded(seconds)
    first: list[float] = []
    start = time.perf_counter()

    def on_event(event) -> None:  # the moment the first audio frame exists, whoever collects it later
        if event.kind == "audio" and not first:
            first.append((time.perf_counter() - start) * 1000.0)

    def run(clients) -> OnlineSession:
        nonlocal start
        session = OnlineSession(clients, config, TextDecoder(model, config), seed=0, pipelined=pipelined,
                                send_ahead=send_ahead, profile=True, on_event=on_event,
                                rnnt_vocabulary=transcript_vocabulary(model, config))
        with session:
            start = time.perf_counter()
            for offset in range(0, len(audio), 1280):
                if offset == drop * 1280:
                    # the cold frames through every stage first: pipelined, a stage left waiting on another's
                    # one-time work (compilation, the speech warm-up) would otherwise run far ahead of it, and
                    # the timed frames would show only how fast the stages behind drain
                    session.drain()
                session.push_audio(audio[offset : offset + 1280], 16_000)
            session.flush(pad_partial=True)
        return session

    services = None
    if grpc:  # the four services as child processes, so their memory can be read before they stop
        with launched(model, flags=flags, mps=mps, envs=envs) as children:
            clients = grpc_stream_clients({name: grpc_target(group) for name, group in children.items()})
            try:
                session = run(clients)
            finally:
                clients.close()
            services = {name: service_memory(child.process.pid) for name, (child,) in children.items()}
    else:
        with connect_streams(model, in_process=True) as clients:
            session = run(clients)
    return {
        "summary": session.profile.summary(drop_first=drop),
        "first_audio_ms": first[0] if first else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if not grpc else None,
        "peak_device_mb": mx.get_peak_memory() / 2**20 if not grpc else None,
        "services": services,
    }


def service_memory(pid: int) -> dict[str, float | None]:
    """A service process's peak resident memory (Linux /proc) and its GPU memory now (nvidia-smi, when present)."""
    rss = None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                rss = int(line.split()[1]) / 1024
    except OSError:
        pass
    device = None
    try:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        listing = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
        for row in listing.splitlines():
            owner, _, used = row.partition(",")
            if owner.strip() == str(pid):
                device = float(used)
    except (OSError, subprocess.SubprocessError):
        pass
    return {"peak_rss_mb": rss, "device_mb": device}


def reference_online(python: Path, model: Path, seconds: float, drop: int) -> dict:
    command = [str(python), str(ROOT / "bench" / "reference_driver.py"), "online", "--model", str(model),
               "--seconds", str(seconds), "--drop", str(drop)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class GrpcRun:
    """Ours over gRPC child services too: their extra flags and environment variables, under an MPS daemon or
    not, and (`only`) without the in-process runs."""

    flags: dict[str, list[str]] = field(default_factory=dict)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)
    mps: bool = False
    only: bool = False


def online_rows(model: Path, python: Path | None, seconds: float, drop: int, grpc: GrpcRun | None = None,
                send_ahead: int = 2) -> dict[str, dict]:
    """Each stack run once, in its own process for the reference and in this one (or over gRPC) for ours, after
    a short warm-up session in the same process (kernels compile on first use, on a GPU for seconds)."""
    runs = {}
    if grpc is None or not grpc.only:
        ours_online(model, 1.0, True, False, 0)
        runs = {"ours pipelined": ours_online(model, seconds, True, False, drop, send_ahead=send_ahead),
                "ours sequential": ours_online(model, seconds, False, False, drop)}
    if grpc is not None:
        runs["ours pipelined gRPC"] = ours_online(model, seconds, True, True, drop, grpc.flags, send_ahead,
                                                  grpc.mps, grpc.envs)
    if python is not None:
        runs["reference"] = reference_online(python, model, seconds, drop)
    return runs


def print_online(runs: dict[str, dict]) -> None:
    names = list(runs)
    reference = runs.get("reference")

    def row(label: str, pick) -> None:
        values = [pick(runs[n]) for n in names]
        cells = " ".join(f"{v:>20.2f}" if isinstance(v, float) else f"{'-':>20}" for v in values)
        ratio = ""
        if reference is not None and isinstance(values[0], float) and isinstance(pick(reference), float):
            base = pick(reference)
            ratio = f"{values[0] / base:10.3f}" if base else ""
        print(f"{label:<24} {cells} {ratio}")

    print(f"{'':<24} " + " ".join(f"{n:>20}" for n in names) + (f" {'ours/ref':>10}" if reference else ""))
    stage_names = ("perception", "rnnt", "language", "tts", "codec")
    for stage in stage_names:
        for stat in ("p50_ms", "p95_ms"):
            row(f"{stage} {stat[:3]} ms", lambda r, s=stage, k=stat: r["summary"]["stages"].get(s, {}).get(k))
    for stat in ("p50_ms", "p95_ms"):
        row(f"frame interval {stat[:3]} ms", lambda r, k=stat: (r["summary"]["stages"].get("interval")
                                                              or r["summary"]["stages"]["total"])[k])
    row("real-time factor", lambda r: r["summary"]["realtime_factor"])
    row("first audio ms", lambda r: r["first_audio_ms"])
    row("peak RSS MB", lambda r: r["peak_rss_mb"])
    row("peak device MB", lambda r: r["peak_device_mb"])
    for name in ("perception", "llm", "tts", "codec"):
        for key, label in (("peak_rss_mb", "peak RSS MB"), ("device_mb", "device MB")):
            row(f"{name} {label}", lambda r, n=name, k=key: (r.get("services") or {}).get(n, {}).get(k))


def main(argv: list[str] | None = None) -> int:
    process_settings()  # before this process's engines (or the services it starts) run
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["offline", "online"])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--reference-python", type=Path,
                        default=DEFAULT_REFERENCE if DEFAULT_REFERENCE.exists() else None,
                        help="the reference's Python (default .ref/bin/python when present); omit to time ours only")
    parser.add_argument("--lengths", default="10,30,60", help="input lengths in seconds, comma separated")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-full-history", action="store_true", help="skip the reference's slow default path")
    parser.add_argument("--ours-only", action="store_true", help="time our stack only")
    parser.add_argument("--seconds", type=float, default=10.0, help="online: input length in seconds")
    parser.add_argument("--grpc", action="store_true", help="online: also run ours over gRPC child services")
    parser.add_argument("--drop", type=int, default=5, help="online: cold frames left out of the statistics")
    parser.add_argument("--service-flags", type=parse_service_flags, action="append", metavar="NAME=FLAGS",
                        help="online --grpc: extra flags for a service (NAME: perception, llm, tts, codec or all; "
                             "repeatable), e.g. --service-flags llm='--weights-dtype bfloat16 --float32-weights'")
    parser.add_argument("--service-env", type=parse_service_env, action="append", metavar="NAME=VAR=VALUE",
                        help="online --grpc: an environment variable for a service (NAME as for --service-flags; "
                             "repeatable), e.g. --service-env perception=MLX_USE_CUDA_GRAPHS=0")
    parser.add_argument("--mps", action="store_true",
                        help="online --grpc: the services share the GPU through an MPS daemon of their own")
    parser.add_argument("--grpc-only", action="store_true",
                        help="online --grpc: ours over gRPC only, without the in-process runs")
    parser.add_argument("--send-ahead", type=int, default=2,
                        help="online: frames a pipelined stage of ours may have sent and not yet answered (1: none "
                             "ahead, each request after the last answer)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    lengths = [float(x) for x in args.lengths.split(",") if x.strip()]
    python = None if args.ours_only else args.reference_python
    if args.mode == "online":
        if (args.service_flags or args.service_env or args.mps or args.grpc_only) and not args.grpc:
            parser.error("--service-flags, --service-env, --mps and --grpc-only are for the run over gRPC: add --grpc")
        grpc = GrpcRun(service_flags(args.service_flags), service_envs(args.service_env), args.mps,
                       args.grpc_only) if args.grpc else None
        runs = online_rows(args.model, python, args.seconds, args.drop, grpc, args.send_ahead)
        if args.json:
            print(json.dumps({"mode": "online", "runs": runs}, indent=2))
        else:
            print_online(runs)
        return 0
    rows = offline_table(args.model, python, lengths, args.repeat, not args.no_full_history)
    if args.json:
        print(json.dumps({"mode": "offline", "rows": rows}, indent=2))
    else:
        print_offline(rows)
    return 0


if __name__ == "__main__":
    from services.common.cli import exit_process

    exit_process(main())  # engines ran on their own threads: skip MLX's abort in interpreter teardown

