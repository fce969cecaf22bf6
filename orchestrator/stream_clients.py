"""The online session's clients: one stream per service and session, over gRPC or with the engines in-process
(orchestrator/local.py, imported only then).

    clients = grpc_stream_clients(addresses)          # or orchestrator.local.LocalEngines(model).clients()
    perception = clients.perception.open()            # perception.push(frame_1280) -> PerceivedFrame
    language = clients.language.open(prompt)          # bfloat16 prompt rows, as the reference's online session
    speech = clients.speech.open(seed, prompt_codes, max(language.prompt_positions - 1, 0))
    codec = clients.codec.open_stream()               # codec.decode(clean_codes_31) -> (1764,) float32

Both kinds return numpy arrays the producer has already evaluated, so timing a call times its stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from orchestrator.clients import (
    Channel,
    Deadlines,
    GrpcLanguage,
    GrpcSpeech,
    PromptCodes,
)
from orchestrator.failover import DEFAULT_FAILOVER, FailoverPolicy
from orchestrator.pending import Pending
from orchestrator.timeline import LanguageClient, SpeechClient
from protos.voicechat.v1 import codec_pb2, codec_pb2_grpc, language_pb2, perception_pb2, perception_pb2_grpc
from services.common.tensors import from_proto_np, to_proto_np


@dataclass
class PerceivedFrame:
    audio_embedding: np.ndarray  # (hidden,) float32
    encoder_out: np.ndarray  # (d_model,) float32
    transcript_delta: str  # what the frame added to the user's transcript (the session sums them)
    token_ids: list[int]  # RNNT emissions of this frame, specials included


class PerceptionStream(Protocol):
    def push(self, frame: np.ndarray) -> PerceivedFrame: ...

    def send_push(self, frame: np.ndarray) -> Pending[PerceivedFrame]: ...

    def close(self) -> None: ...


class PerceptionStreamClient(Protocol):
    def open(self) -> PerceptionStream: ...


class CodecStream(Protocol):
    def decode(self, codes: np.ndarray) -> np.ndarray: ...  # (Q,) int32 clean codes -> (1764,) float32

    def send_decode(self, codes: np.ndarray) -> Pending[np.ndarray]: ...

    def close(self) -> None: ...


class CodecStreamClient(Protocol):
    def prompt_codes(self, frames: int) -> np.ndarray: ...

    def open_stream(self) -> CodecStream: ...


@dataclass
class StreamClients:
    perception: PerceptionStreamClient
    language: LanguageClient  # opened with bfloat16 prompt rows
    speech: SpeechClient
    codec: CodecStreamClient

    def close(self) -> None:
        for client in (self.perception, self.language, self.speech, self.codec):
            channel = getattr(client, "channel", None)
            if channel is not None:
                channel.close()


# ------------------------------------------------------------------------------------------------ gRPC


class GrpcPerceptionStream:
    def __init__(self, channel: Channel, sample_rate_hz: int):
        self.stream = channel.stream("Stream")
        self.frame = 0
        self.transcript_length = 0  # characters of the user's transcript so far (the frames' deltas summed)
        try:
            self.stream.call(perception_pb2.PerceptionStreamRequest(
                open=perception_pb2.PerceptionOpen(sample_rate_hz=sample_rate_hz)))
        except BaseException:
            self.stream.close()
            raise

    def push(self, frame: np.ndarray) -> PerceivedFrame:
        return self.send_push(frame).result()

    def send_push(self, frame: np.ndarray) -> Pending[PerceivedFrame]:
        pending = self.stream.send(perception_pb2.PerceptionStreamRequest(frame=perception_pb2.PerceptionFrameInput(
            frame_index=self.frame, samples=to_proto_np(frame.astype(np.float32)))))
        self.frame += 1
        return pending.then(self._perceived)

    def _perceived(self, reply: perception_pb2.PerceptionStreamResponse) -> PerceivedFrame:
        """The frame as the service answered it (answers are taken in order). A service that sends the whole
        transcript adds what it holds past the characters so far (the text only grows at its end); a frame never
        carries the whole transcript on, so its cost does not grow with the conversation."""
        out = reply.frame
        delta = out.transcript[self.transcript_length :] if out.transcript else out.transcript_delta
        self.transcript_length += len(delta)
        return PerceivedFrame(from_proto_np(out.audio_embedding), from_proto_np(out.encoder_output), delta,
                              list(out.token_ids))

    def close(self) -> None:
        self.stream.close()


class GrpcPerceptionStreams:
    def __init__(self, address: str, sample_rate_hz: int = 16_000, deadlines: Deadlines | None = None):
        self.channel = Channel("perception", address, perception_pb2_grpc.PerceptionServiceStub, deadlines)
        self.sample_rate_hz = sample_rate_hz

    def open(self) -> GrpcPerceptionStream:
        return GrpcPerceptionStream(self.channel, self.sample_rate_hz)


class GrpcCodecStream:
    def __init__(self, channel: Channel):
        self.stream = channel.stream("DecodeStream")
        self.frame = 0
        try:
            self.stream.call(codec_pb2.CodecDecodeStreamRequest(open=codec_pb2.CodecDecodeOpen()))
        except BaseException:
            self.stream.close()
            raise

    def decode(self, codes: np.ndarray) -> np.ndarray:
        return self.send_decode(codes).result()

    def send_decode(self, codes: np.ndarray) -> Pending[np.ndarray]:
        pending = self.stream.send(codec_pb2.CodecDecodeStreamRequest(frame=codec_pb2.CodecDecodeFrameInput(
            frame_index=self.frame, codes=to_proto_np(codes.astype(np.int32)))))
        self.frame += 1
        return pending.then(lambda reply: from_proto_np(reply.frame.samples))

    def close(self) -> None:
        self.stream.close()


class GrpcCodecStreams:
    def __init__(self, address: str, deadlines: Deadlines | None = None):
        self.channel = Channel("codec", address, codec_pb2_grpc.CodecServiceStub, deadlines)
        self.prompt_codes = PromptCodes(self.channel)

    def open_stream(self) -> GrpcCodecStream:
        return GrpcCodecStream(self.channel)


def grpc_stream_clients(addresses: dict[str, str], deadlines: Deadlines | None = None,
                        failover: FailoverPolicy | None = DEFAULT_FAILOVER) -> StreamClients:
    """Clients of the four services at `addresses` (any gRPC targets; see Channel), with these deadlines; a
    session's streams move to another replica when theirs fails, under `failover` (None: they end with it)."""
    clients = StreamClients(
        GrpcPerceptionStreams(addresses["perception"], deadlines=deadlines),
        GrpcLanguage(addresses["llm"], prefix_precision=language_pb2.PREFIX_PRECISION_BFLOAT16, deadlines=deadlines),
        GrpcSpeech(addresses["tts"], deadlines),
        GrpcCodecStreams(addresses["codec"], deadlines),
    )
    for client in (clients.perception, clients.language, clients.speech, clients.codec):
        client.channel.failover = failover
    return clients


@contextlib.contextmanager
def connect_streams(model: Path, *, services: dict[str, str] | None = None, in_process: bool = False,
                    deadlines: Deadlines | None = None, flags: dict[str, list[str]] | None = None,
                    mps: bool = False, envs: dict[str, dict[str, str]] | None = None,
                    replicas: dict[str, int] | None = None, gpus: dict[str, list[str]] | None = None,
                    children: list | None = None,
                    failover: FailoverPolicy | None = DEFAULT_FAILOVER) -> Iterator[StreamClients]:
    """Stream clients to the four services: started here as children (the default; listed in `children` when
    given, for a supervisor), already running (`services`), or the engines in this process. Call from the main
    thread (children die with it)."""
    from orchestrator.connect import serving

    if in_process:
        from orchestrator.local import LocalEngines  # MLX and the engines, only when asked for

        engines = LocalEngines(model)
        try:
            yield engines.clients()
        finally:
            engines.close()
        return
    with serving(model, services, flags, mps, envs, replicas, gpus, children) as addresses:
        clients = grpc_stream_clients(addresses, deadlines, failover)
        try:
            yield clients
        finally:
            clients.close()
