"""The online session: PCM chunks of any size in, aligned transcript, text, function and audio events out.

    session = OnlineSession.open(clients, config, decoder, system_prompt=..., seed=0)
    for chunk in chunks:
        handle(session.push_audio(chunk, 16_000))     # events of the frames completed so far
    handle(session.flush(pad_partial=True))           # the rest, then `done`

Every complete 1280-sample frame t runs four stages, each a call to one service's stream:

    perception  frame -> audio embedding, encoder frame, transcript delta     (streaming encoder + RNNT)
    language    embedding -> text[t], function[t]                             (the service fuses the inputs)
    speech      text[t] -> 31 codes; timeline position 0 emits the codec's silence codes with no step
    codec       codes (control codes replaced by silence) -> 1764 samples at 22.05 kHz

The system prompt prefix advances the timeline when the sessions open (language prefill, P-1 speech pad
steps) and emits nothing. Only forward edges cross services, so the pipelined mode runs the stages side by side
(perception of t+2 while language runs t+1 and speech t). Each stage sends a frame's request as soon as the
frame reaches it, up to `send_ahead` frames before their answers are taken, so its service has the next request
when it finishes one. Every stage still takes frames in order, and the events of frame t come out when its last
stage is done, in frame order. The sequential mode runs the same stages one after another; both give identical
events.

Per frame the events are, in order: user_transcript_delta, assistant_text_delta, function_delta, the tool-call
events of that function text (function_call_delta, function_call_done, function_call_error), audio.

A text event's `text` is its channel's cumulative text. With `text_window` (characters) that holds while the text
is at most text_window characters; past it `text` is the cumulative text from character `text_start` on (its last
text_window characters, never starting inside the assistant channels' unsettled tail nor past the text the
channel's previous event held), so an event's size stops growing with the conversation and a client rebuilds the
whole text as `whole = whole[:text_start] + text`.

With tools (orchestrator/tools.py) the system prompt lists them, the function channel is parsed into calls, and
`submit_function_output` queues a call's output, whose tokens replace the function head's picks one per frame
(each frame's forced id is taken when its language step is sent). Calls of the server's own tools (a ToolRunner)
run on its threads; their outputs are queued the same way and reported as function_call_output events.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orchestrator.lockstep import FrameTicker
from orchestrator.pending import Pending
from orchestrator.profile import Clock, FrameTiming, MonotonicClock, Profile
from orchestrator.stream_clients import PerceivedFrame, StreamClients
from orchestrator.text import GrowingText, TextDecoder, TokenAccumulator, text_start
from orchestrator.timeline import SpeechInfo, replace_control_codes
from orchestrator.tools import MAX_TOOLS, CallEvent, Tool, ToolChannel, check_distinct, render_system_prompt
from services.common.config import VoiceChatConfig
from services.perception.vocabulary import is_special_piece, load_vocabulary

# Frames a pipelined session's caller lets run ahead of their events (2 s): a front door that takes audio faster
# than real time waits past it (`wait_behind`), so what a conversation holds in the server stays bounded.
MAX_FRAMES_AHEAD = 25

EVENT_KINDS = ("user_transcript_delta", "assistant_text_delta", "function_delta", "function_call_delta",
               "function_call_done", "function_call_error", "function_call_output", "audio", "done", "cancelled",
               "error")

CALL_EVENT_KINDS = {"delta": "function_call_delta", "done": "function_call_done", "error": "function_call_error"}


class SessionClosedError(ValueError):
    """Audio pushed after flush or cancel."""


class ContextLimitError(RuntimeError):
    """The session ran past max_streaming_seconds."""


@dataclass
class Event:
    """One aligned output. frame_index is the input frame's index (the prompt prefix does not count)."""

    kind: str
    frame_index: int
    token_id: int | None = None  # text and function deltas
    delta: str | None = None  # text, function and transcript deltas
    text: str | None = None  # the channel's cumulative text (authoritative over the deltas) from text_start on
    text_start: int = 0  # characters of the cumulative text left out before `text` (past the session's text_window)
    samples: np.ndarray | None = None  # audio: (1764,) float32 at 22.05 kHz
    audio_codes: np.ndarray | None = None  # audio: (31,) int32, control codes replaced (what the codec decoded)
    raw_codes: np.ndarray | None = None  # audio: (31,) int32 as generated and fed back
    message: str | None = None  # error, function_call_error
    call_id: str | None = None  # function_call_*
    name: str | None = None  # function_call_done, function_call_output: the tool
    arguments: str | None = None  # function_call_done: JSON text
    output: str | None = None  # function_call_output
    # audio: seconds from when the frame could complete (its audio pushed and the previous frame done, whichever is
    # later) to its completion: profile.py's interval, what the orchestrator's voicechat_frame_seconds observes
    interval_s: float | None = field(default=None, compare=False)

    def describe(self) -> dict:
        """The non-array fields, as the golden's `meta.events` lists them (text_start only when text is windowed)."""
        described = {"kind": self.kind, "frame_index": self.frame_index, "token_id": self.token_id,
                     "delta": self.delta, "text": self.text}
        if self.text_start:
            described["text_start"] = self.text_start
        return described


