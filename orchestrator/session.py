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
steps) and emits nothing. Only forward edges cross services, so the pipelined mode runs each stage on its own
thread (perception of t+2 while language runs t+1 and speech t); every stage still takes frames in order, and
the events of frame t come out when its last stage is done, in frame order. The sequential mode runs the same
stage functions one after another; both give identical events.

Per frame the events are, in order: user_transcript_delta, assistant_text_delta, function_delta, audio.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orchestrator.profile import Clock, FrameTiming, MonotonicClock, Profile
from orchestrator.stream_clients import PerceivedFrame, StreamClients
from orchestrator.text import TextDecoder, TokenAccumulator
from orchestrator.timeline import SpeechInfo, replace_control_codes
from services.common.config import VoiceChatConfig
from services.perception.rnnt import is_special_piece

EVENT_KINDS = ("user_transcript_delta", "assistant_text_delta", "function_delta", "audio", "done", "cancelled",
               "error")


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
    text: str | None = None  # the channel's cumulative text (authoritative over the deltas)
    samples: np.ndarray | None = None  # audio: (1764,) float32 at 22.05 kHz
    audio_codes: np.ndarray | None = None  # audio: (31,) int32, control codes replaced (what the codec decoded)
    raw_codes: np.ndarray | None = None  # audio: (31,) int32 as generated and fed back
    message: str | None = None  # error
    # audio: seconds from when the frame could complete (its audio pushed and the previous frame done, whichever is
    # later) to its completion: profile.py's interval, what the orchestrator's voicechat_frame_seconds observes
    interval_s: float | None = field(default=None, compare=False)

    def describe(self) -> dict:
        """The non-array fields, as the golden's `meta.events` lists them."""
        return {"kind": self.kind, "frame_index": self.frame_index, "token_id": self.token_id,
                "delta": self.delta, "text": self.text}


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
    raw: np.ndarray | None = None
    clean: np.ndarray | None = None
    audio: np.ndarray | None = None
    ms: dict[str, float] = field(default_factory=dict)


_STOP = object()


@dataclass
class _Failure:
    error: BaseException
    frame_index: int


def transcript_vocabulary(model_dir: str | Path, config: VoiceChatConfig) -> list[str]:
    """The RNNT pieces, to tell which emissions extend the transcript (specials and language tags do not)."""
    from services.perception.engine import _vocabulary

    return _vocabulary(config, Path(model_dir))


