"""Hold K concurrent conversations against a running orchestrator and report what the clients saw.

    python -m bench.load --model DIR [--grpc K] [--ws K] [--seconds S] [--duration T] [--pace live|burst]
                         [--address HOST:PORT] [--realtime URL] [--input WAV] [--timeline PATH]
                         [--latency-budget-ms MS] [--memory] [--service-metrics NAME=URL ...]
                         [--serve-flags FLAGS] [--orchestrators K[,K...]] [--repeat N] [--json]

Without --address / --realtime, `orchestrator serve` is started on DIR (with its four services) for the run and
stopped after; with --orchestrators K, the four services are started once and K `orchestrator serve --services`
processes over them, the conversations dealt over the K in turn (one Python process's share of the frames each);
`--orchestrators 4,8` runs the load with 4, then with 8, on the same services. Each conversation sends S seconds of
speech (the input looped, each conversation from its own offset and with its own seed) as 80 ms PCM16 chunks,
through the gRPC Converse stream or the /v1/realtime WebSocket, paced like a live microphone (`live`, the default)
or as fast as the server takes it (`burst`), then flushes. No conversation sends past --duration seconds after its
start (a bounded run).

Reported per transport: conversations, frames delivered, frames per second over the run, the interval (inter-frame
gap) between a conversation's consecutive audio frames (p50/p95), errors, lost frames (frames sent but never
answered), and the duplex latency of orchestrator/latency.py: per-frame latency (audio frame i received - (the first
chunk sent + i x 80 ms), p50/p95/max), jitter (mean |gap - 80 ms|), deadline misses (frames later than
--latency-budget-ms, 200), first-audio latency (frame 0's, p50/p95) and the trend (mean latency of a conversation's
last 5 s minus its first 5 s; the conversations' mean and largest). `--timeline PATH` also writes
when each conversation sent its first chunk and received each audio frame (seconds from the run's start, JSON,
with the start's `time.monotonic()`), to line up with the services' `--step-log` (`python -m bench.timeline`).

Memory: `--memory` starts the orchestrator's services with metrics on free ports and reports each service's MLX
memory (`voicechat_memory_bytes`, MiB) before the run and after it (every conversation closed): `active` (arrays
held: back at its level before once the conversations closed), `cache` (freed buffers kept, at most the
service's --cache-limit-mb) and `peak` (the most ever active in the process); read every `--memory-every`
seconds (1) during the run too: the most `active`, `cache` and `pooled` (device memory freed into CUDA's pool, held
by the process outside its arrays) and the least `cache_limit` (where the device headroom squeezed the buffer
cache; `--json` keeps every reading). `--service-metrics NAME=URL` names
the /metrics of a running orchestrator's services instead. `--serve-flags` passes flags to the orchestrator this
starts (e.g. "--service-flags all=--precompile-batches=32"); `--repeat N` runs the same load N times on one
server, each reported, so a second burst's memory shows beside the first's:

    python -m bench.load --model DIR --grpc 32 --ws 0 --pace burst --memory --repeat 2

CPU: when it starts the orchestrator, a run also reports the orchestrator process's own CPU over the run (its
/proc/PID/stat utime + stime, its services not included): seconds, and milliseconds per audio frame delivered
(`orchestrator_cpu` in --json).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from bench.transport import cpu_seconds
from orchestrator.audio import read_audio, to_pcm16
from orchestrator.latency import DEFAULT_BUDGET_S, add_budget_flag, replay, summarize
from orchestrator.profile import percentile
from protos.voicechat.v1 import conversation_pb2 as pb
from protos.voicechat.v1 import conversation_pb2_grpc
from services.common.cli import parse_ready_line
from services.common.metrics import scrape
from services.common.tensors import from_proto_np

FRAME = 1280  # samples per 80 ms frame at 16 kHz
FRAME_S = 0.08
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "question.wav"


@dataclass(frozen=True)
class Conversation:
    samples: np.ndarray  # float32, 16 kHz
    seed: int
    system_prompt: str = ""  # empty: the checkpoint's default

    def pcm16(self) -> bytes:
        """The samples as the PCM16 the server decodes by / 32768 (the input file's own values)."""
        return to_pcm16(self.samples, 32768.0).astype("<i2").tobytes()


@dataclass
class Outcome:
    """What one conversation's client received; `signature()` is what must not depend on load or transport."""

    transport: str
    frames_sent: int = 0
    frames: int = 0  # audio frames received
    done: bool = False
    transcript: str = ""
    text_ids: list[int] = field(default_factory=list)
    function_ids: list[int] = field(default_factory=list)
    codes: list[tuple[int, ...]] = field(default_factory=list)
    audio: bytearray = field(default_factory=bytearray)  # PCM16 little-endian at 22.05 kHz
    errors: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each audio frame
    received_bytes: int = 0  # every server message's size so far: protobuf bytes, or a WebSocket message's length
    bytes_at: list[int] = field(default_factory=list)  # received_bytes as each audio frame arrived (its own included)
    first_sent: float | None = None  # monotonic time the first audio chunk went out

    @property
    def lost(self) -> int:
        return max(self.frames_sent - self.frames, 0)

    def signature(self) -> tuple:
        return (self.frames, self.done, self.transcript, tuple(self.text_ids), tuple(self.function_ids),
                tuple(self.codes), bytes(self.audio))

    def add_audio(self, codes, pcm16: bytes, now: float) -> None:
        self.frames += 1
        self.codes.append(tuple(int(c) for c in codes))
        self.audio += pcm16
        self.arrivals.append(now)
        self.bytes_at.append(self.received_bytes)


def conversations(samples: np.ndarray, count: int, seconds: float, system_prompt: str = "") -> list[Conversation]:
    """`count` conversations of `seconds` each: the input looped, each from its own offset, with its own seed,
    all opened with `system_prompt`."""
    length = int(round(seconds * 16_000))
    reps = math.ceil((length + FRAME * 3 * count) / max(len(samples), 1))
    looped = np.tile(samples.astype(np.float32), reps)
    return [Conversation(looped[FRAME * 3 * k : FRAME * 3 * k + length].copy(), seed=k, system_prompt=system_prompt)
            for k in range(count)]


def intervals_ms(arrivals: list[list[float]], settle_frames: int = 0) -> list[float]:
    """Each conversation's intervals between consecutive audio frames (arrival times in seconds), in ms, its
    first `settle_frames` frames left out."""
    return [(b - a) * 1000.0 for times in arrivals
            for a, b in zip(times[settle_frames:], times[settle_frames + 1 :], strict=False)]


def _chunks(data: bytes) -> Iterator[bytes]:
    step = FRAME * 2
    for start in range(0, len(data), step):
        yield data[start : start + step]


async def _paced(data: bytes, pace: str, duration_s: float, outcome: Outcome):
    """The PCM16 chunks in order, each when a live microphone would have it (pace `live`), until duration_s."""
    start = time.monotonic()
    for i, chunk in enumerate(_chunks(data)):
        if pace == "live":
            await asyncio.sleep(max(0.0, start + (i + 1) * FRAME_S - time.monotonic()))
        if time.monotonic() - start > duration_s:
            return
        outcome.frames_sent += math.ceil(len(chunk) / (FRAME * 2))
        if outcome.first_sent is None:
            outcome.first_sent = time.monotonic()
        yield chunk


# ------------------------------------------------------------------------------------------------ gRPC


async def grpc_conversation(address: str, conversation: Conversation, *, pace: str = "live",
                            duration_s: float = math.inf, outcome: Outcome | None = None,
                            take_s: float = 0.0) -> Outcome:
    """One conversation over the Converse stream; `outcome` (a fresh one unless given, to watch it meanwhile)
    fills as the events arrive. `take_s`: a wait after each audio frame taken (a client slow to read)."""
    outcome = outcome or Outcome("grpc")
    ready = asyncio.Event()

    async def requests():
        yield pb.ConverseRequest(configure=pb.Configure(seed=conversation.seed,
                                                        system_prompt=conversation.system_prompt))
        await ready.wait()  # as over the WebSocket, audio starts once the session is open
        async for chunk in _paced(conversation.pcm16(), pace, duration_s, outcome):
            yield pb.ConverseRequest(audio=pb.AudioIn(pcm16=chunk))
        yield pb.ConverseRequest(flush=pb.Flush())

    async with grpc.aio.insecure_channel(address) as channel:
        call = conversation_pb2_grpc.ConversationServiceStub(channel).Converse(requests())
        try:
            async for response in call:
                outcome.received_bytes += response.ByteSize()
                kind = response.WhichOneof("event")
                if kind == "ready":
                    ready.set()
                elif kind == "transcript":
                    m = response.transcript  # from transcript_start on (0 within the server's --text-window)
                    outcome.transcript = outcome.transcript[:m.transcript_start] + m.transcript
                elif kind == "text":
                    outcome.text_ids.append(response.text.token_id)
                elif kind == "function":
                    outcome.function_ids.append(response.function.token_id)
                elif kind == "audio":
                    samples = from_proto_np(response.audio.samples)
                    outcome.add_audio(response.audio.audio_codes, to_pcm16(samples).astype("<i2").tobytes(),
                                      time.monotonic())
                    if take_s:
                        await asyncio.sleep(take_s)
                elif kind == "done":
                    outcome.done = True
                elif kind == "error":
                    outcome.errors.append(f"{pb.ErrorCode.Name(response.error.code)}: {response.error.message}")
                    ready.set()  # a session that did not open: the rest of the stream gets its answers too
        except grpc.aio.AioRpcError as exc:
            outcome.errors.append(f"{exc.code().name}: {exc.details()}")
    return outcome


# ------------------------------------------------------------------------------------------- WebSocket


async def realtime_conversation(url: str, conversation: Conversation, *, pace: str = "live",
                                duration_s: float = math.inf) -> Outcome:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    outcome = Outcome("ws")
    try:
        # no client pings: a server with a backlog of appends reads them late (it pings us instead)
        async with connect(url, max_size=None, compression=None, ping_interval=None) as socket:
            await _expect(socket, "session.created", outcome)
            session = {"seed": conversation.seed, "system_prompt": conversation.system_prompt or None}
            await socket.send(json.dumps({"type": "session.update", "session": session}))
            if not await _expect(socket, "session.updated", outcome):
                return outcome

            async def send() -> None:
                async for chunk in _paced(conversation.pcm16(), pace, duration_s, outcome):
                    await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                                  "audio": base64.b64encode(chunk).decode()}))
                await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))

            sender = asyncio.create_task(send())
            try:
                async for frame in socket:
                    outcome.received_bytes += len(frame)
                    event = json.loads(frame)
                    kind = event["type"]
                    if kind == "conversation.item.input_audio_transcription.delta":
                        outcome.transcript = outcome.transcript[:event.get("transcript_start", 0)] + event["transcript"]
                    elif kind == "response.text.delta":
                        outcome.text_ids.append(event["token_id"])
                    elif kind == "response.function.delta":
                        outcome.function_ids.append(event["token_id"])
                    elif kind == "response.audio.delta":
                        outcome.add_audio(event["audio_codes"], base64.b64decode(event["delta"]), time.monotonic())
                    elif kind == "response.done":
                        outcome.done = True
                    elif kind == "error":
                        outcome.errors.append(f"{event['error']['code']}: {event['error']['message']}")
            finally:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                    await sender
    except (OSError, ConnectionClosed) as exc:
        outcome.errors.append(f"connection: {exc}")
    return outcome


