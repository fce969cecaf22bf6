"""The offline timeline: one spoken turn in, the model's whole response out.

A pure function of four small client interfaces (perception, language, speech, codec), so it runs the same
over gRPC and in-process. The semantics are the reference's offline turn, with persistent language caches:

    position p = 0 .. P+F-1   (P system-prompt positions, then F audio frames)
    language:  fused input E(text[p-1]) + audio[p] + 2 E(function[p-1]); outputs forced to pad over the prefix
    speech:    one step per position from 1 on (prefix included, fed pad); none at position 0
    codec:     the frames' codes with control codes replaced by per-codebook silence, decoded in chunks of
               DECODE_CHUNK_FRAMES (each with a little context either side), which give the whole decode's samples
               with memory that does not grow with the turn's length
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from orchestrator.pending import Pending


@dataclass
class PerceptionResult:
    mel: np.ndarray  # (T, features) float32
    encoder: np.ndarray  # (F, d_model) float32
    audio_embeds: np.ndarray  # (F, hidden) float32
    transcript: str
    transcript_ids: np.ndarray  # (n,) int32


@dataclass(frozen=True)
class SpeechInfo:
    prompt_frames: int  # frames of the built-in voice prompt
    num_quantizers: int
    control_codes: tuple[int, ...]
    silence_codes: tuple[int, ...]  # per-codebook silence code


class PerceptionClient(Protocol):
    def encode(self, waveform: np.ndarray) -> PerceptionResult: ...


class LanguageSession(Protocol):
    prompt_positions: int
    prompt_embeds: np.ndarray  # (P, hidden) float32: the prefix as it enters the audio channel

    def step(self, audio_embedding: np.ndarray) -> tuple[int, int]: ...

    # the step sent, its answer taken later (a stream may have the next step sent before this one's answer);
    # forced_function, when given, is the frame's function token in place of the head's pick (a tool response)
    def send_step(self, audio_embedding: np.ndarray, forced_function: int | None = None
                  ) -> Pending[tuple[int, int]]: ...

    def close(self) -> None: ...


class LanguageClient(Protocol):
    def open(self, system_prompt: str) -> LanguageSession: ...


class SpeechSession(Protocol):
    def step(self, text_id: int) -> np.ndarray: ...  # (Q,) int32 raw codes

    def send_step(self, text_id: int) -> Pending[np.ndarray]: ...

    def close(self) -> None: ...


class SpeechClient(Protocol):
    def info(self) -> SpeechInfo: ...

    def open(self, seed: int, prompt_codes: np.ndarray, prefix_steps: int) -> SpeechSession: ...


class CodecClient(Protocol):
    def prompt_codes(self, frames: int) -> np.ndarray: ...  # (frames, Q) int32, masked warm-up codes

    def decode(self, codes: np.ndarray) -> np.ndarray: ...  # (F, Q) int32 -> (F * 1764,) float32


@dataclass
class Clients:
    perception: PerceptionClient
    language: LanguageClient
    speech: SpeechClient
    codec: CodecClient


@dataclass
class OfflineResult:
    waveform: np.ndarray
    perception: PerceptionResult
    audio_embeds: np.ndarray  # (P + F, hidden): prompt prefix then audio frames
    text_tokens: np.ndarray  # (F,) int32
    function_tokens: np.ndarray  # (F,) int32
    raw_codes: np.ndarray  # (F, Q) int32 as generated (frame 0 zeros without a prompt)
    audio_codes: np.ndarray  # (F, Q) int32 after control-code replacement
    audio: np.ndarray  # (F * 1764,) float32
    prompt_codes: np.ndarray
    prompt_frames: int
    seconds: dict[str, float] = field(default_factory=dict)


def replace_control_codes(codes: np.ndarray, info: SpeechInfo) -> np.ndarray:
    """Control codes become the codebook's silence code (what the codec can decode)."""
    control = np.asarray(info.control_codes, dtype=codes.dtype)
    silence = np.asarray(info.silence_codes, dtype=codes.dtype)  # broadcast along the last axis, a code per codebook
    return np.where((codes[..., None] == control).any(axis=-1), silence, codes)  # np.isin: 4x the time a frame