@dataclass
class FrameRecord:
    """What one frame produced, kept when the session records (for --dump and tests)."""

    encoder_out: np.ndarray
    audio_embedding: np.ndarray
    text_id: int
    function_id: int
    raw_codes: np.ndarray
    audio_codes: np.ndarray
    audio: np.ndarray


@dataclass
class _Frame:
    index: int
    samples: np.ndarray
    available: float  # when its audio was pushed
    started: float = 0.0
    perceived: PerceivedFrame | None = None
    text_id: int = 0
    function_id: int = 0
    forced: bool = False  # function_id was a response token forced in, not the function head's pick
    raw: np.ndarray | None = None
    clean: np.ndarray | None = None
    audio: np.ndarray | None = None
    ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    """One service's step of every frame: `send(frame)` hands the frame's request to the service (a Pending
    answer), `take(frame, answer)` stores the answer in the frame. `name` keys the frame's time (profile.py)."""

    name: str
    send: Callable[[_Frame], Pending]
    take: Callable[[_Frame, object], None]


_STOP = object()


@dataclass
class _Failure:
    error: BaseException
    frame_index: int


def transcript_vocabulary(model_dir: str | Path, config: VoiceChatConfig) -> list[str]:
    """The RNNT pieces, to tell which emissions extend the transcript (specials and language tags do not)."""
    return load_vocabulary(config, model_dir)


