"""The clients with the four engines in this process: the offline turn's (`local_clients`) and the online
session's (`LocalEngines(model).clients()`).

The only orchestrator module that imports MLX and the engines: `--in-process`, the tests and the benchmarks
load it; a gRPC orchestrator never does. Both kinds return the numpy arrays the gRPC clients return (the wire
carries raw bytes in the producer's dtype), so a turn gives byte-identical results either way; the in-process
pair exists for tests and to measure what gRPC costs. The online engines each live on their own EngineThread
(MLX evaluation is thread-affine), so a pipelined session may call them from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from orchestrator.pending import Pending
from orchestrator.stream_clients import PerceivedFrame, StreamClients
from orchestrator.timeline import Clients, PerceptionResult, SpeechInfo
from services.codec.engine import CodecEngine
from services.common.engine_thread import EngineThread
from services.llm.engine import LanguageEngine
from services.perception.engine import PerceptionEngine
from services.tts.engine import TTSEngine

# ------------------------------------------------------------------------------------------ offline turn


def _np(array: mx.array) -> np.ndarray:
    return np.array(array)


class LocalPerception:
    def __init__(self, engine):
        self.engine = engine

    def encode(self, waveform: np.ndarray) -> PerceptionResult:
        out = self.engine.encode(waveform.astype(np.float32))
        return PerceptionResult(_np(out.mel), _np(out.encoder_out), _np(out.audio_embeds), out.transcript,
                                np.array(out.token_ids, dtype=np.int32))


@dataclass
class LocalLanguageSession:
    engine: object
    session: object
    prompt_positions: int
    prompt_embeds: np.ndarray

    def step(self, audio_embedding: np.ndarray, forced_function: int | None = None) -> tuple[int, int]:
        if forced_function is not None:
            self.session.force_function(forced_function)
        out = self.session.step(mx.array(audio_embedding))
        return out.text_id, out.function_id

    def send_step(self, audio_embedding: np.ndarray, forced_function: int | None = None) -> Pending[tuple[int, int]]:
        return Pending.answered(self.step(audio_embedding, forced_function))

    def close(self) -> None:
        self.engine.close_session(self.session)


class LocalLanguage:
    def __init__(self, engine, prefix_dtype: str = "float32"):
        self.engine, self.prefix_dtype = engine, prefix_dtype

    def open(self, system_prompt: str) -> LocalLanguageSession:
        session = self.engine.open_session(system_prompt, prefix_dtype=self.prefix_dtype)
        embeds = (np.array(session.prompt_embeds.astype(mx.float32)) if session.prompt_embeds is not None
                  else np.zeros((0, self.engine.hidden_size), np.float32))
        return LocalLanguageSession(self.engine, session, session.prompt_positions, embeds)


@dataclass
class LocalSpeechSession:
    session: object

    def step(self, text_id: int) -> np.ndarray:
        return self.session.step(text_id)[0]

    def send_step(self, text_id: int) -> Pending[np.ndarray]:
        return Pending.answered(self.step(text_id))

    def close(self) -> None:
        pass


class LocalSpeech:
    def __init__(self, engine):
        self.engine = engine

    def info(self) -> SpeechInfo:
        e = self.engine
        return SpeechInfo(e.prompt_frames, e.num_quantizers, tuple(np.array(e.control_codes).tolist()),
                          tuple(np.array(e.silence_codes).tolist()))

    def open(self, seed: int, prompt_codes: np.ndarray, prefix_steps: int) -> LocalSpeechSession:
        return LocalSpeechSession(self.engine.open_session(seed, prompt_codes, prefix_steps))


class LocalCodec:
    def __init__(self, engine):
        self.engine = engine

    def prompt_codes(self, frames: int) -> np.ndarray:
        return self.engine.encode_prompt_codes(frames)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        return self.engine.decode(codes)


def local_clients(model: Path) -> Clients:
    return Clients(LocalPerception(PerceptionEngine.load(model)), LocalLanguage(LanguageEngine.load(model)),
                   LocalSpeech(TTSEngine.load(model)), LocalCodec(CodecEngine.load(model)))


# ------------------------------------------------------------------------------------------ online session


class _OnThread:
    """Calls an object's methods on one EngineThread (results are numpy, evaluated there): `call` waits for
    the result, `send` queues the call and returns its Pending result (the thread runs calls in order)."""

    def __init__(self, thread: EngineThread):
        self.thread = thread

    def call(self, fn, *args):
        return self.thread.submit_sync(fn, *args)

    def send(self, fn, *args) -> Pending:
        return Pending(self.thread.submit(fn, *args).result)


class LocalPerceptionStream(_OnThread):
    def __init__(self, thread: EngineThread, engine):
        super().__init__(thread)
        self.stream = self.call(engine.open_stream)

    def push(self, frame: np.ndarray) -> PerceivedFrame:
        return self.send_push(frame).result()

    def send_push(self, frame: np.ndarray) -> Pending[PerceivedFrame]:
        stream = self.stream

        def run() -> PerceivedFrame:
            out = stream.push(frame.astype(np.float32))
            return PerceivedFrame(np.array(out.audio_embedding), np.array(out.encoder_out), out.transcript_delta,
                                  list(out.token_ids))

        return self.send(run)

    def close(self) -> None:
        self.stream = None


class LocalPerceptionStreams(_OnThread):
    def __init__(self, thread: EngineThread, engine):
        super().__init__(thread)
        self.engine = engine

    def open(self) -> LocalPerceptionStream:
        return LocalPerceptionStream(self.thread, self.engine)


class _ThreadedLanguageSession(_OnThread):
    def __init__(self, thread: EngineThread, session: LocalLanguageSession):
        super().__init__(thread)
        self.session = session
        self.prompt_positions = session.prompt_positions
        self.prompt_embeds = session.prompt_embeds

    def step(self, audio_embedding: np.ndarray, forced_function: int | None = None) -> tuple[int, int]:
        return self.call(self.session.step, audio_embedding, forced_function)

    def send_step(self, audio_embedding: np.ndarray, forced_function: int | None = None) -> Pending[tuple[int, int]]:
        return self.send(self.session.step, audio_embedding, forced_function)

    def close(self) -> None:
        self.call(self.session.close)


class LocalStreamLanguage(_OnThread):
    def __init__(self, thread: EngineThread, engine):
        super().__init__(thread)
        self.language = LocalLanguage(engine, prefix_dtype="bfloat16")  # the online session's prompt rows

    def open(self, system_prompt: str) -> _ThreadedLanguageSession:
        return _ThreadedLanguageSession(self.thread, self.call(self.language.open, system_prompt))


class _ThreadedSpeechSession(_OnThread):
    def __init__(self, thread: EngineThread, session):
        super().__init__(thread)
        self.session = session

    def step(self, text_id: int) -> np.ndarray:
        return self.send_step(text_id).result()

    def send_step(self, text_id: int) -> Pending[np.ndarray]:
        session = self.session
        return self.send(lambda: session.step(text_id)[0])

    def close(self) -> None:
        self.session = None


class LocalStreamSpeech(_OnThread):
    def __init__(self, thread: EngineThread, engine):
        super().__init__(thread)
        self.speech = LocalSpeech(engine)

    def info(self) -> SpeechInfo:
        return self.call(self.speech.info)

    def open(self, seed: int, prompt_codes: np.ndarray, prefix_steps: int) -> _ThreadedSpeechSession:
        session = self.call(self.speech.engine.open_session, seed, prompt_codes, prefix_steps)
        return _ThreadedSpeechSession(self.thread, session)


class LocalCodecStream(_OnThread):
    def __init__(self, thread: EngineThread, engine):
        super().__init__(thread)
        self.stream = engine.open_stream()
        self.frame = 0

    def decode(self, codes: np.ndarray) -> np.ndarray:
        return self.send_decode(codes).result()

    def send_decode(self, codes: np.ndarray) -> Pending[np.ndarray]:
        pending = self.send(self.stream.decode_frame, self.frame, codes)
        self.frame += 1
        return pending

    def close(self) -> None:
        self.stream = None


class LocalCodecStreams(_OnThread):
    def __init__(self, thread: EngineThread, engine):
        super().__init__(thread)
        self.engine = engine

    def prompt_codes(self, frames: int) -> np.ndarray:
        return self.call(self.engine.encode_prompt_codes, frames)

    def open_stream(self) -> LocalCodecStream:
        return LocalCodecStream(self.thread, self.engine)


class LocalEngines:
    """The four engines in this process, each loaded on and driven from its own EngineThread."""

    NAMES = ("perception", "llm", "tts", "codec")

    def __init__(self, model: Path):
        loaders = {"perception": PerceptionEngine.load, "llm": LanguageEngine.load, "tts": TTSEngine.load,
                   "codec": CodecEngine.load}
        self.threads = {name: EngineThread(name=f"{name}-engine") for name in self.NAMES}
        futures = {name: self.threads[name].submit(loaders[name], model) for name in self.NAMES}
        try:
            self.engines = {name: future.result() for name, future in futures.items()}
        except BaseException:
            self.close()
            raise

    def clients(self) -> StreamClients:
        t, e = self.threads, self.engines
        return StreamClients(LocalPerceptionStreams(t["perception"], e["perception"]),
                             LocalStreamLanguage(t["llm"], e["llm"]), LocalStreamSpeech(t["tts"], e["tts"]),
                             LocalCodecStreams(t["codec"], e["codec"]))

    def close(self) -> None:
        for thread in self.threads.values():
            thread.close()
