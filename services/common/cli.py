"""The command line shared by the services' `__main__`:

    python -m services.codec --model DIR [--host H] [--port N] [--max-message-mb M] [--drain-seconds S]
                             [--cache-limit-mb MB] [--memory-limit-mb MB] [--device-headroom-mb MB]
                             [--log-level L] [--metrics-port N] [--metrics-host H]

--model defaults to $VOICECHAT_MODEL, else the demo checkpoint (tiny, random weights; see orchestrator.model).
Once the model has loaded and health says SERVING, the process prints `listening on HOST:PORT` (flushed) to
stdout, so a parent that started it with --port 0 can parse the port.
With --metrics-port (default $VOICECHAT_METRICS_PORT) it serves Prometheus metrics from startup on and prints
`metrics on http://HOST:PORT/metrics` right after that line.

A service's __main__.py is then:

    def build(args: argparse.Namespace) -> ServiceSpec: ...
    if __name__ == "__main__":
        raise SystemExit(run_service(build, prog="services.codec", description="..."))
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import sys
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.batching import DEFAULT_GATHER_S, DEFAULT_MAX_BATCH
from services.common.device_memory import Headroom, process_pool, set_cache_limit
from services.common.errors import EXIT_BIND, EXIT_DEVICE_LOST, BindError, DeviceLost, out_of_memory
from services.common.loading import DEFAULT_MAX_CONTEXT, process_settings
from services.common.metrics import Metrics, MetricsServer, add_metrics_flags, start_from_args
from services.common.metrics import announce as announce_metrics
from services.common.server import DEFAULT_GRACE_S, DEFAULT_MAX_MESSAGE_MB, Registration, RunningServer, serve

MODEL_ENV = "VOICECHAT_MODEL"
PARENT_PID_ENV = "VOICECHAT_PARENT_PID"  # set by the orchestrator's launcher for the services it starts
# --cache-limit-mb shared: four services on one device, each with an eightieth of its memory for its buffer cache,
# at most 8 GiB (an H200's 141 GB: 1.8 GiB each; an 80 GB H100: 1.0 GiB). Each keeps a twentieth free for the
# others (--device-headroom-mb; an H100: 4.0 GiB). A cache is memory no other process can use, and on CUDA the
# driver's pool under it keeps what it frees anyway: on an H100, 40 conversations with 4 GiB caches ran speech out
# of memory 42 s in, and with 1 GiB ones held for 60 s.
SHARED = "shared"
SHARED_CACHE_SHARE = 80
SHARED_HEADROOM_SHARE = 20
SHARED_CACHE_CAP_MB = 8192
_PR_SET_PDEATHSIG = 1
READY_PREFIX = "listening on "  # what parse_ready_line looks for
DEFAULT_HOST = "127.0.0.1"  # a network service is internal: only the orchestrator's front doors face clients


@dataclass
class ServiceSpec:
    """What a service's build() hands the bootstrap: its servicers, their full names, the model loader, and the
    servicer's metrics (served by --metrics-port; the interceptor counts errors in them)."""

    registrations: list[Registration]
    service_names: list[str]
    load: Callable[[], Awaitable[None]] | None = None  # awaited while health says NOT_SERVING
    close: Callable[[], None] | None = None  # after shutdown, e.g. EngineThread.close
    metrics: Metrics | None = None


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The common flags; a service may add its own before parsing."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--model",
        type=Path,
        default=os.environ.get(MODEL_ENV) or None,
        help=f"checkpoint directory (config.json, model*.safetensors, ...); default ${MODEL_ENV}",
    )
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to bind (default {DEFAULT_HOST}: this machine only; 0.0.0.0 or [::] for "
                             "an orchestrator on another host)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default)")
    parser.add_argument(
        "--max-message-mb",
        type=float,
        default=DEFAULT_MAX_MESSAGE_MB,
        help=f"largest gRPC message sent or received, in MiB (default {DEFAULT_MAX_MESSAGE_MB})",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=DEFAULT_GRACE_S,
        help="on SIGTERM: health turns NOT_SERVING, new sessions are refused, and running ones get this many "
        f"seconds before they are cut (default {DEFAULT_GRACE_S:g})",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help="most sessions whose frame steps run together as one batched forward; steps that arrive while a "
        f"batch runs form the next one (default {DEFAULT_MAX_BATCH}; 1 runs every step alone)",
    )
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        default=DEFAULT_GATHER_S * 1000.0,
        help="when the engine is idle and fewer steps wait than sessions are open, wait at most this long for "
        f"them to join the batch (default {DEFAULT_GATHER_S * 1000.0:g}; 0 never waits; a lone session never waits)",
    )
    parser.add_argument(
        "--cohort-wait-ms",
        type=float,
        default=0.0,
        help="before a batch starts, wait at most this long for the sessions that stepped beside its sessions last "
        "time and have not sent their next step yet, so the frames that left the stage before together step "
        "together here too (default 0: off; a few ms more than the spread of their arrivals, e.g. 15)",
    )
    parser.add_argument(
        "--read-ahead",
        type=int,
        default=0,
        metavar="N",
        help="read and queue up to N requests of a stream beyond the step it waits for, so the next batch forms "
        "as the last one ends from the steps queued meanwhile, not after every stream has written its answer and "
        "read its next request (default 0: the next request is read once the last answer is written)",
    )
    parser.add_argument(
        "--precompile-batches",
        type=int,
        default=1,
        metavar="N",
        help="before health says SERVING, run throwaway steps at every batch size 1..N (at most --max-batch) so no "
        "client frame waits for a size's first compilation, which on a cold GPU outlasts the orchestrator's "
        "per-frame deadline (default 1: a lone conversation never compiles; 16 for 16 batched conversations; 0 "
        "compiles on first use)",
    )
    parser.add_argument(
        "--cache-limit-mb",
        type=cache_limit_mb,
        default=None,
        metavar="MB",
        help="keep at most this many MiB of freed device buffers for reuse (MLX's buffer cache; default MLX's own "
        f"limit). Batched steps grow the cache: several services sharing one GPU may need it bounded. '{SHARED}': "
        f"a 1/{SHARED_CACHE_SHARE} share of the device's memory, at most {SHARED_CACHE_CAP_MB} MiB (that much "
        "where the device's memory is not reported), what `orchestrator serve` gives each service it starts",
    )
    parser.add_argument(
        "--memory-limit-mb",
        type=float,
        default=None,
        metavar="MB",
        help="when the arrays in use pass this many MiB, an engine step waits for the device work already queued "
        "to finish (and free its temporary buffers) before queuing more (MLX's memory limit; default MLX's own, "
        "about the device's memory). Bounds a burst's peak on a GPU, where a step's temporaries otherwise live "
        "until its queued work completes; it is a guideline: a step that needs more still gets it",
    )
    parser.add_argument(
        "--device-headroom-mb",
        type=float,
        default=None,
        metavar="MB",
        help="keep this many MiB of the device free for its other processes: while the device's free memory is "
        "under it, this service hands back its buffer cache and what CUDA's memory pool holds for it (services.common."
        f"device_memory; default '{SHARED}': a 1/{SHARED_HEADROOM_SHARE} share of the device, at most "
        f"{SHARED_CACHE_CAP_MB} MiB; 0: off). Only where the device reports its free memory (CUDA GPUs)",
    )
    parser.add_argument(
        "--step-log",
        type=Path,
        default=None,
        metavar="PATH",
        help="append one JSON line per engine step to PATH: when its batch was formed, when the engine began and "
        "ended it (time.monotonic() seconds, one clock for a host's processes), and its size; to line the "
        "service's steps up with other services' and clients' (python -m bench.timeline)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default INFO); logs go to stderr",
    )
    add_metrics_flags(parser)
    return parser