class OnlineSession:
    """One conversation's timeline over four service streams. Drive it from one thread at a time."""

    def __init__(self, clients: StreamClients, config: VoiceChatConfig, decoder: TextDecoder, *,
                 system_prompt: str | None = None, seed: int = 0, max_streaming_seconds: float | None = None,
                 pipelined: bool = True, send_ahead: int = 2, profile: bool = False, record: bool = False,
                 on_event: Callable[[Event], None] | None = None, clock: Clock | None = None,
                 rnnt_vocabulary: list[str] | None = None, tools: list[Tool] | None = None,
                 tool_choice: str = "auto", runner=None, ticker: FrameTicker | None = None,
                 text_window: int | None = None):
        if max_streaming_seconds is not None and not max_streaming_seconds > 0:
            raise ValueError(f"max_streaming_seconds must be positive, got {max_streaming_seconds}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        if send_ahead < 1:
            raise ValueError(f"send_ahead must be at least 1, got {send_ahead}")
        if text_window is not None and text_window < 0:
            raise ValueError(f"text_window must be a non-negative number of characters (0: unbounded), got "
                             f"{text_window}")
        self.config = config
        self.sample_rate = config.input_sample_rate
        self.frame_samples = config.input_frame_samples
        self.max_frames = None if max_streaming_seconds is None else int(max_streaming_seconds / config.frame_duration)
        self.pipelined = pipelined
        self.send_ahead = send_ahead  # pipelined: frames a stage may have sent and not yet answered
        self.clock = clock or MonotonicClock()
        self.ticker = ticker  # pipelined: each frame's perception request leaves on this shared grid's tick
        self.profile = Profile(config.frame_duration * 1000.0, pipelined) if profile else None
        self.records: list[FrameRecord] | None = [] if record else None
        self.on_event = on_event
        self.text_window = text_window or None  # None: every text event carries its channel's whole text
        self._text = TokenAccumulator(decoder, self.text_window)
        self._function = TokenAccumulator(decoder, self.text_window)
        self._transcript = GrowingText(self.text_window)  # the user's transcript: the frames' deltas summed
        self._transcript_sent = 0  # characters of the transcript the last transcript event held
        self._vocabulary = rnnt_vocabulary
        self._pending = np.zeros(0, np.float32)
        self._pushed = 0  # frames handed to the stages
        self._completed = 0  # frames whose events are out
        self._last_completion: float | None = None
        self._ready: list[Event] = []
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)  # notified as frames complete and on a failure
        self._error: BaseException | None = None
        self._failed_at: int | None = None  # the first frame a stage failed on
        self._cancelled = threading.Event()
        self.closed = False
        self._streams: list = []
        self._threads: list[threading.Thread] = []

        prompt = config.default_system_prompt if system_prompt is None else system_prompt
        prompt = self._open_tools(prompt, list(tools or []), tool_choice, runner, decoder)
        try:
            self.perception = self._opened(clients.perception.open())
            self.language = self._opened(clients.language.open(prompt))
            self.info: SpeechInfo = clients.speech.info()
            self.prompt_positions = self.language.prompt_positions
            self.prompt_embeds = self.language.prompt_embeds
            self.prompt_codes = clients.codec.prompt_codes(self.info.prompt_frames)
            self.speech = self._opened(clients.speech.open(seed, self.prompt_codes, max(self.prompt_positions - 1, 0)))
            self.codec = self._opened(clients.codec.open_stream())
        except BaseException:
            self._close_streams()
            raise
        self._silence = np.asarray(self.info.silence_codes, np.int32)
        self.stages = self._stages()
        if pipelined:
            self._start_workers()

    def _open_tools(self, prompt: str, tools: list[Tool], tool_choice: str, runner, decoder: TextDecoder) -> str:
        """The server's tools (a ToolRunner's) and the session's; the prompt that lists them (`tool_choice`
        "none": neither listed nor parsed)."""
        self.runner = runner
        self._server_calls: set[str] = set()
        declared = [*(runner.tools if runner is not None else []), *tools]
        self.instructions, self.declared_tools, self.tool_choice = prompt, declared, tool_choice
        if len(declared) > MAX_TOOLS:
            raise ValueError(f"{len(declared)} tools declared ({len(declared) - len(tools)} by the server); at most "
                             f"{MAX_TOOLS} are allowed")
        check_distinct(declared)
        self._tools: ToolChannel | None = None
        if not declared or tool_choice == "none":
            return prompt
        tokenizer = decoder.tokenizer
        self._tools = ToolChannel(declared, lambda text: tokenizer.encode(text, add_special_tokens=False).ids)
        return render_system_prompt(prompt, declared)

    def _opened(self, stream):
        self._streams.append(stream)
        return stream

    # ---------------------------------------------------------------------------------------- public API

    @property
    def frame_index(self) -> int:
        """Frames whose events have been emitted."""
        return self._completed

    @property
    def frames_pushed(self) -> int:
        """Frames of input handed to the stages (the pipelined mode queues them without waiting)."""
        return self._pushed

    def push_audio(self, samples, sample_rate: int = 16_000) -> list[Event]:
        """Buffer mono float PCM (any length) and run every complete 80 ms frame.

        Returns the events ready now: every frame of this push in the sequential mode, those already through
        all stages in the pipelined one (the rest come with later calls, or through `on_event`)."""
        if self.closed:
            raise SessionClosedError("audio after flush or cancel: this session is closed; open a new one")
        self._raise_failure()
        if sample_rate != self.sample_rate:
            raise ValueError(f"expected {self.sample_rate} Hz PCM, received {sample_rate} Hz; resample first")
        chunk = np.asarray(samples, dtype=np.float32)
        if chunk.ndim == 2 and 1 in chunk.shape:
            chunk = chunk.reshape(-1)
        if chunk.ndim != 1:
            raise ValueError(f"audio must be mono PCM of shape (N,), got shape {chunk.shape}")
        if not np.isfinite(chunk).all():
            raise ValueError("audio has non-finite samples (NaN or infinity)")
        pending = np.concatenate([self._pending, chunk]) if self._pending.size else chunk
        n = self.frame_samples
        start = 0
        try:
            while pending.shape[0] - start >= n:
                self._submit(pending[start : start + n].copy())  # the caller may reuse its buffer
                start += n
        except ContextLimitError:
            self._wait()  # the frames before the limit complete; their events wait for the next call
            raise
        finally:
            self._pending = pending[start:].copy()
        return self._take_ready()

    def submit_function_output(self, call_id, output) -> list[Event]:
        """A client's answer to a call: queued for the function channel (after any response still being read) and
        reported as a function_call_output event; returns the events ready now. ValueError when the session has
        no tools, the call id is unknown, answered or the server's own, the output is not a string, or the queue
        is full."""
        if self.closed:
            raise SessionClosedError("function_call_output after flush or cancel: this session is closed")
        if self._tools is None:
            raise ValueError("this session declares no tools (or tool_choice is \"none\"): there is no call to answer")
        if isinstance(call_id, str) and call_id in self._server_calls:
            raise ValueError(f"call {call_id} runs on the server; the server feeds its output back itself")
        self._output(call_id, output)
        return self._take_ready()

    def _output(self, call_id, output) -> None:
        name = self._tools.submit_output(call_id, output)
        self._emit([Event("function_call_output", self._completed, call_id=call_id, name=name, output=output)])

    def _server_output(self, call_id: str, output: str) -> None:
        """A server tool's result (on a runner thread): fed back unless the session is over."""
        if self.closed:
            return
        try:
            self._output(call_id, output)
        except ValueError as exc:  # the queue is full
            self._emit([Event("function_call_error", self._completed, call_id=call_id, message=str(exc))])

    def wait_behind(self, frames: int) -> list[Event]:
        """Wait while more than `frames` of the frames pushed are still in the stages; returns the events ready then.

        The pipelined mode queues pushed frames without waiting, so a caller whose audio comes faster than the
        session runs (a client sending ahead of real time) calls this after each push to hold its input back
        instead of queueing it without bound. Raises the session's failure as push_audio does; returns at once
        in the sequential mode (a push runs its frames) and once the session is cancelled or closed."""
        if frames < 0:
            raise ValueError(f"frames must be zero or more, got {frames}")
        with self._progress:
            while (self._pushed - self._completed > frames and self._error is None and not self.closed
                   and not self._cancelled.is_set()):
                self._progress.wait()  # notified as a frame completes, on a failure, a cancel and a close
        self._raise_failure()
        return self._take_ready()

    def drain(self) -> list[Event]:
        """Wait until every frame pushed so far has emitted its events; returns those ready."""
        self._wait()
        return self._take_ready()

    def _wait(self) -> None:
        if self._threads:
            self._stop_workers()
            if not self.closed:
                self._start_workers()

    def flush(self, pad_partial: bool = True) -> list[Event]:
        """End of input: zero-pad and run the partial frame (when asked), wait for every frame, then `done`."""
        if self.closed:
            return []
        self._raise_failure()
        pending, self._pending = self._pending, np.zeros(0, np.float32)
        if pending.size and pad_partial:
            try:
                self._submit(np.pad(pending, (0, self.frame_samples - pending.shape[0])))
            except ContextLimitError:
                self._wait()
                raise
        self._stop_workers()
        self._set_closed()
        self._close_streams()
        self._raise_failure()
        if self._tools is not None:
            self._emit(self._call_events(self._tools.finish(), self._completed))
        self._emit([Event("done", self._completed)])
        return self._take_ready()

    def cancel(self) -> list[Event]:
        """Drop pending audio and frames not yet through every stage; ends with `cancelled`."""
        if self.closed:
            return []
        self._cancelled.set()
        self._pending = np.zeros(0, np.float32)
        self._stop_workers()
        self._set_closed()
        self._close_streams()
        self._emit([Event("cancelled", self._completed)])
        return self._take_ready()

    def close(self) -> None:
        """Free every service session now (a vanished client); no event. Idempotent."""
        self._cancelled.set()
        self._stop_workers()
        self._set_closed()
        self._close_streams()

    def _set_closed(self) -> None:
        """Closed: a caller held in wait_behind goes on."""
        with self._progress:
            self.closed = True
            self._progress.notify_all()

    def __enter__(self) -> OnlineSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- stages
    # Each Stage of `self.stages` pairs two of these: `send` hands the frame's request to the stage's service (a
    # Pending answer), `take` stores the answer in the frame. The pipelined mode sends a frame's request as soon as
    # the frame reaches the stage, up to `send_ahead` frames before their answers are taken, so the service has its
    # next request when it finishes one: no round trip between a stage's frames.

    def _stages(self) -> tuple[Stage, ...]:
        """Perception, language, speech, codec over this session's streams. A frame's time in a stage runs from
        when the service could start on it (its request sent and the stage's previous answer back) to its answer."""
        return (Stage("perception", self._send_perception, self._take_perception),
                Stage("language", self._send_language, self._take_language),
                Stage("tts", self._send_speech, self._take_speech),
                Stage("codec", self._send_codec, self._take_codec))

    def _send_perception(self, f: _Frame) -> Pending:
        return self.perception.send_push(f.samples)

    def _take_perception(self, f: _Frame, perceived: PerceivedFrame) -> None:
        f.perceived = perceived

    def _send_language(self, f: _Frame) -> Pending:
        forced = self._tools.next_forced() if self._tools is not None else None
        if forced is None:
            return self.language.send_step(f.perceived.audio_embedding)
        f.forced = True
        return self.language.send_step(f.perceived.audio_embedding, forced)

    def _take_language(self, f: _Frame, ids: tuple[int, int]) -> None:
        f.text_id, f.function_id = (int(i) for i in ids)

    def _send_speech(self, f: _Frame) -> Pending:
        if self.prompt_positions + f.index == 0:  # the first timeline position: codec silence, no speech step
            return Pending.answered(self._silence.copy())
        return self.speech.send_step(f.text_id)

    def _take_speech(self, f: _Frame, raw: np.ndarray) -> None:
        f.raw = np.asarray(raw, np.int32)
        f.clean = replace_control_codes(f.raw[None], self.info)[0]

    def _send_codec(self, f: _Frame) -> Pending:
        return self.codec.send_decode(f.clean)

    def _take_codec(self, f: _Frame, audio: np.ndarray) -> None:
        f.audio = audio
        self._finish(f)

    def _finish(self, f: _Frame) -> None:
        """The frame's events, in the reference's order; runs in frame order (last stage, one thread)."""
        if self._cancelled.is_set():
            return
        events: list[Event] = []
        p = f.perceived
        transcript = self._transcript
        transcript.append(p.transcript_delta)
        if self._transcript_grew(p):
            start = text_start(transcript.length, self.text_window, self._transcript_sent)  # it grows at its end
            events.append(Event("user_transcript_delta", f.index, delta=p.transcript_delta,
                                text=transcript.since(start), text_start=start))
            self._transcript_sent = transcript.length
        for kind, accumulator, token in (("assistant_text_delta", self._text, f.text_id),
                                         ("function_delta", self._function, f.function_id)):
            update = accumulator.update(token)
            if update is not None:
                events.append(Event(kind, f.index, token_id=token, delta=update.delta, text=update.text,
                                    text_start=update.start))
                if kind == "function_delta" and self._tools is not None:
                    events += self._call_events(self._tools.frame(update.delta, f.forced), f.index)
        events.append(Event("audio", f.index, samples=f.audio, audio_codes=f.clean, raw_codes=f.raw))
        if self.records is not None:
            self.records.append(FrameRecord(p.encoder_out, p.audio_embedding, f.text_id, f.function_id, f.raw,
                                            f.clean, f.audio))
        done = self.clock.now()
        begin = f.available if self._last_completion is None else max(self._last_completion, f.available)
        events[-1].interval_s = done - begin  # the audio event
        if self.profile is not None:
            self.profile.add(FrameTiming(f.index, f.ms["perception"], 0.0, f.ms["language"], f.ms["tts"],
                                         f.ms["codec"], (done - f.started) * 1000.0, (done - begin) * 1000.0))
        self._last_completion = done
        self._completed = f.index + 1
        self._emit(events)
        with self._progress:
            self._progress.notify_all()

    def _call_events(self, calls: list[CallEvent], frame_index: int) -> list[Event]:
        """The parser's call events as session events; a completed call of a server tool starts running."""
        events = []
        for call in calls:
            events.append(Event(CALL_EVENT_KINDS[call.kind], frame_index, delta=call.delta, message=call.message,
                                call_id=call.call_id, name=call.name, arguments=call.arguments))
            if call.kind == "done" and self.runner is not None and call.name in self.runner.names:
                self._server_calls.add(call.call_id)
                self.runner.start(call.call_id, call.name, call.arguments, self._server_output)
        return events

    def _transcript_grew(self, p: PerceivedFrame) -> bool:
        """The reference emits a transcript event when a non-special RNNT piece was appended."""
        if self._vocabulary is None:
            return bool(p.transcript_delta)
        vocab = self._vocabulary
        return any(0 <= i < len(vocab) and not is_special_piece(vocab[i]) for i in p.token_ids)

    # ------------------------------------------------------------------------------------------ plumbing

    def _submit(self, samples: np.ndarray) -> None:
        if self.max_frames is not None and self._pushed >= self.max_frames:
            raise ContextLimitError(f"the stream passed max_streaming_seconds ({self.max_frames} frames of "
                                    f"{self.config.frame_duration * 1000:.0f} ms)")
        f = _Frame(self._pushed, samples, self.clock.now())
        self._pushed += 1
        if self.pipelined:
            self._inboxes[0].put(f)
            return
        try:
            for stage in self.stages:
                start = self.clock.now()
                if stage is self.stages[0]:
                    f.started = start
                answer = stage.send(f).result()
                f.ms[stage.name] = (self.clock.now() - start) * 1000.0
                stage.take(f, answer)
        except BaseException as exc:
            self._fail(exc, f.index)
            self.close()  # a failed stage leaves the timeline broken: free every service session now
            raise

    def _start_workers(self) -> None:
        """Two threads a stage: one sends each frame's request as the frame arrives, one takes the answers in
        order and hands the frame on."""
        self._inboxes = [queue.SimpleQueue() for _ in self.stages]
        for i, stage in enumerate(self.stages):
            sent: queue.SimpleQueue = queue.SimpleQueue()
            room = threading.Semaphore(self.send_ahead)
            outbox = self._inboxes[i + 1] if i + 1 < len(self.stages) else None
            for target, args in ((self._send_work, (stage, i == 0, self._inboxes[i], sent, room)),
                                 (self._take_work, (stage, sent, room, outbox))):
                thread = threading.Thread(target=target, args=args, name=f"session-{stage.name}{target.__name__}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)

    def _send_work(self, stage: Stage, first: bool, inbox: queue.SimpleQueue, sent: queue.SimpleQueue,
                   room: threading.Semaphore) -> None:
        """Send each frame's request as it arrives, `send_ahead` unanswered at most; the first stage waits for the
        shared ticker and starts the frame's clock."""
        while True:
            item = inbox.get()
            if item is _STOP or isinstance(item, _Failure):  # a failure is reported after the frames before it
                sent.put((item, None, 0.0))
                if item is _STOP:
                    return
                continue
            if self._cancelled.is_set() or (self._failed_at is not None and item.index >= self._failed_at):
                continue  # drain without work until the stop marker comes through; earlier frames finish
            room.acquire()
            if first and self.ticker is not None:
                self.ticker.wait(item.available)
            now = self.clock.now()
            if first:
                item.started = now
            try:
                pending = stage.send(item)
            except BaseException as exc:  # noqa: BLE001 - reported to the driving thread
                room.release()
                self._fail(exc, item.index)
                sent.put((_Failure(exc, item.index), None, 0.0))
                continue
            sent.put((item, pending, now))

    def _take_work(self, stage: Stage, sent: queue.SimpleQueue, room: threading.Semaphore,
                   outbox: queue.SimpleQueue | None) -> None:
        """Take the answers in frame order and hand each frame on (the last stage's take emits its events)."""
        last_answer = 0.0
        while True:
            item, pending, sent_at = sent.get()
            if item is _STOP:
                if outbox is not None:
                    outbox.put(_STOP)
                return
            if isinstance(item, _Failure):
                self._forward_failure(item, outbox)
                continue
            if self._cancelled.is_set() or (self._failed_at is not None and item.index >= self._failed_at):
                room.release()  # the session is ending: its streams are not read again
                continue
            try:
                answer = pending.result()
                now = self.clock.now()
                item.ms[stage.name] = (now - max(sent_at, last_answer)) * 1000.0
                last_answer = now
                stage.take(item, answer)
            except BaseException as exc:  # noqa: BLE001 - reported to the driving thread
                self._fail(exc, item.index)
                self._forward_failure(_Failure(exc, item.index), outbox)
                continue
            finally:
                room.release()
            if outbox is not None:
                outbox.put(item)

    def _forward_failure(self, failure: _Failure, outbox: queue.SimpleQueue | None) -> None:
        if outbox is not None:
            outbox.put(failure)
        elif self.on_event is not None and not self._cancelled.is_set():
            self.on_event(Event("error", failure.frame_index, message=str(failure.error)))

    def _stop_workers(self) -> None:
        if self._threads:
            self._inboxes[0].put(_STOP)
            for thread in self._threads:
                thread.join()
            self._threads = []

    def _fail(self, exc: BaseException, frame_index: int | None = None) -> None:
        index = self._pushed if frame_index is None else frame_index
        with self._progress:
            if self._failed_at is None or index < self._failed_at:  # the earliest frame's failure wins
                self._error, self._failed_at = exc, index
            self._progress.notify_all()

    def _raise_failure(self) -> None:
        if self._error is not None:
            self._stop_workers()  # frames before the failed one still complete
            self.close()
            raise self._error

    def _emit(self, events: list[Event]) -> None:
        if self.on_event is not None:
            for event in events:
                self.on_event(event)
            return
        with self._lock:
            self._ready.extend(events)

    def _take_ready(self) -> list[Event]:
        with self._lock:
            ready, self._ready = self._ready, []
        return ready

    def _close_streams(self) -> None:
        streams, self._streams = self._streams, []
        for stream in reversed(streams):
            try:
                stream.close()
            except Exception:  # noqa: BLE001 - closing a stream of a service that is gone
                pass
