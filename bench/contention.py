"""Each engine's batched step alone, then beside the other engines stepping in processes of their own, as the
four services share one GPU.

    python -m bench.contention --model DIR [--engines perception,llm,tts,codec] [--beside NAME,...]
                               [--sessions 16] [--frames 25] [--warmup 5] [--mps] [--kernels] [--json]

For each engine of --engines, its step at --sessions sessions is timed alone (`bench.service NAME --no-grpc
--host-split`, in a process of its own), then again while the --beside engines (default: the other three) each
keep as many sessions stepping in a process of their own (`bench.service NAME --hold`). Both are split as
`--host-split` splits them: building the graph in Python, launching it, waiting for the device. An engine whose
wait grows beside the others is waiting for their kernels on a shared GPU; one whose Python or launch time grows
is short of host. With --kernels (a GPU host with PyTorch) every measured step's kernels are recorded too
(`bench.service --kernels`): the GPU time the engine's kernels take a step, alone and beside the others, and
their count; the recording itself costs host time, so the steps' wall times then read high. With --mps every
process shares the GPU through an MPS daemon of its own, as `orchestrator serve --mps` runs the services.

Every engine runs with the many-conversation configuration's flags and environment (`configuration`): the
language model in bf16 with float32 copies, perception and speech with float32 copies, every process with the
buffer cache and device headroom the services get on a shared device (`--cache-limit-mb shared
--device-headroom-mb shared`); on CUDA the language model's split matmuls and MLX's CUDA graphs off in perception
and speech; under MPS the clients other than perception below normal priority.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from bench.service import HOLDING, SERVICES
from services.common.loading import process_settings

READY_TIMEOUT_S = 900.0  # a holder's load, precompile and warm-up (minutes on a fresh GPU machine)
RUN_TIMEOUT_S = 900.0  # one measured run, its load included
TOP_KERNELS = 5  # with --kernels, the costliest kernels each measured run names (in --json's output)


class ContentionError(RuntimeError):
    """A measured run or a holder failed."""


def configuration(cuda: bool, mps: bool) -> tuple[dict[str, list[str]], dict[str, dict[str, str]]]:
    """({engine: bench.service flags}, {engine: environment}) of the many-conversation configuration (the
    README's `orchestrator serve` command and `bench/gpu_suite.sh`'s live step)."""
    flags = {"perception": ["--float32-weights"], "llm": ["--weights-dtype", "bfloat16", "--float32-weights"],
             "tts": ["--float32-weights"], "codec": []}
    for name in flags:  # as `orchestrator serve` starts each service on a shared device
        flags[name] += ["--cache-limit-mb", "shared", "--device-headroom-mb", "shared"]
    env: dict[str, dict[str, str]] = {name: {} for name in SERVICES}
    if cuda:
        flags["llm"].append("--split-matmuls")
        for name in ("perception", "tts"):
            env[name]["MLX_USE_CUDA_GRAPHS"] = "0"
    if mps:
        for name in ("llm", "tts", "codec"):
            env[name]["CUDA_MPS_CLIENT_PRIORITY"] = "1"
    return flags, env


def service_command(name: str, model: Path, sessions: int, frames: int, warmup: int, flags: list[str],
                    *extra: str) -> list[str]:
    return [sys.executable, "-m", "bench.service", name, "--model", str(model), "--sessions", str(sessions),
            "--frames", str(frames), "--warmup", str(warmup), "--no-grpc", *flags, *extra]


def measure(name: str, model: Path, sessions: int, frames: int, warmup: int, flags: list[str],
            env: dict[str, str], kernels: bool = False) -> dict:
    """One engine's step in a process of its own: p50 and p95, and the medians of `--host-split`; with
    `kernels`, its kernels' count and device time a step and the costliest (`bench.kernels.summary`)."""
    command = service_command(name, model, sessions, frames, warmup, flags, "--host-split", "--json",
                              *(["--kernels", str(TOP_KERNELS)] if kernels else []))
    try:
        done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ContentionError(f"{name}: the measured run took over {RUN_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise ContentionError(f"{name}: the measured run failed with exit code {done.returncode}: "
                              f"{_last_line(done.stderr)}")
    run = json.loads(done.stdout)["runs"][0]["in_process"]
    totals = {key: run["kernels"][key] for key in ("kernels_per_step", "kernel_ms", "busy_ms", "top")} \
        if kernels else {}
    return {"step_p50_ms": run["latency_p50_ms"], "step_p95_ms": run["latency_p95_ms"], **run["host_times"],
            **totals}


