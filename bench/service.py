"""Drive one network service with K concurrent sessions and report its throughput and per-frame latency.

    python -m bench.service {perception,llm,tts,codec} --model DIR [--address HOST:PORT]
                            [--sessions K[,K...]] [--frames N] [--warmup W] [--no-in-process | --no-grpc]
                            [--weights-dtype stored|bfloat16] [--float32-weights] [--split-matmuls]
                            [--partial N] [--host-split] [--kernels N] [--hold] [--memory] [--stack-all]
                            [--cache-limit-mb MB|shared] [--memory-limit-mb MB] [--device-headroom-mb MB|shared]
                            [--json]

Without --address the service is started as a child process on a free port (and stopped after). Each session
is one bidirectional stream sending N frames of synthetic but valid input, one at a time (a frame is sent when
the previous one's reply has arrived, as the frame clock does), so concurrent sessions' steps meet in the
service's batches. Reported per K: the service's mean batch size (from its metrics), frames per second over all
sessions and per-frame latency p50/p95, over gRPC and for the same K sessions stepped together on the engine in
this process (its batched call); the difference of the two latencies is what the transport and the service's
queueing cost. A service the bench starts has the batch sizes it will see compiled at load.

In process (--no-grpc) each K's table row also gives the opening: the K sessions' opens and their first step
together (a step that runs what the opens left to the first step, e.g. speech's warm-up, costs more than the
rest), both left out of the percentiles.

--partial N (in-process, with --no-grpc) has every third step leave N of the K sessions out, other ones each
time, as a live service's batch does when some sessions' frames are late: the table then splits the steps into
full ones after a full one, partial ones, and full ones after a partial one.

--host-split (in-process) reports where a step's time goes on the host, medians per K: building its graph in
Python, launching it (`mx.async_eval`, which on a GPU returns once every kernel is queued), waiting for the
device, and the engine thread's CPU time. A step whose thread CPU time is its wall time is bound by the host,
not the device: on a GPU such a step costs about the same for one session as for many.

--kernels N (in-process, on a GPU with PyTorch's profiler) records every kernel the measured steps run, timed
on the device (`bench.kernels`), and reports per K the kernels a step, their time a step and the N costliest.

--memory (in-process, with --no-grpc) reports per K the engine's MLX memory in MiB, over what it held before the
K sessions opened (`idle`): what the sessions hold once their frames are stepped (`held`, their caches), the most
held at once during the burst (`peak`, which `mx.get_peak_memory` records), and once they closed, what is still
held (`left`: should be ~0) and the buffer cache MLX keeps for reuse (`cache`, at most --cache-limit-mb when
given). --stack-all has speech and the language model stack every session's attention keys as they do on a GPU
(on the CPU they read each cache in place), so the CPU shows the GPU path's memory. --cache-limit-mb,
--memory-limit-mb and --device-headroom-mb apply the services' flags of those names to this process (the last
only when given: an engine measured alone keeps no headroom).

--hold (in-process, one K) keeps K sessions stepping until SIGTERM, as load beside another measurement
(`bench.contention` runs the other engines so while it times one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from bench.kernels import KernelRecorder, KernelRecorderError, summary
from bench.kernels import table as kernel_table
from orchestrator.launcher import spawn_service, stop, wait_ready
from orchestrator.profile import percentile
from protos.voicechat.v1 import (
    codec_pb2,
    codec_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
    perception_pb2,
    perception_pb2_grpc,
    speech_pb2,
    speech_pb2_grpc,
)
from services.common.cli import (
    SHARED,
    apply_cache_limit,
    apply_memory_limit,
    cache_limit_mb,
    keep_device_headroom,
    shared_headroom_mb,
)
from services.common.config import VoiceChatConfig
from services.common.loading import AS_STORED, LoadOptions, process_settings
from services.common.metrics import scrape
from services.common.tensors import to_proto_np

SERVICES = ("perception", "llm", "tts", "codec")


@dataclass
class Workload:
    """How to talk to one service: its stub, the stream's open message, and the k-th frame message."""

    stub: Callable
    method: str
    open: object
    frame: Callable[[int, np.random.Generator], object]


