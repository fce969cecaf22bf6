"""The SpeechService servicer: one bidirectional stream per TTS session, all MLX work on the engine thread.

Stream protocol: SpeechOpen (seed, prompt_codes (frames, 31) int32 from the codec service, prefix_steps)
answered by SpeechOpened; then one SpeechStep per frame answered by SpeechStepResult (raw and clean codes).
The stream's end drops the session and its caches. Each step counts in `metrics` (frames, step time, over
budget); open sessions are its active gauge.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from protos.voicechat.v1 import snapshot_pb2, speech_pb2, speech_pb2_grpc
from services.common.batching import BatchOptions, StepBatcher, answer_snapshots, is_snapshot, pipelined, session_of
from services.common.engine_thread import EngineThread
from services.common.errors import ServiceUnavailable
from services.common.loading import AS_STORED, LoadOptions
from services.common.metrics import Metrics
from services.common.server import full_service_name
from services.common.snapshot import Marks, flattened, restoring, snapshot_answers, take_snapshot
from services.common.tensors import from_proto_np, to_proto_np
from services.tts.engine import DEFAULT_MAX_PREFIX_STEPS, TTSEngine, TTSSession

SERVICE_NAME = full_service_name(speech_pb2, "SpeechService")


class SpeechServicer(speech_pb2_grpc.SpeechServiceServicer):
    def __init__(self, engine_thread: EngineThread, engine: TTSEngine | None = None,
                 metrics: Metrics | None = None, batching: BatchOptions | None = None):
        self.engine_thread = engine_thread
        self.engine = engine
        self.live_sessions = 0  # open Stream sessions
        self.metrics = metrics or Metrics("tts")
        self.metrics.track_sessions(lambda: self.live_sessions)
        self.batcher = StepBatcher.with_options(engine_thread, self._run_steps, batching or BatchOptions(),
                                                on_batch=self.metrics.batch, sessions=lambda: self.live_sessions,
                                                key=session_of, reads=is_snapshot)

    async def load(self, model_dir: str | Path, options: LoadOptions = AS_STORED,
                   max_prefix_steps: int = DEFAULT_MAX_PREFIX_STEPS) -> None:
        self.engine = await self.engine_thread.run(TTSEngine.load, model_dir, options, max_prefix_steps)
        await self.batcher.precompile(self.engine.precompile)
        self.metrics.frame_budget_s = self.engine.config.frame_duration

    async def Describe(
        self, request: speech_pb2.SpeechDescribeRequest, context: grpc.aio.ServicerContext
    ) -> speech_pb2.SpeechDescribeResponse:
        if self.engine is None:
            raise ServiceUnavailable("the TTS model is still loading")
        engine = self.engine
        return await self.engine_thread.run(lambda: speech_pb2.SpeechDescribeResponse(
            prompt_frames=engine.prompt_frames,
            num_quantizers=engine.num_quantizers,
            codebook_size=engine.config.tts_config.codebook_size,
            control_codes=[int(c) for c in engine.control_codes.tolist()],
            silence_codes=[int(c) for c in engine.silence_codes.tolist()],
        ))

    async def Stream(
        self, request_iterator: AsyncIterator[speech_pb2.SpeechStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[speech_pb2.SpeechStreamResponse]:
        if self.engine is None:
            raise ServiceUnavailable("the TTS model is still loading")
        first = await anext(request_iterator, None)
        if first is None:
            return
        if first.WhichOneof("payload") != "open":
            raise ValueError("the first SpeechStream message must be `open` (SpeechOpen)")
        opening = first.open
        snapshot = await restoring(opening.restore, request_iterator)
        if snapshot is None and not opening.HasField("prompt_codes"):
            raise ValueError(f"SpeechOpen.prompt_codes is required: the codec's ({self.engine.prompt_frames}, "
                             f"{self.engine.num_quantizers}) int32 warm-up codes")
        engine = self.engine
        engine.check_prefix_steps(opening.prefix_steps)
        if snapshot is None:
            session = await self.engine_thread.run(engine.open_session, opening.seed,
                                                   from_proto_np(opening.prompt_codes), 0)
        else:
            session = await self.engine_thread.run(TTSSession.restored, engine, snapshot)
        self.live_sessions += 1
        marks = Marks()  # its last snapshot, which the next may build on
        try:
            # The prefix's pad steps go through the batcher like any step: an opening session does not hold the
            # engine for its whole prefix, and sessions opening together run theirs together.
            for _ in range(0 if snapshot is not None else opening.prefix_steps):
                await self.batcher.submit((session, engine.config.pad_token_id))
            yield speech_pb2.SpeechStreamResponse(
                opened=speech_pb2.SpeechOpened(prompt_frames=self.engine.prompt_frames))
            expected: int | None = None  # counted as steps are accepted: the next may queue while one runs

            async def speak(request: speech_pb2.SpeechStreamRequest) -> speech_pb2.SpeechStreamResponse:
                nonlocal expected
                started = time.perf_counter()
                if request.WhichOneof("payload") == "snapshot":
                    return await snapshot_answers(self.batcher, session, request.snapshot, marks, _snapshot_part)
                if request.WhichOneof("payload") != "step":
                    raise ValueError("after `open`, every SpeechStream message must be a `step`")
                step = request.step
                if step.frame_index < 0 or (expected is not None and step.frame_index != expected):
                    want = "a non-negative index" if expected is None else str(expected)
                    raise ValueError(f"SpeechStep.frame_index {step.frame_index}: expected {want}")
                expected = step.frame_index + 1
                raw, clean = await self.batcher.submit((session, step.text_token_id))
                response = speech_pb2.SpeechStreamResponse(step=speech_pb2.SpeechStepResult(
                    frame_index=step.frame_index, codes=to_proto_np(raw), clean_codes=to_proto_np(clean)))
                self.metrics.frame(time.perf_counter() - started)
                return response

            async for response in flattened(pipelined(request_iterator, speak, self.batcher.read_ahead)):
                yield response
        finally:
            self.live_sessions -= 1

    def _run_steps(self, entries: list[tuple[TTSSession, int]]) -> list:
        """Concurrent sessions' steps as one batch, on the engine thread."""
        assert self.engine is not None
        return answer_snapshots(entries, take_snapshot, self.engine.step_batch)


def _snapshot_part(part: snapshot_pb2.SnapshotPart) -> speech_pb2.SpeechStreamResponse:
    return speech_pb2.SpeechStreamResponse(snapshot=part)