async def _expect(socket, kind: str, outcome: Outcome) -> bool:
    event = json.loads(await socket.recv())
    if event.get("type") == kind:
        return True
    outcome.errors.append(f"expected {kind}, got {event}")
    return False


# ------------------------------------------------------------------------------------------------- run


@dataclass
class LoadReport:
    outcomes: list[Outcome]
    wall_s: float
    settle_frames: int = 0  # each conversation's first intervals left out of the interval percentiles and jitter
    start: float = 0.0  # monotonic time the run started
    budget_s: float = DEFAULT_BUDGET_S  # a frame later than this behind the live schedule is a deadline miss
    orchestrator_cpu_s: float | None = None  # the orchestrator process's CPU seconds over the run (when started here)

    def orchestrator_cpu(self) -> dict | None:
        """{"seconds", "ms_per_frame"} of the orchestrator's CPU over the run, per audio frame delivered."""
        if self.orchestrator_cpu_s is None:
            return None
        frames = sum(o.frames for o in self.outcomes)
        return {"seconds": round(self.orchestrator_cpu_s, 3),
                "ms_per_frame": round(self.orchestrator_cpu_s / frames * 1e3, 4) if frames else None}

    def timeline(self) -> dict:
        """Each conversation's first chunk sent and audio frames received, in seconds from the run's start."""
        def since(t: float | None) -> float | None:
            return None if t is None else round(t - self.start, 6)

        return {"wall_s": self.wall_s, "start_monotonic": self.start, "conversations": [
            {"transport": o.transport, "first_sent_s": since(o.first_sent),
             "arrivals_s": [since(t) for t in o.arrivals]} for o in self.outcomes]}

    def error_counts(self) -> dict[str, int]:
        """Each distinct error message the conversations ended with, and how many ended with it."""
        seen: dict[str, int] = {}
        for outcome in self.outcomes:
            for error in outcome.errors:
                seen[error] = seen.get(error, 0) + 1
        return seen

    def rows(self) -> dict[str, dict]:
        table = {}
        for transport in sorted({o.transport for o in self.outcomes}):
            mine = [o for o in self.outcomes if o.transport == transport]
            intervals = intervals_ms([o.arrivals for o in mine], self.settle_frames)
            frames = sum(o.frames for o in mine)
            latency = summarize([replay(o.first_sent, o.arrivals, FRAME_S, self.budget_s) for o in mine],
                                self.settle_frames)
            table[transport] = {
                "conversations": len(mine),
                "frames": frames,
                "frames_per_s": frames / self.wall_s if self.wall_s else 0.0,
                "interval_p50_ms": percentile(intervals, 0.5) if intervals else None,
                "interval_p95_ms": percentile(intervals, 0.95) if intervals else None,
                "errors": sum(len(o.errors) for o in mine),
                "lost_frames": sum(o.lost for o in mine),
                "completed": sum(o.done for o in mine),
                **latency,
            }
        return table