def add_split_matmuls_flag(parser: argparse.ArgumentParser, needs: str = "") -> None:
    """`--split-matmuls`, for the services whose float32 frames meet dense bf16 weights (`split_matmul`)."""
    parser.add_argument(
        "--split-matmuls", action="store_true",
        help=f"CUDA GPU only, with dense bf16 projections{needs}: each frame's float32 activations meet the bf16 "
             "weights on the tensor cores, split into three bf16 parts whose exact products are summed in "
             "float32: float32's accuracy, the weights read once as bf16 (no float32 copies: with "
             "--float32-weights only the other arrays are widened)",
    )


def add_max_context_flag(parser: argparse.ArgumentParser, layers: str) -> None:
    """`--max-context`, for the services whose attention keys grow with a session (`services.common.cache.Bound`)."""
    parser.add_argument(
        "--max-context", type=int, default=DEFAULT_MAX_CONTEXT, metavar="N",
        help=f"attention positions a session keeps past its prompt in {layers} (one a frame: {DEFAULT_MAX_CONTEXT} "
             f"is {DEFAULT_MAX_CONTEXT * 0.08 / 60:.1f} minutes at 80 ms); a longer session keeps its prompt and its "
             f"last N positions, so its memory and per-frame cost stay flat (default {DEFAULT_MAX_CONTEXT}; 0 keeps "
             "every position: outputs as the reference's at any length, memory growing with the session)",
    )


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate the common flags (exits with a usage error naming the bad one)."""
    args = parser.parse_args(argv)
    if args.model is None:  # as the orchestrator: the demo checkpoint, with a note saying so
        from orchestrator.model import resolve_model

        args.model = resolve_model(None)
    if not args.model.is_dir():
        parser.error(f"--model {args.model}: no such directory")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be 0..65535")
    if args.max_message_mb <= 0:
        parser.error(f"--max-message-mb {args.max_message_mb}: must be positive")
    if args.drain_seconds < 0:
        parser.error(f"--drain-seconds {args.drain_seconds}: must be zero or more")
    if args.max_batch < 1:
        parser.error(f"--max-batch {args.max_batch}: must be at least 1")
    if args.precompile_batches < 0:
        parser.error(f"--precompile-batches {args.precompile_batches}: must be zero or more")
    if not 0 <= args.read_ahead <= 16:
        parser.error(f"--read-ahead {args.read_ahead}: must be 0..16")
    if not 0 <= args.batch_wait_ms < 1000:
        parser.error(f"--batch-wait-ms {args.batch_wait_ms}: must be at least 0 and under 1000")
    if not 0 <= args.cohort_wait_ms < 1000:
        parser.error(f"--cohort-wait-ms {args.cohort_wait_ms}: must be at least 0 and under 1000")
    if args.step_log is not None and not args.step_log.parent.is_dir():
        parser.error(f"--step-log {args.step_log}: no such directory {args.step_log.parent}")
    if getattr(args, "max_context", 0) < 0:
        parser.error(f"--max-context {args.max_context}: must be 0 (no bound) or more")
    if args.cache_limit_mb not in (None, SHARED) and not 0 <= args.cache_limit_mb < 2**40:
        parser.error(f"--cache-limit-mb {args.cache_limit_mb}: must be zero or more")
    if args.memory_limit_mb is not None and not 0 < args.memory_limit_mb < 2**40:
        parser.error(f"--memory-limit-mb {args.memory_limit_mb}: must be more than zero")
    if args.device_headroom_mb is not None and not 0 <= args.device_headroom_mb < 2**40:
        parser.error(f"--device-headroom-mb {args.device_headroom_mb}: must be zero or more")
    return args


def cache_limit_mb(text: str) -> float | str:
    """--cache-limit-mb's value: MiB, or SHARED."""
    return SHARED if text == SHARED else float(text)