def workload(name: str, config: VoiceChatConfig, prompt_frames: int = 0) -> Workload:
    q, cb = config.tts_config.num_quantizers, config.tts_config.codebook_size
    if name == "perception":
        return Workload(perception_pb2_grpc.PerceptionServiceStub, "Stream",
                        perception_pb2.PerceptionStreamRequest(open=perception_pb2.PerceptionOpen(
                            sample_rate_hz=config.input_sample_rate)),
                        lambda i, rng: perception_pb2.PerceptionStreamRequest(frame=perception_pb2.PerceptionFrameInput(
                            frame_index=i, samples=to_proto_np(
                                (0.1 * rng.standard_normal(config.input_frame_samples)).astype(np.float32)))))
    if name == "llm":
        hidden = config.text_config.hidden_size
        def step(i: int, rng: np.random.Generator) -> language_pb2.LanguageStreamRequest:
            row = to_proto_np(rng.standard_normal(hidden).astype(np.float32))
            step = language_pb2.LanguageStep(frame_index=i, audio_embedding=row)
            return language_pb2.LanguageStreamRequest(step=step)

        return Workload(language_pb2_grpc.LanguageServiceStub, "Stream",
                        language_pb2.LanguageStreamRequest(open=language_pb2.LanguageOpen()), step)
    if name == "tts":
        vocab = config.text_config.vocab_size
        prompt = to_proto_np(np.random.default_rng(0).integers(0, cb, (prompt_frames, q)).astype(np.int32))
        return Workload(speech_pb2_grpc.SpeechServiceStub, "Stream",
                        speech_pb2.SpeechStreamRequest(open=speech_pb2.SpeechOpen(seed=0, prompt_codes=prompt)),
                        lambda i, rng: speech_pb2.SpeechStreamRequest(step=speech_pb2.SpeechStep(
                            frame_index=i, text_token_id=int(rng.integers(16, vocab)))))
    if name == "codec":
        return Workload(codec_pb2_grpc.CodecServiceStub, "DecodeStream",
                        codec_pb2.CodecDecodeStreamRequest(open=codec_pb2.CodecDecodeOpen()),
                        lambda i, rng: codec_pb2.CodecDecodeStreamRequest(frame=codec_pb2.CodecDecodeFrameInput(
                            frame_index=i, codes=to_proto_np(rng.integers(0, cb, q).astype(np.int32)))))
    raise ValueError(f"unknown service {name!r}; expected one of {', '.join(SERVICES)}")


