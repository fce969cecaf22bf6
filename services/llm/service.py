"""The gRPC face of the language model: protobuf in, arrays to the engine on its thread, protobuf out.

One Stream call is one session: `open` first (prefills the system prompt), then one `step` per 80 ms frame.
The session's caches are freed when the stream ends, fails or is cancelled. Errors are raised, not caught:
the shared interceptor maps ValueError to INVALID_ARGUMENT and LimitExceeded to RESOURCE_EXHAUSTED. Each step
counts in `metrics` (frames, step time, over budget); open sessions are its active gauge.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import mlx.core as mx

from protos.voicechat.v1 import language_pb2, language_pb2_grpc, snapshot_pb2, tensor_pb2
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
from services.common.engine_thread import EngineThread
from services.common.loading import AS_STORED, LoadOptions
from services.common.metrics import Metrics
from services.common.server import full_service_name
from services.common.snapshot import Marks, Snapshot, flattened, restoring, snapshot_answers, take_snapshot
from services.common.tensors import from_proto, from_proto_np, to_proto
from services.llm.engine import (
    MAX_PROMPT_TOKENS,
    PROMPTS_KEPT,
    AudioRow,
    LanguageEngine,
    LanguageSession,
    StepOutput,
)

SERVICE_NAME = full_service_name(language_pb2, "LanguageService")
# How each stream's prompt prefix enters the model (LanguageOpen.prefix_precision): cast to float32 as in the
# reference's offline turn (the default), or the table's bfloat16 rows as in its streaming session.
PREFIX_DTYPES = {
    language_pb2.PREFIX_PRECISION_UNSPECIFIED: "float32",
    language_pb2.PREFIX_PRECISION_FLOAT32: "float32",
    language_pb2.PREFIX_PRECISION_BFLOAT16: "bfloat16",
}


class LanguageServicer(language_pb2_grpc.LanguageServiceServicer):
    """Serves one LanguageEngine; all its MLX work runs on `engine_thread`."""

    def __init__(self, engine_thread: EngineThread, engine: LanguageEngine | None = None,
                 metrics: Metrics | None = None, batching: BatchOptions | None = None) -> None:
        self.engine_thread = engine_thread
        self._engine = engine
        self.live_sessions = 0  # open Stream sessions (the engine's own count follows once they are closed)
        self._feeding: dict[tuple, asyncio.Event] = {}  # a prompt's key -> set once the session feeding it stops
        self._following = 0  # sessions waiting for another to feed their prompt: no step of theirs is coming
        self.metrics = metrics or Metrics("llm")
        self.metrics.track_sessions(lambda: self.live_sessions)
        self.batcher = StepBatcher.with_options(engine_thread, self._run_steps, batching or BatchOptions(),
                                                on_batch=self.metrics.batch,
                                                sessions=lambda: self.live_sessions - self._following,
                                                key=session_of, reads=is_snapshot)

    @property
    def engine(self) -> LanguageEngine:
        assert self._engine is not None, "calls are gated until load() has finished"
        return self._engine

    async def load(self, model_dir: str | Path, max_prompt_tokens: int = MAX_PROMPT_TOKENS,
                   options: LoadOptions = AS_STORED, prompts_kept: int = PROMPTS_KEPT) -> None:
        """Load the checkpoint's language tensors and tokenizer on the engine thread; the engine keeps the caches
        of the last `prompts_kept` prompts (0: every session feeds its own)."""
        self._engine = await self.engine_thread.run(LanguageEngine.load, model_dir, max_prompt_tokens, options)
        self._engine.prompts_kept = prompts_kept
        await self.batcher.precompile(self._engine.precompile)
        self.metrics.frame_budget_s = self._engine.config.frame_duration

    async def Stream(
        self, request_iterator: AsyncIterator[language_pb2.LanguageStreamRequest], context
    ) -> AsyncIterator[language_pb2.LanguageStreamResponse]:
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("payload") != "open":
            raise ValueError("the first Stream message must be `open` (LanguageOpen)")
        engine = self.engine
        spec = first.open
        if spec.prefix_precision not in PREFIX_DTYPES:
            raise ValueError(f"LanguageOpen.prefix_precision {spec.prefix_precision} is not a known PrefixPrecision")
        snapshot = await restoring(spec.restore, request_iterator)
        session = await self.engine_thread.run(_open, engine, spec, snapshot)
        self.live_sessions += 1
        marks = Marks()  # its last snapshot, which the next may build on
        try:
            await self._feed_prompt(engine, session)
            opened = await self.engine_thread.run(_opened, engine, session)
            yield language_pb2.LanguageStreamResponse(opened=opened)

            async def step(request: language_pb2.LanguageStreamRequest) -> language_pb2.LanguageStreamResponse:
                started = time.perf_counter()
                if request.WhichOneof("payload") == "snapshot":
                    return await snapshot_answers(self.batcher, session, request.snapshot, marks, _snapshot_part)
                if request.WhichOneof("payload") != "step":
                    raise ValueError("after `open`, every Stream message must be a `step` (LanguageStep)")
                if not request.step.HasField("audio_embedding"):
                    raise ValueError("LanguageStep.audio_embedding is missing")
                result = await self.batcher.submit((session, request.step))
                self.metrics.frame(time.perf_counter() - started)
                return language_pb2.LanguageStreamResponse(step=result)

            async for response in flattened(pipelined(request_iterator, step, self.batcher.read_ahead)):
                yield response
        finally:
            # Runs on normal end, error and cancellation alike: the stream owns the session. Queued behind any
            # step still running for it (a step still waiting for its batch is dropped with its cancelled
            # caller); a closed engine thread (shutdown) frees everything anyway.
            self.live_sessions -= 1
            with contextlib.suppress(RuntimeError):
                self.engine_thread.submit(engine.close_session, session)

    async def _feed_prompt(self, engine: LanguageEngine, session: LanguageSession) -> None:
        """Feed the session's pending prompt rows, a row per batch with other sessions' steps and rows: an opening
        session does not hold the engine for its whole prompt, and sessions opening with different prompts feed
        them together. A session opening with a prompt that another one is feeding now waits for it to finish and
        takes copies of the caches it left (the engine keeps them: `prompts_kept`), so a burst of sessions opening
        with one new prompt feeds it once; should that one close first, the next feeds its own."""
        while session.prompt_pending:
            key = session.prompt_key  # None: this session's prompt is not kept (restored, or prompts_kept 0)
            feeding = self._feeding.get(key) if key is not None else None
            if feeding is not None:
                self._following += 1  # a batch does not wait for its steps meanwhile
                try:
                    await feeding.wait()
                finally:
                    self._following -= 1
                await self.engine_thread.run(engine.take_prompted, session)
                continue
            done = asyncio.Event()
            if key is not None:
                self._feeding[key] = done
            try:
                while session.prompt_pending:
                    await self.batcher.submit((session, None))
            finally:
                if key is not None and self._feeding.get(key) is done:
                    del self._feeding[key]
                done.set()

    def _run_steps(self, entries: list[tuple[LanguageSession, language_pb2.LanguageStep | None]]) -> list:
        """The steps of concurrent sessions as one batch, on the engine thread (tensor conversion included: MLX
        work stays on that thread). An entry without a step feeds its session's next prompt row."""
        feeding = [i for i, (_, step) in enumerate(entries) if step is None]
        stepping = [i for i, (_, step) in enumerate(entries) if step is not None]
        results: list = [None] * len(entries)
        if feeding:
            for i, result in zip(feeding, self.engine.prefill_batch([entries[i][0] for i in feeding]), strict=True):
                results[i] = result
        if stepping:
            outs = answer_snapshots([entries[i] for i in stepping], take_snapshot, lambda steps: run_entries(
                steps, _step_arguments, self.engine.step_batch, _step_result))
            for i, result in zip(stepping, outs, strict=True):
                results[i] = result
        return results


