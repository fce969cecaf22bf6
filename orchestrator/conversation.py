"""The orchestrator's own gRPC service: one bidirectional Converse stream per conversation.

    client -> Configure, AudioIn..., Flush (or Cancel), then half-close
    server <- SessionReady, TranscriptDelta / TextDelta / AudioOut ... in frame order, Done (or Cancelled)

Configure.tools declares functions: their calls come as FunctionCallDelta / FunctionCallDone, the client answers
with FunctionCallOutput (FunctionCallOutputAdded confirms it), a malformed call is an INVALID_FUNCTION_CALL
Error and the conversation goes on (orchestrator/tools.py; `runner`'s tools are the server's own).

Each stream owns one OnlineSession (its own stream on every network service), so conversations are isolated;
at most `max_sessions` run at once (SERVER_BUSY beyond). Bad input (a wrong rate, non-finite samples, audio
after Flush) is answered with an INVALID_REQUEST Error and the conversation goes on; running past
max_streaming_seconds (LIMIT_EXCEEDED) or a failed service (SERVICE_UNAVAILABLE, INFERENCE_ERROR) ends it with
that Error. A message that does not parse ends it with an INVALID_REQUEST Error and status INVALID_ARGUMENT.
However a stream ends (Done, error, or a client that vanished) every service session is freed, and its slot is
free at once (the sessions close in the background).

Audio sent ahead of real time, or a client slower to take its answers than the server makes them, is held back:
while `max_queued_frames` frames of a conversation are in its pipeline or waiting to be sent, no more of its
audio is read (gRPC's flow control then slows the client's sends), so neither its input nor its answers pile up
in the server's memory however long the conversation.

`metrics` (voicechat_*{service="orchestrator"}) sees the conversations holding a slot, every frame whose events
went out (timed by the session's frame interval, and by its LatencyTracker against the live schedule from the first
AudioIn's arrival) and every Error sent, by its ERROR_CODE_* name.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from orchestrator.admission import BUSY, UNAVAILABLE, Admission, Refusal, Slot
from orchestrator.clients import ServiceError
from orchestrator.latency import LatencyTracker
from orchestrator.session import MAX_FRAMES_AHEAD, ContextLimitError, Event, OnlineSession, transcript_vocabulary
from orchestrator.stream_clients import StreamClients
from orchestrator.supervisor import Supervisor
from orchestrator.text import TextDecoder
from orchestrator.tools import Tool, parse_tools
from protos.voicechat.v1 import conversation_pb2 as pb
from protos.voicechat.v1 import conversation_pb2_grpc
from services.common.cli import announce
from services.common.config import VoiceChatConfig
from services.common.metrics import Metrics, MetricsServer
from services.common.metrics import announce as announce_metrics
from services.common.security import Tls
from services.common.server import DEFAULT_GRACE_S, RunningServer, full_service_name, serve
from services.common.tensors import from_proto_np, to_proto_np

log = logging.getLogger(__name__)
SERVICE_NAME = full_service_name(pb, "ConversationService")
TERMINAL_HOLD_S = 1.0  # how long Done/Cancelled waits for the client to half-close (errors for late messages)
MAX_QUEUED_FRAMES = MAX_FRAMES_AHEAD  # frames in a conversation's pipeline or waiting for its client; then audio waits
_READER_DONE = object()


class Outbox:
    """One conversation's answers on their way to its client, in order: events (put from the session's threads
    through the loop), errors and the reader's end. The reader tells it how many frames it pushed into the
    session; `room()` waits while `limit` of them are not yet out (in the pipeline or waiting here)."""

    def __init__(self, limit: int = MAX_QUEUED_FRAMES):
        self.limit = limit
        self.pushed = 0  # frames of input the session was given
        self.taken = 0  # frames whose audio event was taken to be sent
        self._items: asyncio.Queue = asyncio.Queue()
        self._took = asyncio.Event()

    @property
    def frames(self) -> int:
        """Frames pushed and not yet out."""
        return self.pushed - self.taken

    def put_nowait(self, item) -> None:
        self._items.put_nowait(item)

    async def get(self):
        item = await self._items.get()
        if isinstance(item, Event) and item.kind == "audio":
            self.taken += 1
            self._took.set()
        return item

    def empty(self) -> bool:
        return self._items.empty()

    async def room(self) -> None:
        """Until fewer than `limit` frames are pushed and not yet out."""
        while self.frames >= self.limit:
            self._took.clear()
            await self._took.wait()


class _Fatal(Exception):
    """An Error that ends the conversation; with `status` the stream then ends with that status, not OK."""

    def __init__(self, code: int, message: str, status: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code
        self.status = status


def _error(code: int, message: str) -> pb.ConverseResponse:
    return pb.ConverseResponse(error=pb.Error(code=code, message=message))


def event_to_proto(event: Event, sample_rate_hz: int) -> pb.ConverseResponse:
    kind = event.kind
    if kind == "user_transcript_delta":
        return pb.ConverseResponse(transcript=pb.TranscriptDelta(
            frame_index=event.frame_index, delta=event.delta, transcript=event.text,
            transcript_start=event.text_start))  # 0 (the whole text) stays off the wire
    if kind in ("assistant_text_delta", "function_delta"):
        delta = pb.TextDelta(frame_index=event.frame_index, token_id=event.token_id, delta=event.delta,
                             text=event.text, text_start=event.text_start)
        return pb.ConverseResponse(text=delta) if kind == "assistant_text_delta" else pb.ConverseResponse(
            function=delta)
    if kind == "audio":
        return pb.ConverseResponse(audio=pb.AudioOut(
            frame_index=event.frame_index, samples=to_proto_np(event.samples.astype(np.float32)),
            audio_codes=event.audio_codes.tolist(), raw_codes=event.raw_codes.tolist(), sample_rate_hz=sample_rate_hz))
    if kind == "function_call_delta":
        return pb.ConverseResponse(function_call_delta=pb.FunctionCallDelta(
            frame_index=event.frame_index, call_id=event.call_id, delta=event.delta))
    if kind == "function_call_done":
        return pb.ConverseResponse(function_call_done=pb.FunctionCallDone(
            frame_index=event.frame_index, call_id=event.call_id, name=event.name, arguments=event.arguments))
    if kind == "function_call_output":
        return pb.ConverseResponse(function_call_output=pb.FunctionCallOutputAdded(
            frame_index=event.frame_index, call_id=event.call_id, name=event.name, output=event.output))
    if kind == "function_call_error":
        return _error(pb.ERROR_CODE_INVALID_FUNCTION_CALL, event.message)
    if kind == "done":
        return pb.ConverseResponse(done=pb.Done(frame_index=event.frame_index))
    if kind == "cancelled":
        return pb.ConverseResponse(cancelled=pb.Cancelled(frame_index=event.frame_index))
    raise ValueError(f"no message for event kind {kind!r}")


def audio_samples(audio: pb.AudioIn, rate_hz: int) -> np.ndarray:
    """An AudioIn chunk as float32 (N,); ValueError naming what is wrong."""
    if audio.sample_rate_hz not in (0, rate_hz):
        raise ValueError(f"AudioIn.sample_rate_hz {audio.sample_rate_hz}: this conversation takes {rate_hz} Hz "
                         "audio; resample first")
    which = audio.WhichOneof("samples")
    if which == "pcm16":
        if len(audio.pcm16) % 2:
            raise ValueError(f"AudioIn.pcm16 has {len(audio.pcm16)} bytes; PCM16 needs an even count")
        return np.frombuffer(audio.pcm16, dtype="<i2").astype(np.float32) / 32768.0
    if which == "float32":
        samples = from_proto_np(audio.float32)
        if samples.dtype != np.float32 or samples.ndim != 1:
            raise ValueError(f"AudioIn.float32 must be float32 of shape (N,), got {samples.dtype} {samples.shape}")
        return samples
    raise ValueError("AudioIn carries no samples (set pcm16 or float32)")


def configured_tools(spec: pb.Configure) -> tuple[list[Tool], str]:
    """Configure's tools and tool choice ("auto" or "none"); ValueError naming the field."""
    declared = []
    for i, tool in enumerate(spec.tools):
        try:
            parameters = json.loads(tool.parameters_json) if tool.parameters_json else None
        except ValueError as exc:
            raise ValueError(f"Configure.tools[{i}].parameters_json is not JSON ({exc})") from None
        declared.append({"type": "function", "name": tool.name, "description": tool.description,
                         **({"parameters": parameters} if parameters is not None else {})})
    choice = "none" if spec.tool_choice == pb.TOOL_CHOICE_NONE else "auto"
    return parse_tools(declared, "Configure.tools"), choice