@contextlib.contextmanager
def holding(names: list[str], model: Path, sessions: int, frames: int, warmup: int,
            flags: dict[str, list[str]], env: dict[str, dict[str, str]],
            ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[None]:
    """The engines `names` each stepping `sessions` sessions in a process of its own (`bench.service --hold`)
    from the moment all of them are past their warm-up until the block ends; a holder that fails to start, or
    stops before the block ends, raises ContentionError naming it."""
    procs: list[tuple[str, subprocess.Popen, IO[str]]] = []
    try:
        for name in names:
            errors = tempfile.TemporaryFile("w+")
            command = service_command(name, model, sessions, frames, warmup, flags[name], "--hold")
            proc = subprocess.Popen(command, env={**os.environ, **env[name]}, stdout=subprocess.PIPE,
                                    stderr=errors, text=True)
            procs.append((name, proc, errors))
        for name, proc, errors in procs:
            _wait_holding(name, proc, errors, ready_timeout_s)
        yield
        for name, proc, errors in procs:
            if proc.poll() is not None:
                raise ContentionError(f"{name}: the holder stopped during the measurement (exit code "
                                      f"{proc.returncode}): {_last_line(_read(errors))}")
    finally:
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc, errors in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            errors.close()


def _wait_holding(name: str, proc: subprocess.Popen, errors: IO[str], timeout_s: float) -> None:
    """Read the holder's output until its HOLDING line; it is killed if that takes over timeout_s."""
    watchdog = threading.Timer(timeout_s, proc.kill)
    watchdog.start()
    try:
        for line in proc.stdout:
            if line.startswith(HOLDING):
                return
    finally:
        watchdog.cancel()
    proc.wait()
    raise ContentionError(f"{name}: the holder did not start stepping (exit code {proc.returncode}"
                          f"{f', killed after {timeout_s:.0f} s' if proc.returncode == -9 else ''}): "
                          f"{_last_line(_read(errors))}")


def _read(errors: IO[str]) -> str:
    errors.seek(0)
    return errors.read()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def run(model: Path, engines: list[str], beside: list[str] | None, sessions: int, frames: int, warmup: int,
        cuda: bool, mps: bool, kernels: bool = False) -> dict:
    """Each engine alone and beside the others; with `mps`, every process under one MPS daemon."""
    flags, env = configuration(cuda, mps)
    rows = []
    with _daemon(mps) as daemon_env:
        env = {name: {**daemon_env, **values} for name, values in env.items()}
        for name in engines:
            others = [other for other in (beside if beside is not None else SERVICES) if other != name]
            alone = measure(name, model, sessions, frames, warmup, flags[name], env[name], kernels)
            with holding(others, model, sessions, frames, warmup, flags, env):
                loaded = measure(name, model, sessions, frames, warmup, flags[name], env[name], kernels)
            rows.append({"engine": name, "beside": others, "alone": alone, "beside_others": loaded})
    return {"model": str(model), "sessions": sessions, "frames": frames, "mps": mps, "cuda": cuda,
            "kernels": kernels, "flags": flags, "engines": rows}


@contextlib.contextmanager
def _daemon(mps: bool) -> Iterator[dict[str, str]]:
    if not mps:
        yield {}
        return
    from orchestrator.mps import mps_daemon

    with mps_daemon() as env:
        yield env


def engine_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SERVICES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(SERVICES)}, got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    process_settings()  # before this process's engines (or the services it starts) run
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--engines", type=engine_list, default=list(SERVICES),
                        help="the engines measured, in turn (default all four)")
    parser.add_argument("--beside", type=engine_list,
                        help="the engines stepping beside each one measured (default the other three)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--frames", type=int, default=25,
                        help="steps timed per run; the holders replace their sessions every this many steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--mps", action="store_true",
                        help="every process under an MPS daemon of its own (an NVIDIA GPU's driver has it)")
    parser.add_argument("--kernels", action="store_true",
                        help="also record each measured step's kernels, timed on the device (needs PyTorch with "
                             "CUDA in this Python)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.frames < 1 or args.warmup < 0:
        parser.error("--sessions and --frames must be at least 1, --warmup at least 0")
    import mlx.core as mx

    from orchestrator.mps import MpsError

    try:
        report = run(args.model, args.engines, args.beside, args.sessions, args.frames, args.warmup,
                     mx.cuda.is_available(), args.mps, args.kernels)
    except (ContentionError, MpsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.sessions} sessions a step, {args.frames} steps after {args.warmup} warm-up"
          f"{', under MPS' if args.mps else ''} (ms: step p50 / p95, then the medians of building the graph, "
          "launching it, waiting for the device"
          f"{'; the kernels a step, their device time a step and the time one ran' if args.kernels else ''})")
    columns = ["Python", "launch", "device wait"] + (["kernels", "kernel ms", "busy ms"] if args.kernels else [])
    print("| engine | beside | alone | " + " | ".join(columns) + " | beside the others | " + " | ".join(columns)
          + " |")
    print("| --- | --- |" + " --- |" * (2 * len(columns) + 2))
    for row in report["engines"]:
        cells = []
        for side in (row["alone"], row["beside_others"]):
            cells += [f"{side['step_p50_ms']:.2f} / {side['step_p95_ms']:.2f}", f"{side['python_ms']:.2f}",
                      f"{side['launch_ms']:.2f}", f"{side['wait_ms']:.2f}"]
            if args.kernels:
                cells += [f"{side['kernels_per_step']:.0f}", f"{side['kernel_ms']:.2f}", f"{side['busy_ms']:.2f}"]
        print(f"| {row['engine']} | {', '.join(row['beside']) or '-'} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