def shared_cache_limit_mb(info: dict | None = None) -> float:
    """The buffer cache of one of several services sharing a device: a SHARED_CACHE_SHARE share of the memory
    MLX reports for it (`mx.device_info()`, or `info`), at most SHARED_CACHE_CAP_MB, which is also the limit
    where no memory size is reported (MLX on a CPU)."""
    return _device_share_mb(SHARED_CACHE_SHARE, info)


def shared_headroom_mb(info: dict | None = None) -> float:
    """What one of several services sharing a device keeps free for the others (--device-headroom-mb's default):
    a SHARED_HEADROOM_SHARE share of the device's memory, at most SHARED_CACHE_CAP_MB (see
    `shared_cache_limit_mb`)."""
    return _device_share_mb(SHARED_HEADROOM_SHARE, info)


def _device_share_mb(share: int, info: dict | None) -> float:
    """1/share of the memory MLX reports for the device (`info` when given), at most SHARED_CACHE_CAP_MB, which
    is also the answer where no size is reported."""
    if info is None:
        import mlx.core as mx

        try:
            info = mx.device_info()
        except RuntimeError:  # a backend that cannot say
            info = {}
    size = info.get("total_memory") or info.get("memory_size")
    if not isinstance(size, int) or size <= 0:
        return float(SHARED_CACHE_CAP_MB)
    return min(float(SHARED_CACHE_CAP_MB), size / share / (1 << 20))


def apply_cache_limit(limit_mb: float | str | None) -> None:
    """Bound MLX's buffer cache (--cache-limit-mb; SHARED: `shared_cache_limit_mb`); None leaves MLX's default."""
    if limit_mb is not None:
        if limit_mb == SHARED:
            limit_mb = shared_cache_limit_mb()
            logging.getLogger(__name__).info("buffer cache limit: %.0f MiB (a shared device's)", limit_mb)
        set_cache_limit(int(limit_mb * (1 << 20)))


