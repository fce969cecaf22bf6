"""Drive one network service with K concurrent sessions and report its throughput and per-frame latency.

    python -m bench.service {perception,llm,tts,codec} --model DIR [--address HOST:PORT]
                            [--sessions K] [--frames N] [--warmup W] [--json]

Without --address the service is started as a child process on a free port (and stopped after). Each session
is one bidirectional stream sending N frames of synthetic but valid input, one at a time (a frame is sent when
the previous one's reply has arrived, as the frame clock does). Reported: frames per second over all sessions,
per-frame latency p50/p95, and for one session the same frames run on the engine in this process, so the
difference is what the transport costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

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
from services.common.config import VoiceChatConfig
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


def in_process(name: str, model: Path, config: VoiceChatConfig, frames: int, warmup: int) -> dict:
    """The same single-session work on the engine, without gRPC."""
    import mlx.core as mx

    rng = np.random.default_rng(0)
    if name == "perception":
        from services.perception.engine import PerceptionEngine

        stream = PerceptionEngine.load(model).open_stream()
        work = lambda i: stream.push((0.1 * rng.standard_normal(config.input_frame_samples)).astype(np.float32))  # noqa: E731
    elif name == "llm":
        from services.llm.engine import LanguageEngine

        session = LanguageEngine.load(model).open_session("")
        hidden = config.text_config.hidden_size
        work = lambda i: session.step(mx.array(rng.standard_normal(hidden).astype(np.float32)))  # noqa: E731
    elif name == "tts":
        from services.tts.engine import TTSEngine

        engine = TTSEngine.load(model)
        cb = config.tts_config.codebook_size
        prompt = np.random.default_rng(0).integers(0, cb, (engine.prompt_frames, engine.num_quantizers))
        voice = engine.open_session(0, prompt.astype(np.int32), 0)
        work = lambda i: voice.step(int(rng.integers(16, config.text_config.vocab_size)))  # noqa: E731
    else:
        from services.codec.engine import CodecEngine

        decoder = CodecEngine.load(model).open_stream()
        q, cb = config.codec_config.num_quantizers, config.codec_config.codebook_size
        work = lambda i: decoder.decode_frame(i, rng.integers(0, cb, q).astype(np.int32))  # noqa: E731
    latencies = []
    for index in range(frames + warmup):
        start = time.perf_counter()
        work(index)
        if index >= warmup:
            latencies.append((time.perf_counter() - start) * 1000.0)
    return {"latency_p50_ms": percentile(latencies, 0.5), "latency_p95_ms": percentile(latencies, 0.95)}


def prompt_frames(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return speech_pb2_grpc.SpeechServiceStub(channel).Describe(speech_pb2.SpeechDescribeRequest()).prompt_frames


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("service", choices=SERVICES)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint (its config shapes the inputs)")
    parser.add_argument("--address", help="HOST:PORT of a running service (default: start one)")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    config = VoiceChatConfig.load(args.model)
    child = None
    address = args.address
    try:
        if address is None:
            child = spawn_service(args.service, args.model)
            wait_ready([child])
            address = child.address
        load = workload(args.service, config, prompt_frames(address) if args.service == "tts" else 0)
        report = {"service": args.service, "address": address,
                  "grpc": asyncio.run(drive(address, load, args.sessions, args.frames, args.warmup))}
        if args.sessions > 1:
            report["grpc_one_session"] = asyncio.run(drive(address, load, 1, args.frames, args.warmup))
    finally:
        if child is not None:
            stop([child])
    report["in_process_one_session"] = in_process(args.service, args.model, config, args.frames, args.warmup)
    single = report.get("grpc_one_session", report["grpc"])
    report["transport_ms_p50"] = single["latency_p50_ms"] - report["in_process_one_session"]["latency_p50_ms"]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    g = report["grpc"]
    print(f"{args.service} at {address}: {g['sessions']} sessions x {g['frames_per_session']} frames")
    print(f"  throughput       {g['frames_per_second']:8.1f} frames/s")
    print(f"  latency (gRPC)   p50 {g['latency_p50_ms']:7.2f} ms   p95 {g['latency_p95_ms']:7.2f} ms")
    local = report["in_process_one_session"]
    print(f"  in-process, 1    p50 {local['latency_p50_ms']:7.2f} ms   p95 {local['latency_p95_ms']:7.2f} ms")
    print(f"  transport cost   p50 {report['transport_ms_p50']:7.2f} ms per frame (one session)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