class ConversationServicer(conversation_pb2_grpc.ConversationServiceServicer):
    def __init__(self, clients: StreamClients, model_dir: str | Path, *, max_sessions: int = 4,
                 max_streaming_seconds: float = 600.0, pipelined: bool = True, metrics: Metrics | None = None,
                 runner=None, ticker=None, max_queued_frames: int = MAX_QUEUED_FRAMES, text_window: int | None = None):
        self.clients = clients
        self.runner = runner  # a ToolRunner: the server's own tools, declared in every conversation
        self.ticker = ticker  # a FrameTicker shared by the conversations (--frame-tick-ms), or None
        self.config = VoiceChatConfig.load(model_dir)
        self.metrics = metrics or Metrics("orchestrator")
        self.metrics.frame_budget_s = self.config.frame_duration
        self.decoder = TextDecoder(model_dir, self.config)
        self.vocabulary = transcript_vocabulary(model_dir, self.config)
        self.admission = Admission(max_sessions)
        self.max_streaming_seconds = max_streaming_seconds
        self.pipelined = pipelined
        self.text_window = text_window  # each session's (OnlineSession): None keeps every text event whole
        if max_queued_frames < 1:
            raise ValueError(f"max_queued_frames must be at least 1, got {max_queued_frames}")
        self.max_queued_frames = max_queued_frames  # a conversation's frames pushed and not yet out (module)
        self._outboxes: set[Outbox] = set()  # the live conversations' answers on their way out
        self.metrics.track_sessions(lambda: self.admission.live)
        self.metrics.track_queued(lambda: self.queued_frames)
        self._ids = itertools.count(1)

    def prime(self) -> None:
        """Open one conversation with the defaults and close it, before the first client's: what a first opening
        builds in the services (the codec's encoding of the speaker prompt, speech's warm-up on it, and on a GPU
        the kernels of each) is then built at start, not while the first conversations wait. A failure is
        logged, and the first conversation meets it as it would have."""
        try:
            OnlineSession(self.clients, self.config, self.decoder, pipelined=False,
                          rnnt_vocabulary=self.vocabulary).close()
        except (ServiceError, ValueError) as exc:
            log.warning("opening a first conversation at start failed: %s", exc)

    @property
    def live_sessions(self) -> int:
        """Conversations holding a slot (their service sessions open or closing)."""
        return self.admission.live

    @property
    def max_sessions(self) -> int:
        return self.admission.max_sessions

    @max_sessions.setter
    def max_sessions(self, value: int) -> None:
        self.admission.max_sessions = value

    def _configured(self, spec: pb.Configure) -> tuple[float, list[Tool], str]:
        """A Configure's (max_streaming_seconds, tools, tool_choice); ValueError naming a field not accepted."""
        if spec.sample_rate_hz not in (0, self.config.input_sample_rate):
            raise ValueError(f"Configure.sample_rate_hz {spec.sample_rate_hz}: only "
                             f"{self.config.input_sample_rate} Hz is accepted")
        return (self._seconds(spec.max_streaming_seconds), *configured_tools(spec))

    def _seconds(self, requested: float) -> float:
        if not requested >= 0:  # NaN too
            raise ValueError(f"Configure.max_streaming_seconds {requested} must be >= 0 (0 = the server's limit)")
        return self.max_streaming_seconds if requested == 0 else min(requested, self.max_streaming_seconds)

    async def Converse(self, request_iterator: AsyncIterator[pb.ConverseRequest],
                       context) -> AsyncIterator[pb.ConverseResponse]:
        """The conversation, each Error it sends counted by code."""
        try:
            async with contextlib.aclosing(self._converse(request_iterator, context)) as responses:
                async for response in responses:
                    if response.WhichOneof("event") == "error":
                        self.metrics.error(pb.ErrorCode.Name(response.error.code))
                    yield response
        except _Fatal as fatal:  # its Error event went out (and was counted): the status says it again
            await context.abort(fatal.status, str(fatal))

    async def _converse(self, request_iterator: AsyncIterator[pb.ConverseRequest],
                        context) -> AsyncIterator[pb.ConverseResponse]:
        loop = asyncio.get_running_loop()
        out = Outbox(self.max_queued_frames)
        session: OnlineSession | None = None
        slot: Slot | None = None
        reader: asyncio.Task | None = None
        timing = LatencyTracker(self.config.frame_duration, self.metrics.latency_budget_s, metrics=self.metrics)

        def deliver(event: Event) -> None:
            loop.call_soon_threadsafe(out.put_nowait, event)

        try:
            while session is None:  # Configure (again after SESSION_INITIALIZATION_FAILED)
                request = await anext(request_iterator, None)
                if request is None:
                    return
                kind = request.WhichOneof("message")
                if kind != "configure":
                    yield _error(pb.ERROR_CODE_INVALID_REQUEST,
                                 f"the first message must be `configure`, got {kind or 'an empty message'}")
                    continue
                spec = request.configure
                try:
                    seconds, tools, tool_choice = self._configured(spec)
                except ValueError as exc:
                    yield _error(pb.ERROR_CODE_SESSION_INITIALIZATION_FAILED, str(exc))
                    continue
                slot = self.admission.try_admit()
                if isinstance(slot, Refusal):
                    yield self._refused(slot)
                    return
                try:
                    session = await asyncio.to_thread(
                        OnlineSession, self.clients, self.config, self.decoder,
                        system_prompt=spec.system_prompt or None, seed=spec.seed, max_streaming_seconds=seconds,
                        pipelined=self.pipelined, on_event=deliver, rnnt_vocabulary=self.vocabulary, tools=tools,
                        tool_choice=tool_choice, runner=self.runner, ticker=self.ticker, text_window=self.text_window)
                except ServiceError as exc:
                    if not exc.refused_input:  # a service down or failing: this conversation cannot go on
                        yield _error(pb.ERROR_CODE_SERVICE_UNAVAILABLE, str(exc))
                        return
                    slot.release()  # e.g. a prompt past the language service's limit: Configure again
                    yield _error(pb.ERROR_CODE_SESSION_INITIALIZATION_FAILED, str(exc))
                    continue
                except ValueError as exc:
                    slot.release()
                    yield _error(pb.ERROR_CODE_SESSION_INITIALIZATION_FAILED, str(exc))
                    continue
            driving = threading.Lock()  # one session call at a time; close waits for a call in flight

            def drive(method, *args):
                with driving:
                    return method(*args)

            yield pb.ConverseResponse(ready=pb.SessionReady(
                session_id=f"conversation-{next(self._ids)}", frame_samples=session.frame_samples,
                output_sample_rate_hz=self.config.output_sample_rate,
                input_sample_rate_hz=self.config.input_sample_rate))
            self._outboxes.add(out)
            reader = asyncio.create_task(self._read(request_iterator, session, drive, out, timing))
            async for message in self._write(session, out, reader, timing):
                yield message
        finally:
            timing.close()
            self._outboxes.discard(out)
            if reader is not None:
                reader.cancel()
            if session is not None:  # freed behind a call in flight, which may take frames to return
                loop.run_in_executor(None, drive, session.close)
            if isinstance(slot, Slot):  # at once: a client that reconnects right away finds its slot free
                slot.release()

    def _refused(self, refusal: Refusal) -> pb.ConverseResponse:
        """The Error that ends a conversation the admission refused."""
        if refusal.kind == BUSY:
            return _error(pb.ERROR_CODE_SERVER_BUSY,
                          f"all {self.max_sessions} conversation slots are taken; try again later")
        if refusal.kind == UNAVAILABLE:
            return _error(pb.ERROR_CODE_SERVICE_UNAVAILABLE, f"{refusal.detail}; try again shortly")
        return _error(pb.ERROR_CODE_SERVICE_UNAVAILABLE,
                      "this server is shutting down; open the conversation on another instance")

    async def drain(self, grace_s: float) -> None:
        """Shutting down: refuse new conversations, give the running ones `grace_s` seconds to end, then end
        each that is left with a SERVICE_UNAVAILABLE error saying so, and wait (briefly) for their sessions."""
        self.admission.drain()
        log.info("draining: %d conversation(s) running, %.1f s grace", self.live_sessions, grace_s)
        if not await self.admission.wait_idle(grace_s):
            message = f"this server is shutting down and its {grace_s:g} s drain period is over; the conversation ended"
            for outbox in list(self._outboxes):
                outbox.put_nowait(_Fatal(pb.ERROR_CODE_SERVICE_UNAVAILABLE, message))
            await self.admission.wait_idle(5.0)

    @property
    def queued_frames(self) -> int:
        """Frames pushed into the live conversations' sessions and not yet out (each holds about its bound at most)."""
        return sum(outbox.frames for outbox in tuple(self._outboxes))  # a copy: scrapes come from another thread

    async def _read(self, requests, session: OnlineSession, drive, out: Outbox,
                    timing: LatencyTracker) -> None:
        """Apply the client's messages in order; problems go to `out` as (code, message) or _Fatal."""
        ended = False
        rate = self.config.input_sample_rate
        try:
            async for request in requests:
                kind = request.WhichOneof("message")
                if ended:
                    what = kind or "an empty message"
                    out.put_nowait((pb.ERROR_CODE_INVALID_REQUEST, f"`{what}` after Flush or Cancel: the session is "
                                    "closed; open a new Converse stream"))
                    continue
                try:
                    if kind == "audio":
                        try:
                            samples = audio_samples(request.audio, rate)
                        except ValueError as exc:
                            out.put_nowait((pb.ERROR_CODE_INVALID_REQUEST, str(exc)))
                            continue
                        timing.start()
                        await out.room()  # a client behind on its answers sends no more for now
                        await asyncio.to_thread(drive, session.push_audio, samples, rate)
                        out.pushed = session.frames_pushed
                    elif kind == "flush":
                        ended = True
                        pad = request.flush.pad_partial if request.flush.HasField("pad_partial") else True
                        await asyncio.to_thread(drive, session.flush, pad)
                    elif kind == "cancel":
                        ended = True
                        await asyncio.to_thread(drive, session.cancel)
                    elif kind == "function_call_output":
                        answer = request.function_call_output
                        await asyncio.to_thread(drive, session.submit_function_output, answer.call_id, answer.output)
                    else:
                        out.put_nowait((pb.ERROR_CODE_INVALID_REQUEST,
                                        f"`{kind or 'an empty message'}` is not allowed after Configure"))
                except ContextLimitError as exc:
                    out.put_nowait(_Fatal(pb.ERROR_CODE_LIMIT_EXCEEDED, str(exc)))
                    return
                except ServiceError as exc:
                    out.put_nowait(_Fatal(pb.ERROR_CODE_SERVICE_UNAVAILABLE, str(exc)))
                    return
                except ValueError as exc:  # bad samples, audio after the session closed: the session goes on
                    out.put_nowait((pb.ERROR_CODE_INVALID_REQUEST, str(exc)))
                except Exception as exc:  # noqa: BLE001 - a model failure ends this conversation only
                    log.exception("conversation failed")
                    out.put_nowait(_Fatal(pb.ERROR_CODE_INFERENCE_ERROR, f"{type(exc).__name__}: {exc}"))
                    return
            if not ended:  # a half-close without Flush flushes
                try:
                    await asyncio.to_thread(drive, session.flush, True)
                except Exception as exc:  # noqa: BLE001
                    out.put_nowait(_Fatal(pb.ERROR_CODE_INFERENCE_ERROR, f"{type(exc).__name__}: {exc}"))
        except DecodeError as exc:  # bytes that are no ConverseRequest: the stream cannot be trusted past them
            out.put_nowait(_Fatal(pb.ERROR_CODE_INVALID_REQUEST, f"a request message does not parse: {exc}; the "
                                  "conversation ended", grpc.StatusCode.INVALID_ARGUMENT))
        finally:
            out.put_nowait(_READER_DONE)

    async def _write(self, session: OnlineSession, out: Outbox, reader: asyncio.Task,
                     timing: LatencyTracker):
        """Events and errors in order; Done/Cancelled last, held until the client half-closes (or 1 s)."""
        rate = self.config.output_sample_rate
        terminal: Event | None = None
        reader_done = False
        while True:
            if reader_done and (terminal is not None or out.empty()):
                if terminal is not None:
                    yield event_to_proto(terminal, rate)
                return
            try:
                timeout = TERMINAL_HOLD_S if terminal is not None else None
                item = await asyncio.wait_for(out.get(), timeout)
            except TimeoutError:
                reader_done = True
                continue
            if item is _READER_DONE:
                reader_done = True
                continue
            if isinstance(item, _Fatal):
                yield _error(item.code, str(item))
                if item.status is not None:
                    raise item
                return
            if isinstance(item, tuple):
                yield _error(*item)
                continue
            if item.kind == "error":
                code = (pb.ERROR_CODE_SERVICE_UNAVAILABLE if isinstance(session._error, ServiceError)
                        else pb.ERROR_CODE_INFERENCE_ERROR)
                yield _error(code, item.message)
                return
            if item.kind in ("done", "cancelled"):
                terminal = item
                continue
            yield event_to_proto(item, rate)
            if item.kind == "audio":  # a frame's last event went out
                self.metrics.frame(item.interval_s)
                timing.frame()