async def run_load(*, grpc_address: str | list[str] | None, realtime_url: str | list[str] | None,
                   grpc_conversations: list[Conversation], ws_conversations: list[Conversation], pace: str = "live",
                   duration_s: float = math.inf) -> LoadReport:
    """Every conversation at once; their outcomes in order (gRPC ones first). Given several addresses (URLs), the
    conversations are dealt over them in turn (orchestrators sharing one set of services)."""
    addresses, urls = _listed(grpc_address), _listed(realtime_url)
    start = time.monotonic()
    tasks = [grpc_conversation(addresses[i % len(addresses)], c, pace=pace, duration_s=duration_s)
             for i, c in enumerate(grpc_conversations)]
    tasks += [realtime_conversation(urls[i % len(urls)], c, pace=pace, duration_s=duration_s)
              for i, c in enumerate(ws_conversations)]
    outcomes = await asyncio.gather(*tasks)
    return LoadReport(list(outcomes), time.monotonic() - start, start=start)


def processes_cpu(pids: list[int]) -> float | None:
    """The CPU seconds the processes used so far, together; None without any, or where /proc cannot say."""
    try:
        return sum(cpu_seconds(pid) for pid in pids) if pids else None
    except OSError:
        return None


def _listed(value: str | list[str] | None) -> list:
    return value if isinstance(value, list) else [value]


