"""Fixtures of the fuzz suite: the four network services as real processes once per module (with the small limits
of SERVICE_FLAGS, and a metrics port each, which shows their open sessions), the facts a valid request needs,
each RPC's reference answers taken before any fuzzing, and the orchestrator's conversation service and realtime
WebSocket in a background event loop of this process, over those four processes (so its live-session counts can
be read directly)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from orchestrator.conversation import SERVICE_NAME, ConversationServicer, registrations
from orchestrator.launcher import spawn_service, stop, wait_ready
from orchestrator.realtime import OnlineSessionFactory, RealtimeServer
from orchestrator.stream_clients import grpc_stream_clients
from protos.voicechat.v1 import codec_pb2, codec_pb2_grpc, speech_pb2, speech_pb2_grpc
from services.common.config import VoiceChatConfig
from services.common.server import RunningServer, start_server
from tests.fuzz.harness import (
    CONVERSATION_MAX_SECONDS,
    NETWORK_PROTOS,
    REALTIME_LIMITS,
    SERVICE_FLAGS,
    Facts,
    ServiceHandle,
    reference_answers,
    wait_until,
)

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def network(tiny_checkpoint) -> Iterator[dict[str, ServiceHandle]]:
    """perception, llm, tts and codec as `python -m services.NAME` processes with a metrics port, started once for
    the module (as `service_process` starts one, but together, and keeping the metrics URL each announces)."""
    children = [spawn_service(name, tiny_checkpoint, [*SERVICE_FLAGS[name], "--metrics-port", "0"])
                for name in NETWORK_PROTOS]
    handles: dict[str, ServiceHandle] = {}
    try:
        wait_ready(children, timeout_s=60)
        for child in children:
            wait_until(lambda child=child: bool(child.metrics_url), 10, f"the {child.name} service's metrics line")
            handles[child.name] = ServiceHandle(child.name, child.address, child.process,
                                                grpc.insecure_channel(child.address), child.metrics_url)
        yield handles
    finally:
        for handle in handles.values():
            handle.channel.close()
        stop(children)


@pytest.fixture(scope="module")
def facts(tiny_checkpoint, network) -> Facts:
    config = VoiceChatConfig.load(tiny_checkpoint)
    speech = speech_pb2_grpc.SpeechServiceStub(network["tts"].channel).Describe(speech_pb2.SpeechDescribeRequest(),
                                                                               timeout=30)
    prompt = codec_pb2_grpc.CodecServiceStub(network["codec"].channel).PromptCodes(
        codec_pb2.PromptCodesRequest(frames=speech.prompt_frames), timeout=30)
    return Facts(input_rate=config.input_sample_rate, frame_samples=config.input_frame_samples,
                 hidden=config.text_config.hidden_size, text_vocab=config.text_config.vocab_size,
                 quantizers=speech.num_quantizers, codebook=speech.codebook_size,
                 output_rate=config.output_sample_rate, output_frame_samples=config.output_frame_samples,
                 prompt_codes=prompt.codes)


@pytest.fixture(scope="module")
def reference(network, facts) -> dict[str, list[bytes]]:
    """The reference answers of the freshly started services, before any fuzzing."""
    return reference_answers(network, facts)


class Orchestrator:
    """The conversation service and the realtime gateway on one event loop in a background thread."""

    def __init__(self, model: Path, addresses: dict[str, str]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-orchestrator", daemon=True)
        self.thread.start()
        self.clients = grpc_stream_clients(addresses)
        self.conversation = ConversationServicer(self.clients, model, max_sessions=2,
                                                 max_streaming_seconds=CONVERSATION_MAX_SECONDS)
        self.realtime = RealtimeServer(OnlineSessionFactory(self.clients, model), host=HOST, port=0,
                                       limits=REALTIME_LIMITS)
        self.grpc_server: RunningServer = self.run(self._start())
        self.address = f"{HOST}:{self.grpc_server.port}"
        self.channel = grpc.insecure_channel(self.address)

    def run(self, coroutine, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    async def _start(self) -> RunningServer:
        running = await start_server(registrations(self.conversation), [SERVICE_NAME], host=HOST, port=0)
        await running.become_ready()
        await self.realtime.start()
        return running

    async def _stop(self) -> None:
        await self.realtime.stop()
        await self.grpc_server.stop(0)

    def close(self) -> None:
        self.channel.close()
        self.run(self._stop())
        self.clients.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def orchestrator(tiny_checkpoint, network) -> Iterator[Orchestrator]:
    stack = Orchestrator(tiny_checkpoint, {name: handle.address for name, handle in network.items()})
    yield stack
    stack.close()