def registrations(servicer: ConversationServicer):
    return [(conversation_pb2_grpc.add_ConversationServiceServicer_to_server, servicer)]


def run_server(clients: StreamClients, model_dir: str | Path, *, host: str = "[::]", port: int = 0,
               max_sessions: int = 4, max_streaming_seconds: float = 600.0, pipelined: bool = True,
               realtime=None, drain_seconds: float = DEFAULT_GRACE_S, metrics: Metrics | None = None,
               metrics_server: MetricsServer | None = None, runner=None, ticker=None, api_key: str | None = None,
               tls: Tls | None = None, supervisor: Supervisor | None = None, text_window: int | None = None) -> None:
    """Serve Converse until SIGTERM/SIGINT; prints `listening on HOST:PORT` once ready. A RealtimeServer given
    as `realtime` serves /v1/realtime on the same event loop for as long (it prints `realtime on URL`).
    `metrics` collects the conversations' metrics; a started `metrics_server` is announced after the ready line.
    With `api_key` every call needs `authorization: Bearer KEY` metadata; with `tls` the port speaks TLS.
    A `supervisor` of the services restarts one that dies; meanwhile health says NOT_SERVING and both front doors
    refuse new conversations, naming the service. `text_window` bounds each conversation's text events
    (OnlineSession's; None: whole).

    On SIGTERM both drain: new conversations are refused, running ones get `drain_seconds`, then end with an
    error saying the server is shutting down. Before the ready line one conversation is opened and closed
    (`ConversationServicer.prime`)."""
    servicer = ConversationServicer(clients, model_dir, max_sessions=max_sessions,
                                     max_streaming_seconds=max_streaming_seconds, pipelined=pipelined, metrics=metrics,
                                     runner=runner, ticker=ticker, text_window=text_window)
    servicer.prime()

    watching: list[asyncio.Task] = []

    async def report(running: RunningServer, reason: str | None) -> None:
        servicer.admission.unavailable = reason
        if realtime is not None:
            realtime.admission.unavailable = reason
        await running.report(reason is None)

    def on_ready(running: RunningServer) -> None:
        announce(running)
        if metrics_server is not None:
            announce_metrics(metrics_server)
        if supervisor is not None:
            watching.append(asyncio.ensure_future(supervisor.run(lambda reason: report(running, reason))))

    async def drain(grace_s: float) -> None:
        for task in watching:  # shutting down: a service that stops now is not restarted
            task.cancel()
        waits = [servicer.drain(grace_s)] + ([realtime.drain(grace_s)] if realtime is not None else [])
        await asyncio.gather(*waits)

    async def main() -> None:
        options = dict(host=host, port=port, on_ready=on_ready, grace_s=drain_seconds, drain=drain,
                       metrics=servicer.metrics, api_key=api_key, tls=tls)
        try:
            if realtime is None:
                await serve(registrations(servicer), [SERVICE_NAME], **options)
                return
            async with realtime:
                print(f"realtime on {realtime.url}", flush=True)
                await serve(registrations(servicer), [SERVICE_NAME], **options)
        finally:
            for task in watching:
                task.cancel()

    asyncio.run(main())
