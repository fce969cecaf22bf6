"""Prometheus metrics of one process role (a network service or the orchestrator) and their HTTP exposition.

Every name carries a `service` label (perception, llm, tts, codec, orchestrator):

    voicechat_active_sessions{service}            gauge: open streaming sessions (conversations, orchestrator)
    voicechat_frames_total{service}               counter: frames processed
    voicechat_frame_seconds{service}              histogram: seconds per frame (FRAME_BUCKETS, around the budget)
    voicechat_frames_over_budget_total{service}   counter: frames whose seconds exceeded the frame budget (80 ms)
    voicechat_errors_total{service,code}          counter: errors by gRPC status code name (services) or by
                                                  conversation ERROR_CODE_* name / realtime error type (orchestrator)
    voicechat_batch_size{service}                 histogram: sessions per batched engine step (network services)
    voicechat_memory_bytes{service,kind}          gauge: MLX memory (network services): `active` in arrays,
                                                  `cache` freed but kept for reuse, `peak` active since start,
                                                  `limit` MLX's memory limit (--memory-limit-mb),
                                                  `cache_limit` the buffer cache's bound (on a shared GPU it
                                                  follows the device's free memory:
                                                  services.common.device_memory),
                                                  `pooled` freed into CUDA's memory pool, reserved for this
                                                  process and in no array (services.common.device_pool)
    voicechat_memory_trimmed_bytes_total{service} counter: pooled bytes handed back to the device while it was
                                                  short (network services on CUDA)
    voicechat_out_of_memory_steps_total{service,outcome}
                                                  counter: engine steps that ran the device out of memory
                                                  (network services): `recovered` when run once more after the
                                                  buffer cache went back, `failed` when that ran out too

The orchestrator's duplex latency, per audio frame sent to a client against a live microphone's schedule (the
definitions are in orchestrator/latency.py):

    voicechat_frame_latency_seconds{service}      histogram: frame i out - (first input audio in + i x 80 ms)
    voicechat_frame_gap_seconds{service}          histogram: time since the conversation's previous frame
    voicechat_frame_jitter_seconds{service}       histogram: |gap - 80 ms|; the mean is the RFC 3550-style jitter
    voicechat_deadline_misses_total{service}      counter: frames whose latency exceeded the latency budget (200 ms)
    voicechat_first_audio_seconds{service}        histogram: a conversation's first frame's latency
    voicechat_latency_trend_seconds{service}      histogram: per conversation at its end, the mean latency of its
                                                  last 5 s minus its first 5 s (growth: frames falling behind)

Each Metrics owns its own CollectorRegistry, so several servers in one test process do not collide:

    metrics = Metrics("codec", frame_budget_s=0.08)
    metrics.track_sessions(lambda: servicer.live_sessions)   # the gauge reads the count when scraped
    metrics.frame(0.012)                                     # one frame done in 12 ms
    metrics.error("INVALID_ARGUMENT")
    with metrics.serve(port=0, host="127.0.0.1") as server:  # GET http://127.0.0.1:PORT/metrics
        print(f"{METRICS_PREFIX}{server.url}")
"""

from __future__ import annotations

import argparse
import os
import socket
import socketserver
import threading
import urllib.request
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from services.common.errors import BindError