class OnlineSession:
    """One conversation's timeline over four service streams. Drive it from one thread at a time."""

    def __init__(self, clients: StreamClients, config: VoiceChatConfig, decoder: TextDecoder, *,
                 system_prompt: str | None = None, seed: int = 0, max_streaming_seconds: float | None = None,
                 pipelined: bool = True, profile: bool = False, record: bool = False,
                 on_event: Callable[[Event], None] | None = None, clock: Clock | None = None,
                 rnnt_vocabulary: list[str] | None = None):
        if max_streaming_seconds is not None and not max_streaming_seconds > 0:
            raise ValueError(f"max_streaming_seconds must be positive, got {max_streaming_seconds}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.config = config
        self.sample_rate = config.input_sample_rate
        self.frame_samples = config.input_frame_samples
        self.max_frames = None if max_streaming_seconds is None else int(max_streaming_seconds / config.frame_duration)
        self.pipelined = pipelined
        self.clock = clock or MonotonicClock()
        self.profile = Profile(config.frame_duration * 1000.0, pipelined) if profile else None
        self.records: list[FrameRecord] | None = [] if record else None
        self.on_event = on_event
        self._text = TokenAccumulator(decoder)
        self._function = TokenAccumulator(decoder)
        self._vocabulary = rnnt_vocabulary
        self._pending = np.zeros(0, np.float32)
        self._pushed = 0  # frames handed to the stages
        self._completed = 0  # frames whose events are out
        self._last_completion: float | None = None
        self._ready: list[Event] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._failed_at: int | None = None  # the first frame a stage failed on
        self._cancelled = threading.Event()
        self.closed = False
        self._streams: list = []
        self._threads: list[threading.Thread] = []

        prompt = config.default_system_prompt if system_prompt is None else system_prompt
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
        if pipelined:
            self._start_workers()

    def _opened(self, stream):
        self._streams.append(stream)
        return stream

    # ---------------------------------------------------------------------------------------- public API

    @property
    def frame_index(self) -> int:
        """Frames whose events have been emitted."""
        return self._completed

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
        self.closed = True
        self._close_streams()
        self._raise_failure()
        self._emit([Event("done", self._completed)])
        return self._take_ready()

    def cancel(self) -> list[Event]:
        """Drop pending audio and frames not yet through every stage; ends with `cancelled`."""
        if self.closed:
            return []
        self._cancelled.set()
        self._pending = np.zeros(0, np.float32)
        self._stop_workers()
        self.closed = True
        self._close_streams()
        self._emit([Event("cancelled", self._completed)])
        return self._take_ready()

    def close(self) -> None:
        """Free every service session now (a vanished client); no event. Idempotent."""
        self._cancelled.set()
        self._stop_workers()
        self.closed = True
        self._close_streams()

    def __enter__(self) -> OnlineSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- stages

    def _perceive(self, f: _Frame) -> None:
        f.started = start = self.clock.now()
        f.perceived = self.perception.push(f.samples)
        f.ms["perception"] = (self.clock.now() - start) * 1000.0

    def _language(self, f: _Frame) -> None:
        start = self.clock.now()
        f.text_id, f.function_id = (int(i) for i in self.language.step(f.perceived.audio_embedding))
        f.ms["language"] = (self.clock.now() - start) * 1000.0

    def _speak(self, f: _Frame) -> None:
        start = self.clock.now()
        if self.prompt_positions + f.index == 0:  # the first timeline position: codec silence, no speech step
            f.raw = self._silence.copy()
        else:
            f.raw = np.asarray(self.speech.step(f.text_id), np.int32)
        f.clean = replace_control_codes(f.raw[None], self.info)[0]
        f.ms["tts"] = (self.clock.now() - start) * 1000.0

    def _decode(self, f: _Frame) -> None:
        start = self.clock.now()
        f.audio = self.codec.decode(f.clean)
        f.ms["codec"] = (self.clock.now() - start) * 1000.0
        self._finish(f)

    STAGES = ("_perceive", "_language", "_speak", "_decode")

    def _finish(self, f: _Frame) -> None:
        """The frame's events, in the reference's order; runs in frame order (last stage, one thread)."""
        if self._cancelled.is_set():
            return
        events: list[Event] = []
        p = f.perceived
        if self._transcript_grew(p):
            events.append(Event("user_transcript_delta", f.index, delta=p.transcript_delta, text=p.transcript))
        for kind, accumulator, token in (("assistant_text_delta", self._text, f.text_id),
                                         ("function_delta", self._function, f.function_id)):
            update = accumulator.append(token)
            if update is not None:
                events.append(Event(kind, f.index, token_id=token, delta=update[0], text=update[1]))
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
            for name in self.STAGES:
                getattr(self, name)(f)
        except BaseException as exc:
            self._fail(exc, f.index)
            self.close()  # a failed stage leaves the timeline broken: free every service session now
            raise

    def _start_workers(self) -> None:
        self._inboxes = [queue.SimpleQueue() for _ in self.STAGES]
        for i, name in enumerate(self.STAGES):
            outbox = self._inboxes[i + 1] if i + 1 < len(self.STAGES) else None
            thread = threading.Thread(target=self._work, args=(getattr(self, name), self._inboxes[i], outbox),
                                      name=f"session{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self, stage, inbox: queue.SimpleQueue, outbox: queue.SimpleQueue | None) -> None:
        while True:
            item = inbox.get()
            if item is _STOP:
                if outbox is not None:
                    outbox.put(_STOP)
                return
            if isinstance(item, _Failure):  # reported by the last stage, after the frames before it
                self._forward_failure(item, outbox)
                continue
            if self._cancelled.is_set() or (self._failed_at is not None and item.index >= self._failed_at):
                continue  # drain without work until the stop marker comes through; earlier frames finish
            try:
                stage(item)
            except BaseException as exc:  # noqa: BLE001 - reported to the driving thread
                self._fail(exc, item.index)
                self._forward_failure(_Failure(exc, item.index), outbox)
                continue
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
        with self._lock:
            if self._failed_at is None or index < self._failed_at:  # the earliest frame's failure wins
                self._error, self._failed_at = exc, index

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