# Code frames (80 ms each) one offline Decode call carries: the codec service's memory stays bounded whatever the
# turn's length (a whole 2-minute decode grew it to 3.26 GB), and every call is under its --max-frames (4096).
DECODE_CHUNK_FRAMES = 32
# Frames decoded with each chunk and dropped, so its samples equal the whole decode's: the decoder's causal
# convolutions reach 18 samples back at 9x, 63x and 441x the frame rate (2.3 frames), the inverse STFT 8 samples.
DECODE_LEFT_FRAMES = 4
DECODE_RIGHT_FRAMES = 1


def decode_chunked(codec: CodecClient, codes: np.ndarray, chunk: int | None = None) -> np.ndarray:
    """codes (F, Q) -> (F * 1764,) float32: `chunk` frames (default DECODE_CHUNK_FRAMES) a Decode call, each
    decoded with DECODE_LEFT_FRAMES before it and DECODE_RIGHT_FRAMES after it whose samples are dropped."""
    chunk = chunk or DECODE_CHUNK_FRAMES
    frames = codes.shape[0]
    pieces = []
    for start in range(0, max(frames, 1), chunk):
        stop = min(start + chunk, frames)
        first, last = max(start - DECODE_LEFT_FRAMES, 0), min(stop + DECODE_RIGHT_FRAMES, frames)
        audio = codec.decode(codes[first:last])
        per_frame = len(audio) // max(last - first, 1)
        pieces.append(audio[(start - first) * per_frame : (stop - first) * per_frame])
    return np.concatenate(pieces)


def append_silence(waveform: np.ndarray, seconds: float, sample_rate: int) -> np.ndarray:
    if seconds < 0:
        raise ValueError(f"extra decoding seconds must be non-negative, got {seconds}")
    return np.concatenate([waveform.astype(np.float32), np.zeros(round(seconds * sample_rate), np.float32)])


def run_offline(clients: Clients, waveform: np.ndarray, *, system_prompt: str = "", seed: int = 0) -> OfflineResult:
    """Run one turn over `waveform` (16 kHz mono float32, decoding silence already appended)."""
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[stage] = seconds.get(stage, 0.0) + now - clock
        clock = now

    perceived = clients.perception.encode(waveform)
    lap("perception")
    info = clients.speech.info()
    prompt_codes = clients.codec.prompt_codes(info.prompt_frames)
    lap("codec")
    language = clients.language.open(system_prompt)
    lap("language")
    prefix = language.prompt_positions
    speech = clients.speech.open(seed, prompt_codes, max(prefix - 1, 0))
    lap("speech")
    try:
        frames = perceived.audio_embeds.shape[0]
        text = np.zeros(frames, np.int32)
        function = np.zeros(frames, np.int32)
        raw = np.zeros((frames, info.num_quantizers), np.int32)
        for t in range(frames):
            text[t], function[t] = language.step(perceived.audio_embeds[t])
            lap("language")
            if prefix + t == 0:  # the first timeline position warms the language model only
                continue
            raw[t] = speech.step(int(text[t]))
            lap("speech")
    finally:
        language.close()
        speech.close()
    codes = replace_control_codes(raw, info)
    audio = decode_chunked(clients.codec, codes)
    lap("codec")
    embeds = np.concatenate([language.prompt_embeds, perceived.audio_embeds]) if prefix else perceived.audio_embeds
    return OfflineResult(
        waveform=waveform, perception=perceived, audio_embeds=embeds, text_tokens=text, function_tokens=function,
        raw_codes=raw, audio_codes=codes, audio=audio, prompt_codes=prompt_codes, prompt_frames=prefix,
        seconds=seconds,
    )