SERVICES = ("perception", "llm", "tts", "codec", "orchestrator")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
FRAME_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.16, 0.24, 0.32, 0.64, 1.28)
LATENCY_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 4.0, 8.0, 16.0)
JITTER_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
TREND_BUCKETS = (-1.0, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
DEFAULT_FRAME_BUDGET_S = 0.08  # the checkpoint's frame duration; the services set theirs from config.json
DEFAULT_LATENCY_BUDGET_S = 0.2  # a frame this far behind a live microphone is a deadline miss (orchestrator)
METRICS_PORT_ENV = "VOICECHAT_METRICS_PORT"
METRICS_PREFIX = "metrics on "  # the stdout line a started metrics server is announced with

_SERVICE_FRAME_HELP = ("Seconds one streaming step took in this service, from its request arriving to its response "
                       "being ready (engine queueing included)")
_ORCHESTRATOR_FRAME_HELP = (
    "Seconds per conversation frame: from the later of the previous frame's completion and this frame's audio "
    "arriving, to this frame's completion (the interval of `orchestrator stream --profile`; waiting for the "
    "client's audio is not counted). At or under the frame duration (80 ms) the conversation keeps up with real time"
)


def _summed(counts: list[Callable[[], int]]) -> Callable[[], float]:
    """A gauge's reading: the sum of `counts` (added to later) at scrape time."""
    return lambda: float(sum(count() for count in counts))


class Metrics:
    """The metrics of one role, in a registry of their own; every method is safe from any thread."""

    def __init__(self, service: str, *, frame_budget_s: float = DEFAULT_FRAME_BUDGET_S,
                 latency_budget_s: float = DEFAULT_LATENCY_BUDGET_S) -> None:
        if service not in SERVICES:
            raise ValueError(f"unknown service {service!r}; expected one of {', '.join(SERVICES)}")
        if not frame_budget_s > 0:
            raise ValueError(f"frame_budget_s must be positive, got {frame_budget_s}")
        if not latency_budget_s > 0:
            raise ValueError(f"latency_budget_s must be positive, got {latency_budget_s}")
        self.service = service
        self.frame_budget_s = frame_budget_s
        self.latency_budget_s = latency_budget_s  # read by the front doors' LatencyTrackers (orchestrator)
        self.registry = CollectorRegistry()
        self._session_counts: list[Callable[[], int]] = []
        sessions = "conversations (gRPC Converse and /v1/realtime)" if service == "orchestrator" else "streams"
        self._active = Gauge("voicechat_active_sessions", f"Open streaming sessions: {sessions} holding a slot",
                             ["service"], registry=self.registry).labels(service)
        self._active.set_function(_summed(self._session_counts))
        self._frames = Counter("voicechat_frames", "Frames processed" + (
            ": frames whose events went out to a client" if service == "orchestrator" else ": streaming steps"),
            ["service"], registry=self.registry).labels(service)
        frame_help = _ORCHESTRATOR_FRAME_HELP if service == "orchestrator" else _SERVICE_FRAME_HELP
        self._seconds = Histogram("voicechat_frame_seconds", frame_help, ["service"], buckets=FRAME_BUCKETS,
                                  registry=self.registry).labels(service)
        self._over_budget = Counter("voicechat_frames_over_budget", "Frames whose voicechat_frame_seconds exceeded "
                                    "the frame budget (config.json frame_duration, 80 ms)",
                                    ["service"], registry=self.registry).labels(service)
        self._errors = Counter("voicechat_errors", "Errors sent to clients, by gRPC status code name (network "
                               "services) or conversation ERROR_CODE_* name and realtime error type (orchestrator)",
                               ["service", "code"], registry=self.registry)
        self._batch_size = None if service == "orchestrator" else Histogram(
            "voicechat_batch_size", "Sessions whose frame steps ran together in one batched engine step",
            ["service"], buckets=BATCH_BUCKETS, registry=self.registry).labels(service)
        self._latency = _DuplexLatency(self.registry) if service == "orchestrator" else None
        self._queued_counts: list[Callable[[], int]] = []
        if service == "orchestrator":
            Gauge("voicechat_queued_frames", "Frames of the gRPC conversations pushed into their sessions and not yet "
                  "sent: each conversation holds at most its bound (25 by default), then its audio waits; near the "
                  "bound a conversation, clients send ahead of real time or take their answers slowly", ["service"],
                  registry=self.registry).labels(service).set_function(_summed(self._queued_counts))
        if service != "orchestrator":
            memory = Gauge("voicechat_memory_bytes", "MLX memory of this process on its device: 'active' held "
                           "by arrays, 'cache' freed buffers kept for reuse, 'cache_limit' the cache's bound "
                           "(--cache-limit-mb; on a shared GPU it follows the device's free memory, "
                           "--device-headroom-mb), 'peak' the most ever active, 'limit' MLX's memory limit (past it "
                           "an evaluation waits for queued work; --memory-limit-mb), 'pooled' freed into CUDA's "
                           "memory pool, reserved for this process and in no array (read by the device headroom's "
                           "thread)", ["service", "kind"], registry=self.registry)
            for kind, read in _memory_readers().items():
                memory.labels(service, kind).set_function(read)
            self.registry.register(_OutOfMemorySteps(service))
            self.registry.register(_TrimmedBytes(service))

    def track_sessions(self, count: Callable[[], int]) -> None:
        """Add a live-session count (read at scrape time) to voicechat_active_sessions; the gauge is their sum."""
        self._session_counts.append(count)

    def track_queued(self, count: Callable[[], int]) -> None:
        """Add a count of frames pushed and not yet sent (read at scrape time) to voicechat_queued_frames."""
        self._queued_counts.append(count)


    def frame(self, seconds: float | None) -> None:
        """One frame processed in `seconds`. None counts a frame whose time is unknown without timing it."""
        self._frames.inc()
        if seconds is None:
            return
        self._seconds.observe(seconds)
        if seconds > self.frame_budget_s:
            self._over_budget.inc()

    def batch(self, size: int) -> None:
        """One batched engine step over `size` sessions (network services only)."""
        if self._batch_size is None:
            raise ValueError("the orchestrator runs no batched engine steps")
        self._batch_size.observe(size)

    def frame_latency(self, latency_s: float, gap_s: float | None, jitter_s: float | None, late: bool) -> None:
        """One audio frame sent to a client (orchestrator; a FrameTiming of orchestrator.latency): gap and jitter
        are None for a conversation's first frame, whose latency is also its first-audio latency."""
        self._duplex().frame(latency_s, gap_s, jitter_s, late)

    def latency_trend(self, trend_s: float) -> None:
        """One conversation's latency trend, at its end (orchestrator)."""
        self._duplex().trend.observe(trend_s)

    def _duplex(self) -> _DuplexLatency:
        if self._latency is None:
            raise ValueError("duplex latency is the orchestrator's (frames sent to clients)")
        return self._latency

    def error(self, code: str) -> None:
        """One error answered with `code` (e.g. "INVALID_ARGUMENT", "ERROR_CODE_SERVER_BUSY", "server_busy")."""
        self._errors.labels(self.service, code).inc()

    def value(self, name: str, **labels: str) -> float | None:
        """A sample's current value, e.g. value("voicechat_frames_total"); None when it does not exist (yet)."""
        return self.registry.get_sample_value(name, {"service": self.service, **labels})

    def serve(self, port: int, host: str) -> MetricsServer:
        """Expose the registry at http://HOST:PORT/metrics on a thread of its own (port 0 picks a free one)."""
        return MetricsServer(self.registry, port=port, host=host)


class _DuplexLatency:
    """The orchestrator's duplex latency series (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, help: str, buckets: tuple[float, ...]):
            return Histogram(name, help, ["service"], buckets=buckets, registry=registry).labels("orchestrator")

        self.latency = histogram("voicechat_frame_latency_seconds", "Seconds an audio frame went out behind a live "
                                 "microphone: frame i's send - (the conversation's first input audio + i x 80 ms)",
                                 LATENCY_BUCKETS)
        self.gap = histogram("voicechat_frame_gap_seconds", "Seconds between a conversation's consecutive audio "
                             "frames going out", FRAME_BUCKETS)
        self.jitter = histogram("voicechat_frame_jitter_seconds", "|gap - 80 ms| per audio frame: RFC 3550's "
                                "|D| against the live schedule; the mean is the jitter", JITTER_BUCKETS)
        self.first_audio = histogram("voicechat_first_audio_seconds", "Seconds from a conversation's first input "
                                     "audio arriving to its first audio frame going out", LATENCY_BUCKETS)
        self.trend = histogram("voicechat_latency_trend_seconds", "Per conversation at its end: mean frame latency "
                               "of its last 5 s minus its first 5 s (halves when shorter than 10 s)", TREND_BUCKETS)
        self.misses = Counter("voicechat_deadline_misses", "Audio frames whose voicechat_frame_latency_seconds "
                              "exceeded the latency budget (--latency-budget-ms, 200 ms)", ["service"],
                              registry=registry).labels("orchestrator")

    def frame(self, latency_s: float, gap_s: float | None, jitter_s: float | None, late: bool) -> None:
        self.latency.observe(latency_s)
        if gap_s is None:
            self.first_audio.observe(latency_s)
        else:
            self.gap.observe(gap_s)
            self.jitter.observe(jitter_s)
        if late:
            self.misses.inc()


def _memory_readers() -> dict[str, Callable[[], float]]:
    """kind -> a reader of MLX's memory counter, read when scraped (MLX is imported only by the services)."""
    import mlx.core as mx

    from services.common.device_memory import CACHE_LIMIT, POOL_BYTES

    def cache_limit() -> float:  # unset: MLX's default, which is its memory limit
        return float(mx.get_memory_limit() if CACHE_LIMIT["bytes"] is None else CACHE_LIMIT["bytes"])

    return {"active": lambda: float(mx.get_active_memory()), "cache": lambda: float(mx.get_cache_memory()),
            "peak": lambda: float(mx.get_peak_memory()), "limit": lambda: float(mx.get_memory_limit()),
            "cache_limit": cache_limit, "pooled": lambda: float(POOL_BYTES["pooled"])}


class _OutOfMemorySteps(Collector):
    """voicechat_out_of_memory_steps_total: the process's counts (`device_memory.OUT_OF_MEMORY_STEPS`) when
    scraped."""

    def __init__(self, service: str) -> None:
        self.service = service

    def collect(self):
        from services.common.device_memory import OUT_OF_MEMORY_STEPS

        family = CounterMetricFamily("voicechat_out_of_memory_steps", "Engine steps whose evaluation ran the "
                                     "device out of memory: 'recovered' completed when run once more after the "
                                     "buffer cache went back to the device, 'failed' ran out again (their calls "
                                     "answered RESOURCE_EXHAUSTED)", labels=["service", "outcome"])
        for outcome, count in OUT_OF_MEMORY_STEPS.items():
            family.add_metric([self.service, outcome], count)
        yield family


class _TrimmedBytes(Collector):
    """voicechat_memory_trimmed_bytes_total: the bytes the device headroom handed back from this process's CUDA
    memory pool (`device_memory.POOL_BYTES`) when scraped."""

    def __init__(self, service: str) -> None:
        self.service = service

    def collect(self):
        from services.common.device_memory import POOL_BYTES

        family = CounterMetricFamily("voicechat_memory_trimmed_bytes", "Bytes of device memory this process had "
                                     "freed into CUDA's memory pool, handed back to the device while it was short "
                                     "(--device-headroom-mb)", labels=["service"])
        family.add_metric([self.service], POOL_BYTES["trimmed"])
        yield family


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per scrape on stderr would drown the service's log


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves its host with socket.getfqdn, a reverse DNS lookup that can stall startup
        # on a host without DNS; the name is only used for SERVER_NAME, which the exposition does not read.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self.setup_environ()


class MetricsServer:
    """The Prometheus text exposition of `registry` over HTTP; binds at construction (BindError naming the address
    when it cannot), serves on a daemon thread until stop()."""

    def __init__(self, registry: CollectorRegistry, *, port: int, host: str) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port {port}: must be 0..65535")
        self.host = _bracket(host)
        bind = host.strip("[]") or "0.0.0.0"
        where = f"{self.host}:{port}"
        try:
            family = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        except socket.gaierror as exc:
            raise BindError(f"cannot serve metrics on {where}: {exc.strerror}") from exc
        server_class = type("MetricsHTTPServer", (_ThreadingServer,), {"address_family": family})
        try:
            self._server = make_server(bind, port, make_wsgi_app(registry), server_class, handler_class=_Handler)
        except OSError as exc:
            hint = " (is the port in use?)" if port else ""
            raise BindError(f"cannot serve metrics on {where}: {exc.strerror or exc}{hint}") from exc
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """http://HOST:PORT/metrics as bound, e.g. "http://[::]:9100/metrics"."""
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


Samples = dict[tuple[str, frozenset], float]


def parse_exposition(text: str) -> Samples:
    """Prometheus exposition text as {(sample name, frozenset of label items): value}."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str, timeout_s: float = 10.0) -> Samples:
    """GET one /metrics page and parse it as Prometheus does (`parse_exposition`)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse_exposition(response.read().decode())


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def announce(server: MetricsServer) -> None:
    """Print `metrics on http://HOST:PORT/metrics` (flushed), after the process's own ready line."""
    print(f"{METRICS_PREFIX}{server.url}", flush=True)


def parse_metrics_line(line: str) -> str | None:
    """`"metrics on http://127.0.0.1:9100/metrics"` -> "http://127.0.0.1:9100/metrics"; None for other lines."""
    line = line.strip()
    return line[len(METRICS_PREFIX) :] if line.startswith(METRICS_PREFIX + "http://") else None


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port 0..65535 (from the flag or ${METRICS_PORT_ENV})")
    return port


DEFAULT_METRICS_HOST = "127.0.0.1"  # metrics say much about the traffic: this machine only, unless told otherwise


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    """--metrics-port N (default $VOICECHAT_METRICS_PORT, else no metrics server) and --metrics-host H (default
    DEFAULT_METRICS_HOST, whatever address the server itself binds)."""
    parser.add_argument(
        "--metrics-port", type=_port, default=os.environ.get(METRICS_PORT_ENV) or None,
        help=f"serve Prometheus metrics at http://HOST:N/metrics; 0 picks a free port (default ${METRICS_PORT_ENV}, "
             "else no metrics server)")
    parser.add_argument("--metrics-host", default=DEFAULT_METRICS_HOST,
                        help=f"address the metrics server binds (default {DEFAULT_METRICS_HOST}: this machine only; "
                             "0.0.0.0 for a scraper on another host)")


def start_from_args(metrics: Metrics, args: argparse.Namespace) -> MetricsServer | None:
    """The metrics server `add_metrics_flags`' flags ask for (None without --metrics-port); BindError when the port
    cannot be bound."""
    if args.metrics_port is None:
        return None
    return metrics.serve(args.metrics_port, args.metrics_host)