def apply_memory_limit(limit_mb: float | None) -> None:
    """Set MLX's memory limit (--memory-limit-mb): past it, evaluation waits for queued device work to complete
    before queuing more, on every backend; None leaves MLX's default."""
    if limit_mb is not None:
        import mlx.core as mx

        mx.set_memory_limit(int(limit_mb * (1 << 20)))


def keep_device_headroom(headroom_mb: float | None) -> Headroom | None:
    """Start keeping `headroom_mb` (None: `shared_headroom_mb`; 0: none) of the device free for its other
    processes (`Headroom`: the buffer cache, under the limit set before it); None where there is nothing to
    keep."""
    if headroom_mb == 0:
        return None
    if headroom_mb is None:
        headroom_mb = shared_headroom_mb()
    return Headroom(headroom_mb, pool=process_pool()).start()


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def announce(running: RunningServer) -> None:
    """Print the ready line a parent process parses: `listening on HOST:PORT`."""
    print(f"{READY_PREFIX}{running.address}", flush=True)


def parse_ready_line(line: str) -> tuple[str, int] | None:
    """`"listening on [::]:50051"` -> ("[::]", 50051); None for any other line."""
    line = line.strip()
    if not line.startswith(READY_PREFIX):
        return None
    host, _, port = line[len(READY_PREFIX) :].rpartition(":")
    return (host, int(port)) if port.isdigit() else None


def exit_process(code: int) -> typing.NoReturn:
    """End a service process without running C++ static destructors.

    MLX's compiled activations, first traced on the engine thread, make the library abort during interpreter
    teardown (exit 134 after a clean shutdown). Everything that matters is done by now: flush and leave.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent() -> None:
    """A service started by the orchestrator ends when the orchestrator does, even if it is killed (Linux)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def run_service(
    build: Callable[[argparse.Namespace], ServiceSpec],
    *,
    prog: str,
    description: str,
    argv: Sequence[str] | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """Parse flags, build the service, serve until SIGTERM/SIGINT; returns the process exit code."""
    process_settings()
    die_with_parent()
    parser = build_parser(prog, description)
    if add_arguments is not None:
        add_arguments(parser)
    args = parse_args(parser, argv)
    configure_logging(args.log_level)
    apply_cache_limit(args.cache_limit_mb)
    apply_memory_limit(args.memory_limit_mb)
    headroom = keep_device_headroom(args.device_headroom_mb)
    spec: ServiceSpec | None = None
    exposition: MetricsServer | None = None
    try:
        spec = build(args)
        if args.metrics_port is not None and spec.metrics is None:
            raise ValueError(f"--metrics-port: {prog} has no metrics")
        if spec.metrics is not None:  # bound before the model loads: a busy port fails at once
            exposition = start_from_args(spec.metrics, args)

        def on_ready(running: RunningServer) -> None:
            announce(running)
            if exposition is not None:
                announce_metrics(exposition)

        asyncio.run(
            serve(
                spec.registrations,
                spec.service_names,
                host=args.host,
                port=args.port,
                max_message_mb=args.max_message_mb,
                grace_s=args.drain_seconds,
                load=spec.load,
                on_ready=on_ready,
                metrics=spec.metrics,
            )
        )
    except KeyboardInterrupt:
        return 130
    except BindError as exc:  # another process holds the port: say so, with the code that means it
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BIND
    except DeviceLost as exc:  # its work cannot go on in this process: the supervisor starts another
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        spec = None  # closing the engine would run on the failed device
        return EXIT_DEVICE_LOST
    except Exception as exc:  # cannot bind, bad checkpoint: one clear line; the traceback only at DEBUG
        logging.getLogger(prog).debug("startup failed", exc_info=True)
        detail = str(exc) if isinstance(exc, OSError | ValueError) else f"{type(exc).__name__}: {exc}"
        if out_of_memory(exc):
            detail = (f"the device ran out of memory while the service started ({detail}). Its weights and the "
                      "batch sizes it compiles must fit beside whatever else holds the device: compile fewer "
                      "sizes (--precompile-batches), batch fewer sessions (--max-batch), or give it a device with "
                      "more free memory")
        print(f"{prog}: error: {detail}", file=sys.stderr, flush=True)
        return 1
    finally:
        if exposition is not None:
            exposition.stop()
        if headroom is not None:
            headroom.stop()
        if spec is not None and spec.close is not None:
            spec.close()
    return 0
