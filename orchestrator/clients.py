"""The timeline's clients over gRPC: numpy arrays in, numpy arrays out (the wire carries raw bytes in the
producer's dtype). Their in-process twins, which call the engines, are in orchestrator/local.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
from dataclasses import dataclass

import grpc
import numpy as np

from orchestrator.pending import Pending
from orchestrator.timeline import Clients, PerceptionResult, SpeechInfo
from orchestrator.transport import LoopCall, ThreadCall, await_on_loop, on_loop
from protos.voicechat.v1 import (
    codec_pb2,
    codec_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
    perception_pb2,
    perception_pb2_grpc,
    speech_pb2,
    speech_pb2_grpc,
)
from services.common.server import full_service_name
from services.common.tensors import from_proto_np, to_proto_np

MAX_MESSAGE_BYTES = 64 << 20

# How a channel's streams run (orchestrator/transport.py): "aio", every stream of the process on one event loop
# thread, or "threads", gRPC's synchronous streams (three threads a stream). VOICECHAT_TRANSPORT picks.
TRANSPORTS = ("aio", "threads")
TRANSPORT_ENV = "VOICECHAT_TRANSPORT"
DEFAULT_TRANSPORT = "aio"


def pick_transport(transport: str | None = None) -> str:
    """`transport`, else $VOICECHAT_TRANSPORT, else the default; one of TRANSPORTS."""
    source = "transport" if transport else TRANSPORT_ENV
    transport = transport or os.environ.get(TRANSPORT_ENV) or DEFAULT_TRANSPORT
    if transport not in TRANSPORTS:
        raise ValueError(f"{source} {transport!r}: must be one of {', '.join(TRANSPORTS)}")
    return transport

# The health-checked service name of each network, for client-side health checking across replicas.
HEALTH_SERVICES = {
    "perception": full_service_name(perception_pb2, "PerceptionService"),
    "llm": full_service_name(language_pb2, "LanguageService"),
    "tts": full_service_name(speech_pb2, "SpeechService"),
    "codec": full_service_name(codec_pb2, "CodecService"),
}


@dataclass(frozen=True)
class Deadlines:
    """How long the orchestrator waits on a service before it calls the service gone (seconds).

    A stream's first message (opening a session: the system-prompt prefill, the speech prefix) gets `open_s`,
    every later message (one frame) `frame_s`, a whole-utterance unary call `unary_s`. A frame may include a
    one-time compilation (the first frames, the streaming encoder once its caches fill), so `frame_s` is far above
    a frame's normal cost. A process that died fails its calls at once; one that hangs is caught by `frame_s`.
    """

    open_s: float = 60.0
    frame_s: float = 15.0
    unary_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("open_s", "frame_s", "unary_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"deadline {name} must be positive, got {getattr(self, name)}")


class ServiceError(RuntimeError):
    """A service that failed or went away, named in the message; `code` is the gRPC status name when one came."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code

    @property
    def refused_input(self) -> bool:
        """The service refused what it was sent (INVALID_ARGUMENT, RESOURCE_EXHAUSTED): it is up and well."""
        return self.code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")


def _fail(name: str, address: str, exc: grpc.RpcError) -> ServiceError:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ServiceError(f"the {name} service at {address} stopped responding ({code.name}: {detail})", code.name)
    return ServiceError(f"the {name} service at {address} failed: {code.name if code else 'error'}: {detail}",
                        code.name if code else None)


def service_config(name: str) -> str:
    """The channel's service config: round-robin over every address the target resolves to (the replicas of
    one network behind a DNS name or an `ipv4:` list), skipping replicas whose health is not SERVING."""
    return json.dumps({
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": HEALTH_SERVICES[name]},
    })


