"""Errors inside a conversation: a message that does not parse ends a gRPC conversation with INVALID_ARGUMENT, and
a conversation that ends (or a client that leaves mid-append) frees its slot within one frame time, so a client
that reconnects at once is not told the server is busy. (The realtime gateway's one error per service failure is
in tests/realtime/test_realtime_protocol.py.)"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest

from protos.voicechat.v1 import conversation_pb2 as pb
from protos.voicechat.v1 import conversation_pb2_grpc
from tests.conftest import load_golden
from tests.integration.test_conversation_service import N, Stack, chunks, configure, converse, describe, flush
from tests.realtime.fakes import Client, FakeFactory, FakeSession, pcm16_b64, serve

FRAME_S = 0.08  # one frame of the checkpoint (config.json frame_duration)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    stack = Stack(tiny_checkpoint)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def wave():
    return load_golden("online")[0]["waveform"]


def test_bytes_that_do_not_parse_after_configure_end_with_invalid_argument_and_an_error(stack):
    with grpc.insecure_channel(stack.address) as channel:
        raw = channel.stream_stream("/voicechat.v1.ConversationService/Converse", request_serializer=None,
                                    response_deserializer=None)
        call = raw(iter([configure().SerializeToString(), b"\xff\xff\xff\xff"]), timeout=60)
        got = []
        with pytest.raises(grpc.RpcError) as ended:
            for message in call:
                got.append(message)
    events = [describe(pb.ConverseResponse.FromString(m)) for m in got]
    assert [e[:2] for e in events] == [("ready",), ("error", "ERROR_CODE_INVALID_REQUEST")]
    assert events[1][2].startswith("a request message does not parse: ")
    assert events[1][2].endswith("; the conversation ended")
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ended.value.details() == events[1][2]
    assert stack.conversation.metrics.value("voicechat_errors_total", code="ERROR_CODE_INVALID_REQUEST") == 1


def test_a_cancelled_conversation_frees_its_slot_within_a_frame_and_the_client_reconnects(stack, wave):
    conversation = stack.conversation
    conversation.max_sessions = 1
    release = threading.Event()

    def held():
        yield configure()
        yield from chunks(wave, size=len(wave))  # the whole input at once: frames of work queued behind it
        release.wait(30)

    try:
        with grpc.insecure_channel(stack.address) as channel:
            call = conversation_pb2_grpc.ConversationServiceStub(channel).Converse(held())
            assert next(call).WhichOneof("event") == "ready"
            assert any(next(call).WhichOneof("event") == "audio" for _ in range(6))
            call.cancel()
            cancelled = time.monotonic()
            while conversation.live_sessions and time.monotonic() - cancelled < 10:
                time.sleep(0.002)
            freed_after = time.monotonic() - cancelled
        got = converse(stack.address, [configure(), *chunks(wave[:N]), flush()])
    finally:
        release.set()
        conversation.max_sessions = 4
    assert freed_after <= FRAME_S, f"the slot was freed {freed_after:.3f} s after the cancel"
    assert got[0] == ("ready",) and got[-1] == ("done", 1)
    assert stack.wait_idle() == {name: 0 for name in stack.live()}  # the cancelled sessions were closed too


class SlowSession(FakeSession):
    """A frame takes 0.2 s: an append of many frames keeps the connection's worker busy for seconds."""

    def _frame(self, samples):
        time.sleep(0.2)
        return super()._frame(samples)


class SlowFactory(FakeFactory):
    def __call__(self, **options):
        session = SlowSession(**options)
        self.sessions.append(session)
        return session


def test_a_client_that_leaves_mid_append_frees_its_slot_at_once_and_may_reconnect():
    factory = SlowFactory()

    async def scenario(server):
        first = await Client.open(server.url)
        await first.configure()
        await first.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(wave_of(20 * N))})
        await first.until("response.audio.delta")
        first.ws.transport.abort()  # gone, 19 frames of work still queued on its worker
        left = asyncio.get_running_loop().time()
        while server.live_sessions:
            await asyncio.sleep(0.002)
        freed_after = asyncio.get_running_loop().time() - left
        second = await Client.open(server.url)
        return freed_after, await second.configure()

    freed_after, updated = serve(scenario, factory)
    assert freed_after <= FRAME_S
    assert updated["session"]["state"] == "ready"


def wave_of(n: int) -> np.ndarray:
    return (np.arange(n) % 100).astype(np.float32) / 1000.0
