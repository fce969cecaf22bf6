"""The gRPC face of the codec: protobuf in, numpy to the engine on its thread, protobuf out.

Errors are raised, not caught: the shared interceptor turns ValueError into INVALID_ARGUMENT and
LimitExceeded into RESOURCE_EXHAUSTED. One DecodeStream call is one decode session; its state dies with it.
Each decoded frame counts in `metrics` (frames, step time, over budget); open sessions are its active gauge.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from protos.voicechat.v1 import codec_pb2, codec_pb2_grpc, snapshot_pb2
from services.codec.engine import DEFAULT_MAX_FRAMES, CodecEngine, DecodeStream
from services.common.batching import (
    BatchOptions,
    StepBatcher,
    answer_snapshots,
    is_snapshot,
    pipelined,
    run_entries,
    session_of,
)
from services.common.cli import ServiceSpec
from services.common.config import VoiceChatConfig
from services.common.engine_thread import EngineThread
from services.common.metrics import Metrics
from services.common.server import full_service_name
from services.common.snapshot import Marks, flattened, restoring, snapshot_answers, take_snapshot
from services.common.tensors import from_proto_np, to_proto_np

SERVICE_NAME = full_service_name(codec_pb2, "CodecService")


class CodecServicer(codec_pb2_grpc.CodecServiceServicer):
    """Serves one CodecEngine; all its MLX work runs on `engine_thread`."""

    def __init__(self, engine_thread: EngineThread, engine: CodecEngine | None = None,
                 metrics: Metrics | None = None, batching: BatchOptions | None = None):
        self.engine_thread = engine_thread
        self._engine = engine
        self.live_sessions = 0  # open DecodeStream sessions
        self.metrics = metrics or Metrics("codec")
        self.metrics.track_sessions(lambda: self.live_sessions)
        self.batcher = StepBatcher.with_options(engine_thread, self._decode_frames, batching or BatchOptions(),
                                                on_batch=self.metrics.batch, sessions=lambda: self.live_sessions,
                                                key=session_of, reads=is_snapshot)

    @property
    def engine(self) -> CodecEngine:
        assert self._engine is not None, "calls are gated until load() has finished"
        return self._engine

    async def load(self, model_dir: str | Path, max_frames: int = DEFAULT_MAX_FRAMES) -> None:
        """Load the checkpoint's codec tensors on the engine thread."""
        self._engine = await self.engine_thread.run(CodecEngine.load, model_dir, max_frames)
        await self.batcher.precompile(self._engine.precompile)
        self.metrics.frame_budget_s = VoiceChatConfig.load(model_dir).frame_duration

    async def Encode(self, request: codec_pb2.CodecEncodeRequest, context) -> codec_pb2.CodecEncodeResponse:
        rate = request.sample_rate_hz
        if rate not in (0, self.engine.sample_rate):
            raise ValueError(f"sample_rate_hz {rate} is not the codec's rate {self.engine.sample_rate}; resample first")
        waveform = from_proto_np(request.waveform)
        codes = await self.engine_thread.run(self.engine.encode, waveform)
        return codec_pb2.CodecEncodeResponse(codes=to_proto_np(codes))

    async def Decode(self, request: codec_pb2.CodecDecodeRequest, context) -> codec_pb2.CodecDecodeResponse:
        codes = from_proto_np(request.codes)
        waveform = await self.engine_thread.run(self.engine.decode, codes)
        return codec_pb2.CodecDecodeResponse(waveform=to_proto_np(waveform), sample_rate_hz=self.engine.sample_rate)

    async def PromptCodes(self, request: codec_pb2.PromptCodesRequest, context) -> codec_pb2.PromptCodesResponse:
        codes = await self.engine_thread.run(self.engine.encode_prompt_codes, request.frames)
        return codec_pb2.PromptCodesResponse(codes=to_proto_np(codes))

    async def DecodeStream(
        self, request_iterator: AsyncIterator[codec_pb2.CodecDecodeStreamRequest], context
    ) -> AsyncIterator[codec_pb2.CodecDecodeStreamResponse]:
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("payload") != "open":
            raise ValueError("the first DecodeStream message must be `open`")
        engine = self.engine
        snapshot = await restoring(first.open.restore, request_iterator)
        if snapshot is None:
            stream = engine.open_stream()
        else:
            stream = await self.engine_thread.run(DecodeStream.restored, engine, snapshot)
        self.live_sessions += 1
        marks = Marks()  # its last snapshot, which the next may build on
        try:
            yield codec_pb2.CodecDecodeStreamResponse(
                opened=codec_pb2.CodecDecodeOpened(
                    samples_per_frame=engine.samples_per_frame, sample_rate_hz=engine.sample_rate
                )
            )

            async def decode(request: codec_pb2.CodecDecodeStreamRequest) -> codec_pb2.CodecDecodeStreamResponse:
                started = time.perf_counter()
                if request.WhichOneof("payload") == "snapshot":
                    return await snapshot_answers(self.batcher, stream, request.snapshot, marks, _snapshot_part)
                if request.WhichOneof("payload") != "frame":
                    raise ValueError("after `open`, every DecodeStream message must be a `frame`")
                response = await self.batcher.submit((stream, request.frame))
                self.metrics.frame(time.perf_counter() - started)
                return response

            async for response in flattened(pipelined(request_iterator, decode, self.batcher.read_ahead)):
                yield response
        finally:
            self.live_sessions -= 1

    def _decode_frames(self, entries: list[tuple[DecodeStream, codec_pb2.CodecDecodeFrameInput]]) -> list:
        """Concurrent streams' frames as one batch, on the engine thread."""
        return answer_snapshots(entries, take_snapshot, lambda frames: run_entries(
            frames, _decode_arguments, self.engine.decode_batch, _decoded_response))


def _snapshot_part(part: snapshot_pb2.SnapshotPart) -> codec_pb2.CodecDecodeStreamResponse:
    return codec_pb2.CodecDecodeStreamResponse(snapshot=part)


def _decode_arguments(entry: tuple[DecodeStream, codec_pb2.CodecDecodeFrameInput]) -> tuple:
    stream, frame = entry
    return stream, frame.frame_index, from_proto_np(frame.codes)


def _decoded_response(entry: tuple[DecodeStream, codec_pb2.CodecDecodeFrameInput], samples: np.ndarray
                      ) -> codec_pb2.CodecDecodeStreamResponse:
    return codec_pb2.CodecDecodeStreamResponse(
        frame=codec_pb2.CodecDecodedFrame(frame_index=entry[1].frame_index, samples=to_proto_np(samples)))


def build_spec(model_dir: str | Path, max_frames: int = DEFAULT_MAX_FRAMES,
               batching: BatchOptions | None = None) -> ServiceSpec:
    """The servicer, its name and its loader, for `run_service` or a test's `serve`."""
    engine_thread = EngineThread(name="codec-engine")
    servicer = CodecServicer(engine_thread, batching=batching)
    return ServiceSpec(
        registrations=[(codec_pb2_grpc.add_CodecServiceServicer_to_server, servicer)],
        service_names=[SERVICE_NAME],
        load=lambda: servicer.load(model_dir, max_frames),
        close=engine_thread.close,
        metrics=servicer.metrics,
    )