class Channel:
    """One network's channel and stub, with calls that turn gRPC failures into a ServiceError naming it.

    `address` is any gRPC target: HOST:PORT, `dns:///NAME:PORT` (every replica the name resolves to), or
    `ipv4:HOST:PORT,HOST:PORT`. Each new stream goes to the next healthy replica; a session is one stream,
    so it stays on the replica it started on until that replica fails, when `failover` (None: never) moves it
    to another (orchestrator/failover.py). `transport` (TRANSPORTS; default from VOICECHAT_TRANSPORT, else
    "aio") is how its streams run: on the process's client event loop, or on gRPC's threads.
    """

    failover = None  # a FailoverPolicy; set by grpc_stream_clients

    def __init__(self, name: str, address: str, stub_class, deadlines: Deadlines | None = None,
                 transport: str | None = None):
        self.name, self.address = name, address
        self.deadlines = deadlines or Deadlines()
        self.transport = pick_transport(transport)
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 2000),
                   ("grpc.service_config", service_config(name)),
                   # a restarted replica is tried again within a second or two, not after minutes of backoff
                   ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        # connect now, not at the first session's call: round robin picks among the replicas already connected,
        # so the first sessions would all land on whichever connected first
        if self.transport == "aio":
            self.channel = on_loop(lambda: grpc.aio.insecure_channel(address, options=options))
            on_loop(lambda: self.channel.get_state(try_to_connect=True))
        else:
            self.channel = grpc.insecure_channel(address, options=options)
            self._connecting = grpc.channel_ready_future(self.channel)
        self.stub = stub_class(self.channel)

    def unary(self, method: str, request, timeout: float | None = None):
        call, timeout = getattr(self.stub, method), timeout or self.deadlines.unary_s
        try:
            if self.transport == "aio":
                return await_on_loop(_answer(call, request, timeout))
            return call(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise _fail(self.name, self.address, exc) from None

    def open_call(self, method: str) -> LoopCall | ThreadCall:
        """The bidi call under a BidiStream (orchestrator/transport.py), on this channel's transport."""
        if self.transport == "aio":
            return LoopCall(getattr(self.stub, method))
        return ThreadCall(getattr(self.stub, method))

    def stream(self, method: str):
        """A BidiStream, or with a failover policy a ReplayStream (the same calls)."""
        if self.failover is None:
            return BidiStream(self, method)
        from orchestrator.failover import ReplayStream  # it builds on this module

        return ReplayStream(self, method, self.failover)

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the channel has a connection (to any replica); False after `timeout_s`."""
        if self.transport == "aio":
            try:
                await_on_loop(asyncio.wait_for(self.channel.channel_ready(), timeout_s))
                return True
            except TimeoutError:
                return False
        try:
            grpc.channel_ready_future(self.channel).result(timeout_s)
            return True
        except grpc.FutureTimeoutError:
            return False

    def close(self) -> None:
        if self.transport == "aio":
            await_on_loop(self.channel.close())
            return
        self._connecting.cancel()
        self.channel.close()


async def _answer(call, request, timeout: float):
    return await call(request, timeout=timeout)  # the call made here, on the loop


class BidiStream:
    """A bidirectional stream used as request/response pairs: `call(message)` sends one and waits for one;
    `send(message)` sends one and returns its Pending answer, so a caller may send the next request before the
    last answer is back (the service then starts on it with no round trip in between).

    Every answer has a deadline (the channel's `Deadlines`: `open_s` for the first, `frame_s` after, counted
    from when the caller starts waiting for it; a `warm` stream gets `frame_s` for the first too); a service that
    does not answer in time, or whose stream breaks, raises a ServiceError naming it, and the stream is then
    closed for good (a late answer can never be taken for the next request's). The call underneath runs on the
    channel's transport (Channel.open_call).
    """

    def __init__(self, channel: Channel, method: str, *, warm: bool = False):
        self.channel = channel
        self._call = channel.open_call(method)
        self._lock = threading.Lock()  # one taker of answers at a time
        self._answers = 1 if warm else 0  # warm (a replay on a replica already serving): open_s is never used
        self._broken: ServiceError | None = None

    def call(self, message):
        return self.send(message).result()

    def send(self, message) -> Pending:
        """Send one request; its answer comes from the returned Pending, after those of earlier requests."""
        if self._broken is not None:
            raise self._broken
        self._call.put(message)
        return Pending(self.receive)

    def receive(self):
        """The next answer (what the oldest Pending not yet taken returns)."""
        name, address = self.channel.name, self.channel.address
        with self._lock:
            if self._broken is not None:
                raise self._broken
            timeout = self.channel.deadlines.open_s if self._answers == 0 else self.channel.deadlines.frame_s
            self._answers += 1
            try:
                reply = self._call.get(timeout)
            except queue.Empty:
                self._broken = ServiceError(f"the {name} service at {address} did not answer within {timeout:g} s "
                                            "(deadline exceeded); its session was abandoned")
                self._call.cancel()
                raise self._broken from None
            if isinstance(reply, grpc.RpcError):
                self._broken = _fail(name, address, reply)
                raise self._broken
            if reply is LoopCall.EOF:
                self._broken = ServiceError(f"the {name} service at {address} ended the session unexpectedly")
                raise self._broken
            return reply

    def close(self) -> None:
        self._call.close()


# ------------------------------------------------------------------------------------------------ gRPC


class GrpcPerception:
    def __init__(self, address: str, deadlines: Deadlines | None = None):
        self.channel = Channel("perception", address, perception_pb2_grpc.PerceptionServiceStub, deadlines)

    def encode(self, waveform: np.ndarray) -> PerceptionResult:
        reply = self.channel.unary("Encode", perception_pb2.EncodeRequest(
            waveform=to_proto_np(waveform.astype(np.float32)), sample_rate_hz=16_000))
        return PerceptionResult(
            mel=from_proto_np(reply.mel), encoder=from_proto_np(reply.encoder_output),
            audio_embeds=from_proto_np(reply.audio_embeds), transcript=reply.transcript,
            transcript_ids=np.array(reply.transcript_token_ids, dtype=np.int32),
        )


@dataclass
class GrpcLanguageSession:
    stream: BidiStream
    prompt_positions: int
    prompt_embeds: np.ndarray
    frame: int = 0

    def step(self, audio_embedding: np.ndarray, forced_function: int | None = None) -> tuple[int, int]:
        return self.send_step(audio_embedding, forced_function).result()

    def send_step(self, audio_embedding: np.ndarray, forced_function: int | None = None) -> Pending[tuple[int, int]]:
        pending = self.stream.send(language_pb2.LanguageStreamRequest(step=language_pb2.LanguageStep(
            frame_index=self.frame, audio_embedding=to_proto_np(audio_embedding),
            forced_function_token_id=forced_function)))
        self.frame += 1
        return pending.then(lambda reply: (reply.step.text_token_id, reply.step.function_token_id))

    def close(self) -> None:
        self.stream.close()


class GrpcLanguage:
    def __init__(self, address: str, prefix_precision: int = language_pb2.PREFIX_PRECISION_FLOAT32,
                 deadlines: Deadlines | None = None):
        self.channel = Channel("llm", address, language_pb2_grpc.LanguageServiceStub, deadlines)
        self.prefix_precision = prefix_precision

    def open(self, system_prompt: str) -> GrpcLanguageSession:
        stream = self.channel.stream("Stream")
        reply = stream.call(language_pb2.LanguageStreamRequest(open=language_pb2.LanguageOpen(
            system_prompt=system_prompt, prefix_precision=self.prefix_precision)))
        opened = reply.opened
        embeds = (from_proto_np(opened.prompt_embeds) if opened.HasField("prompt_embeds")
                  else np.zeros((0, opened.hidden_size), np.float32))
        return GrpcLanguageSession(stream, opened.prompt_positions, embeds)


@dataclass
class GrpcSpeechSession:
    stream: BidiStream
    frame: int = 0

    def step(self, text_id: int) -> np.ndarray:
        return self.send_step(text_id).result()

    def send_step(self, text_id: int) -> Pending[np.ndarray]:
        pending = self.stream.send(speech_pb2.SpeechStreamRequest(step=speech_pb2.SpeechStep(
            frame_index=self.frame, text_token_id=text_id)))
        self.frame += 1
        return pending.then(lambda reply: from_proto_np(reply.step.codes))

    def close(self) -> None:
        self.stream.close()


# The speech service's description and the codec's prompt codes depend on the checkpoint alone, so a client
# asks for them once and keeps them (its replicas serve one checkpoint). Asked for every session, they would
# also take a round-robin pick each: with two replicas, every session's stream would land on the same one.


class GrpcSpeech:
    def __init__(self, address: str, deadlines: Deadlines | None = None):
        self.channel = Channel("tts", address, speech_pb2_grpc.SpeechServiceStub, deadlines)
        self._info: SpeechInfo | None = None

    def info(self) -> SpeechInfo:
        if self._info is None:
            reply = self.channel.unary("Describe", speech_pb2.SpeechDescribeRequest())
            self._info = SpeechInfo(reply.prompt_frames, reply.num_quantizers, tuple(reply.control_codes),
                                    tuple(reply.silence_codes))
        return self._info

    def open(self, seed: int, prompt_codes: np.ndarray, prefix_steps: int) -> GrpcSpeechSession:
        stream = self.channel.stream("Stream")
        stream.call(speech_pb2.SpeechStreamRequest(open=speech_pb2.SpeechOpen(
            seed=seed, prompt_codes=to_proto_np(prompt_codes.astype(np.int32)), prefix_steps=prefix_steps)))
        return GrpcSpeechSession(stream)


class PromptCodes:
    """The codec's prompt codes of each length, asked of the service once (see above)."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self._kept: dict[int, np.ndarray] = {}

    def __call__(self, frames: int) -> np.ndarray:
        if frames not in self._kept:
            self._kept[frames] = from_proto_np(
                self.channel.unary("PromptCodes", codec_pb2.PromptCodesRequest(frames=frames)).codes)
        return self._kept[frames].copy()


class GrpcCodec:
    def __init__(self, address: str, deadlines: Deadlines | None = None):
        self.channel = Channel("codec", address, codec_pb2_grpc.CodecServiceStub, deadlines)
        self.prompt_codes = PromptCodes(self.channel)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        reply = self.channel.unary("Decode", codec_pb2.CodecDecodeRequest(codes=to_proto_np(codes.astype(np.int32))))
        return from_proto_np(reply.waveform)


def grpc_clients(addresses: dict[str, str], deadlines: Deadlines | None = None) -> Clients:
    return Clients(GrpcPerception(addresses["perception"], deadlines),
                   GrpcLanguage(addresses["llm"], deadlines=deadlines),
                   GrpcSpeech(addresses["tts"], deadlines), GrpcCodec(addresses["codec"], deadlines))


def close_clients(clients: Clients) -> None:
    for client in (clients.perception, clients.language, clients.speech, clients.codec):
        channel = getattr(client, "channel", None)
        if channel is not None:
            channel.close()