def _open(engine: LanguageEngine, spec: language_pb2.LanguageOpen, snapshot: Snapshot | None) -> LanguageSession:
    """Open a session on the engine thread, its prompt rows left to feed (a full-history session feeds them
    here: it never batches), or restored from `snapshot`."""
    return engine.open_session(spec.system_prompt, list(spec.prompt_token_ids), spec.full_history,
                               PREFIX_DTYPES[spec.prefix_precision], prefill=spec.full_history, restore=snapshot)


def _snapshot_part(part: snapshot_pb2.SnapshotPart) -> language_pb2.LanguageStreamResponse:
    return language_pb2.LanguageStreamResponse(snapshot=part)


def _opened(engine: LanguageEngine, session: LanguageSession) -> language_pb2.LanguageOpened:
    """The open reply, once the prompt is fed: the prefix rows it fed."""
    opened = language_pb2.LanguageOpened(prompt_positions=session.prompt_positions, hidden_size=engine.hidden_size)
    if session.prompt_embeds is not None:
        opened.prompt_embeds.CopyFrom(to_proto(session.prompt_embeds.astype(mx.float32)))
    return opened


def _step_arguments(entry: tuple[LanguageSession, language_pb2.LanguageStep]) -> tuple:
    session, step = entry
    if step.HasField("forced_function_token_id"):
        session.force_function(step.forced_function_token_id)
    return session, _audio_row(step.audio_embedding), step.return_logits, step.frame_index


def _audio_row(tensor: tensor_pb2.Tensor) -> AudioRow:
    """A step's audio embedding: float32, as perception sends it, decoded to a numpy row (a batch's rows then
    cross to the device as one array); any other dtype as an MLX array, which the step refuses, naming it."""
    if tensor.dtype == tensor_pb2.DTYPE_FLOAT32:
        return from_proto_np(tensor)
    return from_proto(tensor)


def _step_result(entry: tuple[LanguageSession, language_pb2.LanguageStep], out: StepOutput
                 ) -> language_pb2.LanguageStepResult:
    step = entry[1]
    result = language_pb2.LanguageStepResult(
        frame_index=step.frame_index, text_token_id=out.text_id, function_token_id=out.function_id)
    if out.text_logits is not None:
        result.text_logits.CopyFrom(to_proto(out.text_logits))
        result.function_logits.CopyFrom(to_proto(out.function_logits))
    return result


def build_spec(model_dir: str | Path, max_prompt_tokens: int = MAX_PROMPT_TOKENS,
               batching: BatchOptions | None = None, options: LoadOptions = AS_STORED,
               prompts_kept: int = PROMPTS_KEPT) -> ServiceSpec:
    """The servicer, its name and its loader, for `run_service` or a test's `serve`."""
    engine_thread = EngineThread(name="llm-engine")
    servicer = LanguageServicer(engine_thread, batching=batching)
    return ServiceSpec(
        registrations=[(language_pb2_grpc.add_LanguageServiceServicer_to_server, servicer)],
        service_names=[SERVICE_NAME],
        load=lambda: servicer.load(model_dir, max_prompt_tokens, options, prompts_kept),
        close=engine_thread.close,
        metrics=servicer.metrics,
    )