@contextlib.contextmanager
def shared_services(model: Path, sessions: int, serve_flags: list[str]) -> Iterator[list[str]]:
    """The four services started here once for the block, with serve_flags' --service-flags, --service-env,
    --mps, --replicas and --gpus and batches of all `sessions` (as `serve` gives its own): the flags of an
    `orchestrator serve` over them (the rest of serve_flags and --services)."""
    from orchestrator.connect import add_connection_flags, batch_flags, connection_from_args, serving

    parser = argparse.ArgumentParser(prog="--serve-flags", add_help=False)
    add_connection_flags(parser)
    launch, rest = parser.parse_known_args(serve_flags)
    connection = connection_from_args(launch)
    rest += ["--open-timeout", str(launch.open_timeout), "--frame-timeout", str(launch.frame_timeout)]
    flags = batch_flags(connection["flags"], sessions, connection["replicas"])
    with serving(model, None, flags, connection["mps"], connection["envs"], connection["replicas"],
                 connection["gpus"]) as targets:
        yield [*rest, "--services", ",".join(f"{name}={target}" for name, target in targets.items())]


@contextlib.contextmanager
def orchestrators(model: Path, count: int, sessions: int, serve_flags: list[str],
                  started: list[subprocess.Popen], services: list[str] | None = None
                  ) -> Iterator[tuple[list[str], list[str]]]:
    """`count` orchestrators over one set of services, for the block: their gRPC addresses and realtime URLs.
    The services are `shared_services(model, sessions, serve_flags)` started here, or those `services` names (the
    flags `shared_services` gave); every orchestrator takes the rest of the flags and its share of the sessions."""
    with contextlib.ExitStack() as stack:
        if services is None:
            services = stack.enter_context(shared_services(model, sessions, serve_flags))
        share = -(-sessions // count)
        ends = [stack.enter_context(orchestrator(model, share, services, started)) for _ in range(count)]
        yield [address for address, _ in ends], [url for _, url in ends]


@contextlib.contextmanager
def orchestrator(model: Path, sessions: int, extra: list[str] | None = None,
                 started: list[subprocess.Popen] | None = None) -> Iterator[tuple[str, str]]:
    """`orchestrator serve` on the model (its services as children unless `extra` names --services) for the block:
    (gRPC address, realtime URL). Its process is appended to `started` when given (to watch it meanwhile)."""
    process = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--model", str(model),
                                "--host", "127.0.0.1", "--port", "0", "--realtime-port", "0",
                                "--max-sessions", str(sessions), "--realtime-max-sessions", str(sessions),
                                *(extra or [])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if started is not None:
        started.append(process)
    try:
        url = process.stdout.readline().strip().split()[-1:]
        ready = parse_ready_line(process.stdout.readline())
        if ready is None or not url or not url[0].startswith("ws://"):
            process.kill()
            raise RuntimeError(f"orchestrator serve did not start: {process.stderr.read().strip()[-2000:]}")
        follow(process, sys.stderr)
        yield f"127.0.0.1:{ready[1]}", url[0]
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def follow(process: subprocess.Popen, log) -> None:
    """Read a child's stdout and stderr pipes to their end from now on, its stderr's lines written on to `log`: a
    pipe nobody reads fills (64 KiB of logs in a long or failing run), and the child's next write to it blocks."""
    for pipe, to in ((process.stdout, None), (process.stderr, log)):
        threading.Thread(target=_forward, args=(pipe, to), name="child-output", daemon=True).start()


def _forward(pipe, to) -> None:
    """Read `pipe` to its end, writing each line to `to` (None: dropped)."""
    for line in pipe:
        if to is not None:
            to.write(line)
            to.flush()


SERVICES = ("perception", "llm", "tts", "codec")
# a service without a kind reports None for it
MEMORY_KINDS = ("active", "cache", "peak", "limit", "cache_limit", "pooled")
MEMORY_EVERY_S = 1.0


def service_memory(urls: dict[str, str]) -> dict[str, dict[str, float | None]]:
    """Each service's MLX memory now, MiB by kind (`voicechat_memory_bytes`), from its /metrics URL."""
    memory = {}
    for name, url in urls.items():
        page = scrape(url)
        values = {kind: page.get(("voicechat_memory_bytes", frozenset({("service", name), ("kind", kind)})))
                  for kind in MEMORY_KINDS}
        memory[name] = {kind: None if value is None else value / (1 << 20) for kind, value in values.items()}
    return memory


class MemoryWatch:
    """The services' memory read every `every_s` seconds on a thread of its own while a run lasts: what the
    readings before and after it miss (the most held during the run, the least cache limit the device headroom set,
    the most each service's CUDA pool held outside its arrays)."""

    def __init__(self, urls: dict[str, str], every_s: float = MEMORY_EVERY_S,
                 read=service_memory) -> None:
        self.urls, self.every_s, self._read = urls, every_s, read
        self.samples: list[tuple[float, dict[str, dict[str, float | None]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)
        self._start = 0.0

    def __enter__(self) -> MemoryWatch:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                self.samples.append((time.monotonic() - self._start, self._read(self.urls)))
            except OSError:
                pass  # a service between scrapes (restarting, or gone with the run's end): the next reading counts
            if self._stop.wait(self.every_s):
                return

    def extremes(self) -> dict[str, dict[str, float | None]]:
        """Per service, MiB over the readings: the most `active`, `cache` and `pooled`, the least `cache_limit` (None
        where no reading had the kind)."""
        out = {}
        for name in self.urls:
            def values(kind: str, name: str = name) -> list[float]:
                return [v for _, memory in self.samples if (v := memory.get(name, {}).get(kind)) is not None]

            out[name] = {f"most_{kind}": max(values(kind), default=None) for kind in ("active", "cache", "pooled")}
            out[name]["least_cache_limit"] = min(values("cache_limit"), default=None)
        return out


def parse_service_metrics(text: str) -> tuple[str, str]:
    """`tts=http://127.0.0.1:9103/metrics` -> ("tts", the URL)."""
    name, sep, url = text.partition("=")
    if name not in SERVICES or not sep or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=http://HOST:PORT/metrics with NAME one of "
                                         f"{', '.join(SERVICES)}")
    return name, url


def metrics_flags(names=SERVICES) -> tuple[list[str], dict[str, str]]:
    """`orchestrator serve` flags giving each of the services `names` a metrics port (free now), and their /metrics
    URLs."""
    flags, urls = [], {}
    for name in names:
        with socket.socket() as probe:  # a port free now; the service binds it a moment later
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        flags += ["--service-flags", f"{name}=--metrics-port={port}"]
        urls[name] = f"http://127.0.0.1:{port}/metrics"
    return flags, urls


def print_memory(before: dict[str, dict[str, float | None]], after: dict[str, dict[str, float | None]],
                 during: dict[str, dict[str, float | None]] | None = None) -> None:
    """| service | active before | active after | cache after | peak after | (MiB), and with `during`
    (`MemoryWatch.extremes`) the most active, cached and pooled and the least cache limit read during the run."""
    watched = ("most_active", "most_cache", "most_pooled", "least_cache_limit") if during else ()
    print("| service | active before MiB | active after MiB | cache after MiB | peak after MiB |"
          + "".join(f" {key.replace('_', ' ')} during MiB |" for key in watched))
    print("| --- | --- | --- | --- | --- |" + " --- |" * len(watched))
    for name, now in after.items():
        cells = [before[name]["active"], now["active"], now["cache"], now["peak"],
                 *((during or {}).get(name, {}).get(key) for key in watched)]
        print(f"| {name} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in cells) + " |")


def print_table(report: LoadReport) -> None:
    rows = report.rows()
    keys = list(next(iter(rows.values()), {}))
    print(f"{'':>18}" + "".join(f"{t:>12}" for t in rows))
    for key in keys:
        cells = []
        for transport in rows:
            value = rows[transport][key]
            cells.append(f"{'-':>12}" if value is None else f"{value:>12.1f}" if isinstance(value, float)
                         else f"{value:>12}")
        print(f"{key:>18}" + "".join(cells))
    print(f"wall {report.wall_s:.1f} s")
    if (cpu := report.orchestrator_cpu()) is not None:
        print(f"orchestrator cpu {cpu['seconds']:.2f} s, {cpu['ms_per_frame'] or 0:.3f} ms per frame delivered")
    for error, count in report.error_counts().items():
        print(f"error x{count}: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint folder (needed unless --address/--realtime are given)")
    parser.add_argument("--address", help="a running orchestrator's gRPC address HOST:PORT")
    parser.add_argument("--realtime", help="a running orchestrator's ws://HOST:PORT/v1/realtime URL")
    parser.add_argument("--grpc", type=int, default=4, help="conversations over gRPC Converse (default 4)")
    parser.add_argument("--ws", type=int, default=4, help="conversations over the WebSocket (default 4)")
    parser.add_argument("--seconds", type=float, default=10.0, help="audio per conversation (default 10)")
    parser.add_argument("--duration", type=float, default=120.0, help="no audio is sent after this (default 120 s)")
    parser.add_argument("--pace", choices=["live", "burst"], default="live", help="live microphone or all at once")
    parser.add_argument("--input", type=Path, default=EXAMPLE, help="speech to loop (default the bundled question)")
    parser.add_argument("--system-prompt", default="", metavar="TEXT",
                        help="every conversation's system prompt (default the checkpoint's)")
    parser.add_argument("--settle-seconds", type=float, default=0.0,
                        help="leave each conversation's first S seconds of frames out of the interval percentiles "
                             "and the jitter (its opening: the prompt, the first frames of every conversation "
                             "starting together)")
    parser.add_argument("--timeline", type=Path,
                        help="write each conversation's send and arrival times (JSON); with --repeat N, run r > 1 "
                             "writes PATH's name with -r before its suffix (live.json, live-2.json, ...)")
    add_budget_flag(parser)
    parser.add_argument("--memory", action="store_true",
                        help="report each service's MLX memory before and after the run (the services of the "
                             "orchestrator this starts get metrics ports)")
    parser.add_argument("--memory-every", type=float, default=MEMORY_EVERY_S, metavar="S",
                        help="with --memory, also read the services' memory every S seconds during the run (default "
                             f"{MEMORY_EVERY_S:g}; 0: only before and after): the most held, the least cache limit")
    parser.add_argument("--service-metrics", type=parse_service_metrics, action="append", metavar="NAME=URL",
                        help="a running service's /metrics URL, for --memory against --address (repeatable)")
    parser.add_argument("--serve-flags", default="", metavar="FLAGS",
                        help="more flags for the orchestrator this starts (one string, split as a shell does)")
    parser.add_argument("--orchestrators", type=counts, default=[1], metavar="K[,K...]",
                        help="start K orchestrators over one set of services and deal the conversations over them "
                             "(default 1: one `orchestrator serve` with its own services); a list such as 4,8 "
                             "runs the load (--repeat times) with each K in turn, the services started once")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the load N times on one server, each reported (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.grpc < 0 or args.ws < 0 or args.grpc + args.ws == 0:
        parser.error("--grpc and --ws must be >= 0 and not both 0")
    if not args.seconds > 0 or not args.duration > 0:
        parser.error("--seconds and --duration must be positive")
    if not 0 <= args.settle_seconds < args.seconds:
        parser.error("--settle-seconds must be at least 0 and less than --seconds")
    start_one = (args.grpc and not args.address) or (args.ws and not args.realtime)
    if start_one and args.model is None:
        parser.error("give --model (an orchestrator is started) or --address/--realtime of a running one")
    speech = read_audio(args.input)
    talks = conversations(speech, args.grpc + args.ws, args.seconds, args.system_prompt)

    def run(address, url, pids: list[int]) -> LoadReport:
        before = processes_cpu(pids)
        report = asyncio.run(run_load(grpc_address=address, realtime_url=url, grpc_conversations=talks[: args.grpc],
                                      ws_conversations=talks[args.grpc :], pace=args.pace, duration_s=args.duration))
        if before is not None and (after := processes_cpu(pids)) is not None:
            report.orchestrator_cpu_s = after - before
        return report

    metrics = dict(args.service_metrics or [])
    extra = shlex.split(args.serve_flags)
    if args.memory and start_one:  # the services named in --service-metrics bring their own metrics port
        flags, started = metrics_flags([name for name in SERVICES if name not in metrics])
        extra += flags
        metrics = {**started, **metrics}
    if args.memory and not metrics:
        parser.error("--memory against a running orchestrator needs its services' --service-metrics NAME=URL")
    sessions = max(args.grpc, args.ws)
    plan = [(k, r) for k in args.orchestrators for r in range(1, args.repeat + 1)]
    shared = len(args.orchestrators) > 1 or args.orchestrators[0] > 1
    with contextlib.ExitStack() as stack:
        serve_flags = stack.enter_context(shared_services(args.model, sessions, extra)) if start_one and shared \
            else extra
        ok = True
        for k in args.orchestrators:
            started: list[subprocess.Popen] = []
            if not start_one:
                serving = contextlib.nullcontext((None, None))
            elif shared:
                serving = orchestrators(args.model, k, sessions, [], started, serve_flags)
            else:
                serving = orchestrator(args.model, sessions, serve_flags, started)
            with serving as (address, url):
                for r in range(1, args.repeat + 1):
                    if len(args.orchestrators) > 1:
                        print(f"orchestrators {k}, run {r} of {args.repeat}", flush=True)
                    before = service_memory(metrics) if args.memory else {}
                    watch = MemoryWatch(metrics, args.memory_every) if args.memory and args.memory_every > 0 \
                        else None
                    with watch or contextlib.nullcontext():
                        report = run(args.address or address, args.realtime or url, [p.pid for p in started])
                    memory = service_memory(metrics) if args.memory else {}
                    timeline = repeat_path(args.timeline, plan.index((k, r)) + 1)
                    ok = show(report, args, before, memory, timeline, watch) and ok
    return 0 if ok else 1


def counts(text: str) -> list[int]:
    """`4` -> [4]; `4,8` -> [4, 8] (each at least 1)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count of at least 1, or several separated by commas")
    return values


def repeat_path(path: Path | None, run: int) -> Path | None:
    """Where run `run` (from 1) writes its timeline, the runs of --repeat numbered on over each --orchestrators
    count: the path itself for the first run, else its name with -run before the suffix."""
    return path if path is None or run == 1 else path.with_name(f"{path.stem}-{run}{path.suffix}")


def show(report: LoadReport, args: argparse.Namespace, before: dict, memory: dict,
         timeline: Path | None = None, watch: MemoryWatch | None = None) -> bool:
    """Print one run's report (and the services' memory around it), its timeline written to `timeline` when
    given; whether every conversation ended cleanly."""
    report.settle_frames = round(args.settle_seconds / FRAME_S)
    report.budget_s = args.latency_budget_s
    if timeline is not None:
        timeline.write_text(json.dumps(report.timeline()))
    if args.json:
        print(json.dumps({"wall_s": report.wall_s, "latency_budget_ms": round(report.budget_s * 1e3, 6),
                          "transports": report.rows(), "error_messages": report.error_counts(),
                          **({"memory_mb": {"before": before, "after": memory,
                                            **({"during": watch.extremes(), "samples": [
                                                {"t_s": round(t, 3), **sample} for t, sample in watch.samples]}
                                               if watch else {})}} if memory else {}),
                          **({"orchestrator_cpu": cpu} if (cpu := report.orchestrator_cpu()) else {})}, indent=2))
    else:
        print_table(report)
        if memory:
            print_memory(before, memory, watch.extremes() if watch else None)
    return all(not o.errors and o.done and not o.lost for o in report.outcomes)

if __name__ == "__main__":
    sys.exit(main())
