"""The perception gRPC servicer: protobuf in, engine calls on the engine thread, protobuf out.

Bad input raises ValueError, which the shared interceptor turns into INVALID_ARGUMENT with the message.
A Stream's session lives exactly as long as its stream: its state is a local of the handler. Each frame counts
in `metrics` (frames, step time, over budget); open sessions are its active gauge.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from protos.voicechat.v1 import perception_pb2, perception_pb2_grpc, snapshot_pb2
from services.common.batching import (
    BatchOptions,
    StepBatcher,
    answer_snapshots,
    is_snapshot,
    pipelined,
    run_entries,
    session_of,
)
from services.common.engine_thread import EngineThread
from services.common.errors import ServiceUnavailable
from services.common.loading import AS_STORED, LoadOptions
from services.common.metrics import Metrics
from services.common.server import Registration, full_service_name
from services.common.snapshot import Marks, flattened, restoring, snapshot_answers, take_snapshot
from services.common.tensors import from_proto_np, to_proto
from services.perception.engine import PerceptionEngine, PerceptionStream, StreamFrame

SERVICE_NAME = full_service_name(perception_pb2, "PerceptionService")


class PerceptionServicer(perception_pb2_grpc.PerceptionServiceServicer):
    def __init__(self, engine_thread: EngineThread, engine: PerceptionEngine | None = None,
                 metrics: Metrics | None = None, batching: BatchOptions | None = None):
        self.engine_thread = engine_thread
        self._engine = engine
        self.live_sessions = 0  # open Stream sessions
        self.metrics = metrics or Metrics("perception")
        self.metrics.track_sessions(lambda: self.live_sessions)
        self.batcher = StepBatcher.with_options(engine_thread, self._push_frames, batching or BatchOptions(),
                                                on_batch=self.metrics.batch, sessions=lambda: self.live_sessions,
                                                key=session_of, reads=is_snapshot)

    async def load(self, model_dir: str | Path, options: LoadOptions = AS_STORED) -> None:
        """Load the weights on the engine thread (health says NOT_SERVING meanwhile)."""
        self._engine = await self.engine_thread.run(PerceptionEngine.load, model_dir, options)
        await self.batcher.precompile(self._engine.precompile)
        self.metrics.frame_budget_s = self._engine.config.frame_duration

    @property
    def engine(self) -> PerceptionEngine:
        if self._engine is None:
            raise ServiceUnavailable("the perception model is not loaded yet")
        return self._engine

    def _check_rate(self, sample_rate_hz: int) -> None:
        expected = self.engine.sample_rate
        if sample_rate_hz != expected:
            raise ValueError(f"sample_rate_hz must be {expected}, got {sample_rate_hz}; resample the audio first")

    async def Encode(self, request: perception_pb2.EncodeRequest, context) -> perception_pb2.EncodeResponse:
        self._check_rate(request.sample_rate_hz)
        if not request.HasField("waveform"):
            raise ValueError("EncodeRequest.waveform is missing")
        return await self.engine_thread.run(_encode, self.engine, from_proto_np(request.waveform))

    async def Stream(
        self, request_iterator: AsyncIterator[perception_pb2.PerceptionStreamRequest], context
    ) -> AsyncIterator[perception_pb2.PerceptionStreamResponse]:
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("payload") != "open":
            kind = "nothing" if first is None else (first.WhichOneof("payload") or "an empty message")
            raise ValueError(f"the first Stream message must be `open`, got {kind}")
        self._check_rate(first.open.sample_rate_hz)
        engine = self.engine
        snapshot = await restoring(first.open.restore, request_iterator)
        if snapshot is None:
            stream = await self.engine_thread.run(engine.open_stream)
        else:
            stream = await self.engine_thread.run(PerceptionStream.restored, engine, snapshot)
        self.live_sessions += 1
        marks = Marks()  # its last snapshot, which the next may build on
        try:
            yield perception_pb2.PerceptionStreamResponse(
                opened=perception_pb2.PerceptionOpened(frame_samples=engine.frame_samples,
                                                       embedding_dim=engine.embedding_dim)
            )
            expected = stream.frame_index  # counted as frames are accepted: the next may queue while one runs

            async def push(request: perception_pb2.PerceptionStreamRequest) -> perception_pb2.PerceptionStreamResponse:
                nonlocal expected
                started = time.perf_counter()
                if request.WhichOneof("payload") == "snapshot":
                    return await snapshot_answers(self.batcher, stream, request.snapshot, marks, _snapshot_part)
                if request.WhichOneof("payload") != "frame":
                    raise ValueError(f"after `open` every Stream message must be `frame`, got "
                                     f"{request.WhichOneof('payload') or 'an empty message'}")
                frame = request.frame
                if frame.frame_index != expected:
                    raise ValueError(f"frame_index {frame.frame_index} out of order; expected {expected}")
                if not frame.HasField("samples"):
                    raise ValueError(f"frame {frame.frame_index} has no samples")
                expected += 1
                response = await self.batcher.submit((stream, frame))
                self.metrics.frame(time.perf_counter() - started)
                return response

            async for response in flattened(pipelined(request_iterator, push, self.batcher.read_ahead)):
                yield response
        finally:
            self.live_sessions -= 1

    def _push_frames(self, entries: list[tuple[PerceptionStream, perception_pb2.PerceptionFrameInput]]) -> list:
        """Concurrent streams' frames as one batch, on the engine thread."""
        return answer_snapshots(entries, take_snapshot, lambda frames: run_entries(
            frames, _push_arguments, self.engine.push_batch, _frame_response))


# These run on the engine thread: reading an MLX array's bytes evaluates it, which must happen there.
def _encode(engine: PerceptionEngine, waveform: np.ndarray) -> perception_pb2.EncodeResponse:
    result = engine.encode(waveform)
    return perception_pb2.EncodeResponse(
        mel=to_proto(result.mel),
        encoder_output=to_proto(result.encoder_out),
        audio_embeds=to_proto(result.audio_embeds),
        transcript=result.transcript,
        transcript_token_ids=result.token_ids,
        frames=result.encoder_out.shape[0],
    )


def _snapshot_part(part: snapshot_pb2.SnapshotPart) -> perception_pb2.PerceptionStreamResponse:
    return perception_pb2.PerceptionStreamResponse(snapshot=part)


def _push_arguments(entry: tuple[PerceptionStream, perception_pb2.PerceptionFrameInput]
                    ) -> tuple[PerceptionStream, np.ndarray]:
    stream, frame = entry
    return stream, from_proto_np(frame.samples)


def _frame_response(entry: tuple, out: StreamFrame) -> perception_pb2.PerceptionStreamResponse:
    return perception_pb2.PerceptionStreamResponse(
        frame=perception_pb2.PerceptionFrame(
            frame_index=out.frame_index,
            audio_embedding=to_proto(out.audio_embedding),
            encoder_output=to_proto(out.encoder_out),
            transcript_delta=out.transcript_delta,  # the deltas sum to the transcript: it is not sent every frame
            token_ids=out.token_ids,
        )
    )


def registrations(servicer: PerceptionServicer) -> list[Registration]:
    return [(perception_pb2_grpc.add_PerceptionServiceServicer_to_server, servicer)]