async def one_session(stub, load: Workload, frames: int, warmup: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    call = getattr(stub, load.method)()
    await call.write(load.open)
    await call.read()
    latencies = []
    for index in range(frames + warmup):
        start = time.perf_counter()
        await call.write(load.frame(index, rng))
        await call.read()
        if index >= warmup:
            latencies.append((time.perf_counter() - start) * 1000.0)
    await call.done_writing()
    return latencies


async def drive(address: str, load: Workload, sessions: int, frames: int, warmup: int) -> dict:
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = load.stub(channel)
        start = time.perf_counter()
        results = await asyncio.gather(*(one_session(stub, load, frames, warmup, s) for s in range(sessions)))
        elapsed = time.perf_counter() - start
    latencies = [x for r in results for x in r]
    return {
        "sessions": sessions,
        "frames_per_session": frames,
        "frames_per_second": sessions * (frames + warmup) / elapsed,
        "latency_p50_ms": percentile(latencies, 0.5),
        "latency_p95_ms": percentile(latencies, 0.95),
    }


LLM_ROWS = 16  # distinct audio rows the language model's sessions are fed, drawn once
PARTIAL_EVERY = 3  # with --partial, steps 2, 5, 8, ... leave some sessions out


def stepping(k: int, partial: int, index: int) -> list[int]:
    """The sessions (of k) that step at `index`: all, or on every PARTIAL_EVERY-th step all but `partial` of them,
    the ones left out moving on by `partial` each time."""
    if partial == 0 or index % PARTIAL_EVERY != PARTIAL_EVERY - 1:
        return list(range(k))
    first = (index // PARTIAL_EVERY * partial) % k
    out = {(first + j) % k for j in range(partial)}
    return [b for b in range(k) if b not in out]


class EngineDriver:
    """One service's engine loaded in this process, stepped with synthetic but valid input: `open()` a session,
    `step(sessions)` them as one batched call (one session: the solo path). The language model's sessions open
    with `system_prompt` (the first feeds its rows; the engine keeps the caches they leave for the next ones)."""

    def __init__(self, name: str, model: Path, config: VoiceChatConfig, options: LoadOptions = AS_STORED,
                 system_prompt: str = "") -> None:
        import mlx.core as mx

        rng = np.random.default_rng(0)
        self._done: dict[int, int] = {}  # frames each session has stepped (the codec's frame index)
        self._close: Callable[[object], None] = lambda session: None  # the other engines keep nothing of a session
        if name == "perception":
            from services.perception.engine import PerceptionEngine

            engine = PerceptionEngine.load(model, options)
            self._open = engine.open_stream
            self._batch = lambda live: engine.push_batch([  # noqa: E731
                (s, (0.1 * rng.standard_normal(config.input_frame_samples)).astype(np.float32)) for s in live])
        elif name == "llm":
            from services.llm.engine import LanguageEngine

            engine = LanguageEngine.load(model, options=options)
            # audio rows drawn once: a step converts each session's row as a servicer does, but draws none, so
            # the step's Python time is the engine's (64 draws of a full model's row took 5 ms a step)
            rows = rng.standard_normal((LLM_ROWS, config.text_config.hidden_size)).astype(np.float32)
            steps = itertools.count()

            def step_llm(live: list) -> list:
                first = next(steps)
                return engine.step_batch([(s, mx.array(rows[(first + b) % LLM_ROWS]), False, None)
                                          for b, s in enumerate(live)])

            self._open = lambda: engine.open_session(system_prompt)  # noqa: E731
            self._close = engine.close_session  # its pools hold the sessions' stacked states until closed
            self._batch = step_llm
        elif name == "tts":
            from services.tts.engine import TTSEngine

            engine = TTSEngine.load(model, options)
            cb = config.tts_config.codebook_size
            prompt = np.random.default_rng(0).integers(0, cb, (engine.prompt_frames, engine.num_quantizers))
            self._open = lambda: engine.open_session(0, prompt.astype(np.int32), 0)  # noqa: E731
            vocab = config.text_config.vocab_size
            self._batch = lambda live: engine.step_batch([  # noqa: E731
                (s, int(rng.integers(16, vocab))) for s in live])
        else:
            from services.codec.engine import CodecEngine

            engine = CodecEngine.load(model)
            self._open = engine.open_stream
            q, cb = config.codec_config.num_quantizers, config.codec_config.codebook_size
            self._batch = lambda live: engine.decode_batch([  # noqa: E731
                (s, self._done[id(s)], rng.integers(0, cb, q).astype(np.int32)) for s in live])
        self.engine = engine

    def stack_all(self) -> None:
        """Stack every attention cache of a batched step, as speech and the language model do on a GPU."""
        from services.common.cache import STACK_ALL

        if not hasattr(self.engine, "stack_up_to"):
            raise ValueError("only speech and the language model stack attention caches")
        self.engine.stack_up_to = STACK_ALL

    def precompile(self, max_batch: int) -> None:
        """The batch sizes up to max_batch traced, as a service does at load with --precompile-batches, and one
        session opened and closed: what an engine keeps of a first opening (speech's warm-up of this driver's
        prompt) is then the engine's, as in a running service, not a burst's."""
        self.engine.precompile(max_batch)
        self._close(self._open())

    def open(self) -> object:
        session = self._open()
        self._done[id(session)] = 0
        return session

    def step(self, sessions: list) -> list:
        """One batched step of `sessions`, each session's output in order; the first entry's error, if any, is
        raised."""
        results = self._batch(sessions)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        for session in sessions:
            self._done[id(session)] += 1
        return results

    def close(self, sessions: list) -> None:
        """Done with `sessions`: what the engine holds of them is freed."""
        for session in sessions:
            self._close(session)
            self._done.pop(id(session), None)


MIB = 1 << 20


class BurstMemory:
    """MLX's memory around one burst of sessions (bytes): `idle` active before they opened; `held` active once
    their steps are done, over idle (what the sessions hold); `peak` the most active at once during the burst,
    over idle; `left` active once they closed, over idle; `cache` the buffer cache then.

        with BurstMemory() as memory:
            ...open, step and close the sessions...
        memory.report()   # {"idle_mb": ..., "held_mb": ..., "peak_mb": ..., "left_mb": ..., "cache_mb": ...}
    """

    def __enter__(self) -> BurstMemory:
        import mlx.core as mx

        gc.collect()  # what earlier bursts left unreferenced is not the idle level
        self.idle = mx.get_active_memory()
        self.held = 0
        mx.reset_peak_memory()
        return self

    def stepped(self) -> None:
        """The sessions' frames are done (they are still open): what they hold now is `held`."""
        import mlx.core as mx

        self.held = mx.get_active_memory() - self.idle

    def __exit__(self, *exc) -> None:
        import mlx.core as mx

        gc.collect()
        self.peak = mx.get_peak_memory() - self.idle
        self.left = mx.get_active_memory() - self.idle
        self.cache = mx.get_cache_memory()

    def report(self) -> dict[str, float]:
        return {f"{name}_mb": getattr(self, name) / MIB for name in ("idle", "held", "peak", "left", "cache")}


def in_process(name: str, model: Path, config: VoiceChatConfig, sessions: list[int], frames: int, warmup: int,
               options: LoadOptions = AS_STORED, partial: int = 0, host_split: bool = False,
               kernels: int = 0, memory: bool = False, stack_all: bool = False) -> dict[int, dict]:
    """The same work on the engine in this process, without gRPC: for each K, K sessions stepped together
    through the engine's batched call (K = 1 is the solo path), with `partial` of them left out of every third
    step (`stepping`). The engine first precompiles the batch sizes up to the largest K, as a service this bench
    starts does. Returns {K: frames/s and per-step latency, and with `partial` per kind of step; with
    `host_split` the medians of where a step's time goes on the host (`host_times`); with `kernels` the
    device time of the measured steps' kernels and the `kernels` costliest (`bench.kernels.summary`); with
    `memory` the engine's memory around the K sessions (`BurstMemory.report`)}. `stack_all`: every attention
    cache stacked, as on a GPU (`services.common.cache.STACK_ALL`)."""
    from bench.stages import EvalSplit

    recorder = KernelRecorder() if kernels else None  # before the load: a host that cannot record says so at once
    driver = EngineDriver(name, model, config, options)
    if stack_all:
        driver.stack_all()
    driver.precompile(max(sessions))
    report = {}
    split = EvalSplit()
    for k in sessions:
        with BurstMemory() if memory else contextlib.nullcontext() as burst:
            report[k] = run_burst(driver, k, frames, warmup, partial, host_split, kernels, recorder, split, burst)
        if burst is not None:
            report[k]["memory"] = burst.report()
    return report


def run_burst(driver: EngineDriver, k: int, frames: int, warmup: int, partial: int, host_split: bool, kernels: int,
              recorder: KernelRecorder | None, split, burst: BurstMemory | None) -> dict:
    """`in_process` for one K: its sessions opened, stepped and closed."""
    start = time.perf_counter()
    live = [driver.open() for _ in range(k)]
    opens_ms, first_ms = (time.perf_counter() - start) * 1000.0, None
    latencies, kinds, frames_stepped, previous = [], [], 0, k
    host: list[tuple[float, float, float, float]] = []  # per step: Python, launch, wait, thread CPU (ms)
    with split if host_split else contextlib.nullcontext():
        for index in range(frames + warmup):
            members = [live[b] for b in stepping(k, partial, index)]
            if recorder is not None and index == warmup:
                recorder.start()
            split.take()  # what the step before (a warm-up one, say) left
            start, cpu = time.perf_counter(), time.thread_time()
            driver.step(members)
            wall_ms, cpu_ms = (time.perf_counter() - start) * 1000.0, (time.thread_time() - cpu) * 1000.0
            first_ms = wall_ms if first_ms is None else first_ms
            if index >= warmup:
                latencies.append(wall_ms)
                frames_stepped += len(members)
                kinds.append("partial" if len(members) < k else "after_partial" if previous < k else "full")
                if host_split:
                    launch_ms, wait_ms = (seconds * 1000.0 for seconds in split.take())
                    host.append((wall_ms - launch_ms - wait_ms, launch_ms, wait_ms, cpu_ms))
            previous = len(members)
    recorded = recorder.stop() if recorder is not None else None
    if burst is not None:
        burst.stepped()
    report = {"sessions": k, "frames_per_second": frames_stepped / (sum(latencies) / 1000.0),
              "latency_p50_ms": percentile(latencies, 0.5), "latency_p95_ms": percentile(latencies, 0.95),
              "opening": {"opens_ms": opens_ms, "first_step_ms": first_ms}}  # the K sessions' opens, their first step
    if host_split:
        report["host_times"] = {name: percentile([step[i] for step in host], 0.5) for i, name in
                                enumerate(("python_ms", "launch_ms", "wait_ms", "thread_cpu_ms"))}
    if recorded is not None:
        report["kernels"] = summary(recorded, frames, kernels)
    if partial:
        for kind in ("full", "partial", "after_partial"):
            picked = [ms for ms, what in zip(latencies, kinds, strict=True) if what == kind]
            report[kind] = {"steps": len(picked), "p50_ms": percentile(picked, 0.5) if picked else None,
                            "p95_ms": percentile(picked, 0.95) if picked else None}
    driver.close(live)
    return report


HOLDING = "holding:"  # the line `hold` prints once its sessions step in their steady state


def hold(driver: EngineDriver, sessions: int, frames: int, warmup: int, done: Callable[[], bool]) -> int:
    """Keep `sessions` sessions stepping together until `done()` says so, as load beside another measurement:
    the sessions are replaced by fresh ones (the old ones closed) every `frames` steps, so their caches stay as a
    `frames`-step run's; after the first `warmup` steps one line starting with HOLDING is printed. Returns the
    steps run."""
    driver.precompile(sessions)
    steps = 0
    while not done():
        live = [driver.open() for _ in range(sessions)]
        for _ in range(frames):
            driver.step(live)
            steps += 1
            if steps == max(warmup, 1):
                print(f"{HOLDING} {sessions} sessions stepping", flush=True)
            if done():
                break
        driver.close(live)
    return steps


def prompt_frames(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return speech_pb2_grpc.SpeechServiceStub(channel).Describe(speech_pb2.SpeechDescribeRequest()).prompt_frames


def batches(metrics_url: str | None) -> tuple[float, float] | None:
    """(batched steps, sessions stepped) so far, from the service's voicechat_batch_size histogram."""
    if not metrics_url:
        return None
    page = scrape(metrics_url)
    count = next((v for (name, _), v in page.items() if name == "voicechat_batch_size_count"), None)
    total = next((v for (name, _), v in page.items() if name == "voicechat_batch_size_sum"), None)
    return None if count is None or total is None else (count, total)


def session_counts(text: str) -> list[int]:
    """"1,8,16" -> [1, 8, 16]."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected session counts like 1,8,16") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every session count must be at least 1")
    return counts


def main(argv: list[str] | None = None) -> int:
    process_settings()  # before this process's engines (or the services it starts) run
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("service", choices=SERVICES)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint (its config shapes the inputs)")
    parser.add_argument("--address", help="HOST:PORT of a running service (default: start one)")
    parser.add_argument("--sessions", type=session_counts, default=[1],
                        help="concurrent sessions; a list such as 1,8,16 runs each in turn (default 1)")
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-in-process", dest="in_process", action="store_false",
                        help="skip the in-process comparison (it loads the model a second time)")
    parser.add_argument("--no-grpc", dest="grpc", action="store_false",
                        help="only the engine in this process: start no service, drive none")
    parser.add_argument("--metrics-url", help="the --address service's /metrics URL: report its mean batch size "
                        "(a service this bench starts is scraped anyway)")
    parser.add_argument("--weights-dtype", choices=["stored", "bfloat16"], default="stored",
                        help="llm only: the language weights' dtype, for the started service and in-process")
    parser.add_argument("--float32-weights", action="store_true",
                        help="perception, llm, tts: keep in float32 what the frames' matmuls convert (the services' "
                        "--float32-weights), for the started service and in-process")
    parser.add_argument("--split-matmuls", action="store_true",
                        help="perception, llm, tts, on a CUDA GPU: the service's --split-matmuls, started and "
                        "in-process")
    parser.add_argument("--partial", type=int, default=0, metavar="N",
                        help="in-process (--no-grpc): leave N of the K sessions out of every third step, and time "
                             "full, partial and after-partial steps apart")
    parser.add_argument("--host-split", action="store_true",
                        help="in-process (--no-grpc): where a step's time goes on the host, medians of: building "
                             "its graph in Python, launching it (mx.async_eval: on a GPU every kernel queued), "
                             "waiting for the device, and the engine thread's CPU time")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="in-process (--no-grpc), on a GPU with PyTorch: record the measured steps' kernels, "
                             "timed on the device, and report their time a step and the N costliest")
    parser.add_argument("--hold", action="store_true",
                        help="in-process (--no-grpc), one session count: keep its sessions stepping, fresh ones "
                             "every --frames steps, until SIGTERM or SIGINT, as load beside another measurement "
                             f"(bench.contention); prints a line starting '{HOLDING}' once past --warmup steps")
    parser.add_argument("--memory", action="store_true",
                        help="in-process (--no-grpc): the engine's MLX memory per K: held by the sessions, peak during "
                             "the burst, left once they closed, and the buffer cache then")
    parser.add_argument("--stack-all", action="store_true",
                        help="in-process (--no-grpc), tts and llm: stack every attention cache of a batch as on a GPU "
                             "(the CPU reads them in place), to see the GPU path's memory on the CPU")
    parser.add_argument("--cache-limit-mb", type=cache_limit_mb, metavar="MB",
                        help="in-process: MLX's buffer cache bound, as the services' flag (`shared`: a shared "
                             "device's share)")
    parser.add_argument("--memory-limit-mb", type=float, metavar="MB",
                        help="in-process: MLX's memory limit, as the services' flag")
    parser.add_argument("--device-headroom-mb", type=cache_limit_mb, metavar="MB",
                        help="in-process: keep MB of the device free for its other processes, as the services' flag "
                             "(`shared`: their default; without the flag, none)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if (args.memory or args.stack_all) and args.grpc:
        parser.error("--memory and --stack-all need --no-grpc (they measure the engine in this process)")
    if args.stack_all and args.service not in ("tts", "llm"):
        parser.error("--stack-all: only tts and llm stack attention caches")
    apply_cache_limit(args.cache_limit_mb)
    apply_memory_limit(args.memory_limit_mb)
    if args.device_headroom_mb is not None:  # a daemon thread for the process's life, as in a service
        keep_device_headroom(shared_headroom_mb() if args.device_headroom_mb == SHARED
                             else args.device_headroom_mb)
    if args.partial and (args.grpc or not 0 < args.partial < min(args.sessions)):
        parser.error(f"--partial {args.partial}: needs --no-grpc and fewer than the smallest session count "
                     f"({min(args.sessions)})")
    if args.float32_weights and args.service == "codec":
        parser.error("--float32-weights: the codec service has no such option")
    if args.split_matmuls and args.service == "codec":
        parser.error("--split-matmuls: the codec service has no such option")
    if args.host_split and args.grpc:
        parser.error("--host-split: needs --no-grpc (it times the engine in this process)")
    if args.kernels and (args.grpc or args.kernels < 0):
        parser.error("--kernels N: needs --no-grpc (it records the engine in this process) and N of at least 1")
    if not args.grpc and (not args.in_process or args.address):
        parser.error("--no-grpc runs the in-process side only: it takes neither --no-in-process nor --address")
    if args.hold and (args.grpc or len(args.sessions) != 1 or args.partial or args.host_split or args.kernels):
        parser.error("--hold: needs --no-grpc and one session count, and takes none of --partial, --host-split "
                     "and --kernels")
    config = VoiceChatConfig.load(args.model)
    # --weights-dtype is the language model's alone
    options = LoadOptions(args.weights_dtype if args.service == "llm" else "stored", args.float32_weights,
                          args.split_matmuls)
    if args.hold:
        return _hold(args, config, options)
    child = None
    address = args.address
    metrics_url = args.metrics_url
    grpc_runs = []
    try:
        if args.grpc and address is None:
            extra = ["--metrics-port", "0", "--max-batch", str(max(args.sessions)),
                     "--precompile-batches", str(max(args.sessions))]
            extra += ["--weights-dtype", args.weights_dtype] if args.service == "llm" else []
            extra += ["--float32-weights"] if args.float32_weights else []
            extra += ["--split-matmuls"] if args.split_matmuls else []
            child = spawn_service(args.service, args.model, extra)
            wait_ready([child])
            address, metrics_url = child.address, child.metrics_url
        load = workload(args.service, config, prompt_frames(address) if args.service == "tts" else 0) \
            if args.grpc else None
        for k in args.sessions if args.grpc else []:
            before = batches(metrics_url)
            run = asyncio.run(drive(address, load, k, args.frames, args.warmup))
            after = batches(metrics_url)
            if before and after and after[0] > before[0]:
                run["mean_batch"] = (after[1] - before[1]) / (after[0] - before[0])
            grpc_runs.append(run)
    finally:
        if child is not None:
            stop([child])
    try:
        local = (in_process(args.service, args.model, config, args.sessions, args.frames, args.warmup, options,
                            args.partial, args.host_split, args.kernels, args.memory, args.stack_all)
                 if args.in_process else {})
    except KernelRecorderError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    rows = [{"sessions": run["sessions"], "grpc": run, "in_process": local.get(run["sessions"])} for run in grpc_runs]
    if not args.grpc:
        rows = [{"sessions": k, "grpc": None, "in_process": local[k]} for k in args.sessions]
    for row in rows:
        if row["in_process"] is not None and row["grpc"] is not None:
            row["transport_ms_p50"] = row["grpc"]["latency_p50_ms"] - row["in_process"]["latency_p50_ms"]
    report = {"service": args.service, "address": address, "frames_per_session": args.frames, "runs": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    where = f"at {address}" if args.grpc else "in this process"
    print(f"{args.service} {where}: {args.frames} frames per session after {args.warmup} warm-up")
    if not args.grpc:
        kinds = ("full", "partial", "after_partial") if args.partial else ()
        host = ("Python", "launch", "device wait", "thread CPU") if args.host_split else ()
        memory = ("idle", "held", "peak", "left", "cache") if args.memory else ()
        print("| sessions | in-process frames/s | in-process p50 / p95 ms | opens / first step ms |"
              + "".join(f" {kind.replace('_', ' ')}: steps, p50 / p95 ms |" for kind in kinds)
              + "".join(f" {name} p50 ms |" for name in host) + "".join(f" {name} MiB |" for name in memory))
        print("| --- | --- | --- | --- |" + " --- |" * (len(kinds) + len(host) + len(memory)))
        for row in rows:
            p = row["in_process"]
            split = "".join(f" {p[kind]['steps']}, {_ms(p[kind])} |" for kind in kinds)
            times = "".join(f" {ms:.2f} |" for ms in p["host_times"].values()) if host else ""
            held = "".join(f" {p['memory'][f'{name}_mb']:.2f} |" for name in memory)
            opening = p["opening"]
            print(f"| {row['sessions']} | {p['frames_per_second']:.1f} | {p['latency_p50_ms']:.2f} / "
                  f"{p['latency_p95_ms']:.2f} | {opening['opens_ms']:.1f} / {opening['first_step_ms']:.1f} |"
                  f"{split}{times}{held}")
        for row in rows:
            if "kernels" in row["in_process"]:
                print(f"\n{row['sessions']} sessions: " + "\n".join(kernel_table(row["in_process"]["kernels"])))
        return 0
    print("| sessions | mean batch | gRPC frames/s | gRPC p50 / p95 ms | in-process frames/s | "
          "in-process p50 / p95 ms | transport p50 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        g, p = row["grpc"], row["in_process"]
        here = (f"{p['frames_per_second']:.1f} | {p['latency_p50_ms']:.2f} / {p['latency_p95_ms']:.2f} | "
                f"{row['transport_ms_p50']:.2f}") if p else "- | - | -"
        batch = f"{g['mean_batch']:.1f}" if "mean_batch" in g else "-"
        print(f"| {row['sessions']} | {batch} | {g['frames_per_second']:.1f} | {g['latency_p50_ms']:.2f} / "
              f"{g['latency_p95_ms']:.2f} | {here} |")
    return 0


def _hold(args: argparse.Namespace, config: VoiceChatConfig, options: LoadOptions) -> int:
    """--hold: step until SIGTERM or SIGINT, then exit 0 with the steps run."""
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    driver = EngineDriver(args.service, args.model, config, options)
    steps = hold(driver, args.sessions[0], args.frames, args.warmup, stopping.is_set)
    print(f"held: {steps} steps of {args.sessions[0]} sessions", flush=True)
    return 0


def _ms(kind: dict) -> str:
    return "-" if kind["p50_ms"] is None else f"{kind['p50_ms']:.2f} / {kind['p95_ms']:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
