"""The perception service over real gRPC (grpc.aio on an ephemeral port) against the engine called directly."""

import asyncio
import contextlib
from pathlib import Path

import grpc
import mlx.core as mx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.voicechat.v1 import perception_pb2 as pb
from protos.voicechat.v1 import perception_pb2_grpc
from services.common.engine_thread import EngineThread
from services.common.server import start_server
from services.common.tensors import from_proto_np, to_proto_np
from services.perception.engine import PerceptionEngine
from services.perception.service import SERVICE_NAME, PerceptionServicer, registrations
from tests.conftest import QUESTION_WAV, service_process, terminate

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
RATE, N = 16000, 1280
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _question() -> np.ndarray:
    import wave

    with wave.open(str(QUESTION_WAV)) as f:
        assert f.getframerate() == RATE and f.getnchannels() == 1
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype=np.int16)
    return (pcm.astype(np.float32) / 32768.0)[: N * 8]


WAVE = _question()


@pytest.fixture(scope="module")
def direct(tiny_checkpoint):
    """Results of the engine called directly, on the test thread."""
    engine = PerceptionEngine.load(tiny_checkpoint)
    result = engine.encode(WAVE)
    stream = engine.open_stream()
    frames = [stream.push(WAVE[i : i + N]) for i in range(0, WAVE.size, N)]
    return result, frames


@contextlib.asynccontextmanager
async def server(checkpoint, load=True):
    engine_thread = EngineThread("perception-test")
    servicer = PerceptionServicer(engine_thread)
    running = await start_server(registrations(servicer), [SERVICE_NAME], host=HOST, port=0, max_message_mb=8)
    channel = grpc.aio.insecure_channel(f"{HOST}:{running.port}")
    try:
        if load:
            await running.become_ready(lambda: servicer.load(checkpoint))
        running.servicer = servicer  # for tests that load it themselves
        yield running, perception_pb2_grpc.PerceptionServiceStub(channel), channel
    finally:
        await channel.close()
        await running.stop(0)
        engine_thread.close()


def _open(rate=RATE):
    return pb.PerceptionStreamRequest(open=pb.PerceptionOpen(sample_rate_hz=rate, session_label="t"))


def _frame(i, samples):
    return pb.PerceptionStreamRequest(frame=pb.PerceptionFrameInput(frame_index=i, samples=to_proto_np(samples)))


async def _run_stream(stub, requests):
    call = stub.Stream(iter(requests))
    return [r async for r in call]


def test_unary_encode_is_byte_identical_to_the_engine(tiny_checkpoint, direct):
    result, _ = direct

    async def main():
        async with server(tiny_checkpoint) as (_, stub, _ch):
            return await stub.Encode(pb.EncodeRequest(waveform=to_proto_np(WAVE), sample_rate_hz=RATE))

    reply = asyncio.run(main())
    for name, ours in (("mel", result.mel), ("encoder_output", result.encoder_out),
                       ("audio_embeds", result.audio_embeds)):
        got = from_proto_np(getattr(reply, name))
        assert got.dtype == np.float32 and got.tobytes() == np.array(ours).tobytes(), name
    assert reply.frames == result.encoder_out.shape[0] == 9  # 1 + 10240 // 160 = 65 mel frames -> 33 -> 17 -> 9
    assert reply.transcript == result.transcript
    assert list(reply.transcript_token_ids) == result.token_ids


def test_stream_is_byte_identical_to_the_engine(tiny_checkpoint, direct):
    _, frames = direct

    async def main():
        async with server(tiny_checkpoint) as (_, stub, _ch):
            reqs = [_open()] + [_frame(k, WAVE[i : i + N]) for k, i in enumerate(range(0, WAVE.size, N))]
            return await _run_stream(stub, reqs)

    replies = asyncio.run(main())
    assert replies[0].opened.frame_samples == N and replies[0].opened.embedding_dim == 128
    assert len(replies) == 1 + len(frames)
    summed = ""
    for reply, ours in zip(replies[1:], frames, strict=True):
        f = reply.frame
        assert f.frame_index == ours.frame_index
        assert from_proto_np(f.audio_embedding).tobytes() == np.array(ours.audio_embedding).tobytes()
        assert from_proto_np(f.encoder_output).tobytes() == np.array(ours.encoder_out).tobytes()
        summed += f.transcript_delta  # the transcript itself is not sent with every frame: the deltas sum to it
        assert (f.transcript_delta, f.transcript, summed, list(f.token_ids)) == (
            ours.transcript_delta, "", ours.transcript, ours.token_ids)


def test_two_interleaved_streams_equal_two_separate_runs(tiny_checkpoint, direct):
    _, frames = direct
    other = np.ascontiguousarray(WAVE[::-1])  # a different utterance for the second session

    async def main():
        async with server(tiny_checkpoint) as (_, stub, _ch):
            alone = await _run_stream(stub, [_open()] + [_frame(k, other[k * N : (k + 1) * N]) for k in range(8)])
            a, b = stub.Stream(), stub.Stream()
            await a.write(_open())
            await b.write(_open())
            got_a, got_b = [await a.read()], [await b.read()]
            for k in range(8):  # strictly alternate frames of the two sessions
                await a.write(_frame(k, WAVE[k * N : (k + 1) * N]))
                got_a.append(await a.read())
                await b.write(_frame(k, other[k * N : (k + 1) * N]))
                got_b.append(await b.read())
            await a.done_writing()
            await b.done_writing()
            return alone, got_a, got_b

    alone, got_a, got_b = asyncio.run(main())
    summed = ""
    for reply, ours in zip(got_a[1:], frames, strict=True):
        assert from_proto_np(reply.frame.encoder_output).tobytes() == np.array(ours.encoder_out).tobytes()
        summed += reply.frame.transcript_delta
        assert summed == ours.transcript
    assert [r.SerializeToString() for r in got_b] == [r.SerializeToString() for r in alone]


@pytest.mark.parametrize(
    "request_kwargs,needle",
    [
        ({"waveform": to_proto_np(WAVE), "sample_rate_hz": 8000}, "sample_rate_hz must be 16000"),
        ({"waveform": to_proto_np(np.zeros(0, np.float32)), "sample_rate_hz": RATE}, "empty"),
        ({"waveform": to_proto_np(np.array([0.0, np.nan] * 400, np.float32)), "sample_rate_hz": RATE}, "non-finite"),
        ({"sample_rate_hz": RATE}, "waveform is missing"),
    ],
)
def test_bad_encode_requests_are_invalid_argument(tiny_checkpoint, request_kwargs, needle):
    async def main():
        async with server(tiny_checkpoint) as (_, stub, _ch):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Encode(pb.EncodeRequest(**request_kwargs))
            return info.value

    err = asyncio.run(main())
    assert err.code() == INVALID and needle in err.details()


@pytest.mark.parametrize(
    "requests,needle",
    [
        ([_frame(0, np.zeros(N, np.float32))], "first Stream message must be `open`"),
        ([_open(44100)], "sample_rate_hz must be 16000"),
        ([_open(), _frame(0, np.zeros(N - 1, np.float32))], "exactly 1280 samples"),
        ([_open(), _frame(0, np.full(N, np.inf, np.float32))], "non-finite"),
        ([_open(), _frame(1, np.zeros(N, np.float32))], "out of order"),
        ([_open(), _open()], "must be `frame`"),
    ],
)
def test_bad_stream_messages_are_invalid_argument(tiny_checkpoint, requests, needle):
    async def main():
        async with server(tiny_checkpoint) as (_, stub, _ch):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _run_stream(stub, requests)
            return info.value

    err = asyncio.run(main())
    assert err.code() == INVALID and needle in err.details()


def test_not_serving_until_loaded(tiny_checkpoint):
    async def main():
        async with server(tiny_checkpoint, load=False) as (running, stub, channel):
            health = health_pb2_grpc.HealthStub(channel)
            before = (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))).status
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Encode(pb.EncodeRequest(waveform=to_proto_np(WAVE), sample_rate_hz=RATE))
            await running.become_ready(lambda: running.servicer.load(tiny_checkpoint))
            after = (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))).status
            reply = await stub.Encode(pb.EncodeRequest(waveform=to_proto_np(WAVE), sample_rate_hz=RATE))
            return before, info.value, after, reply.frames

    before, err, after, frames = asyncio.run(main())
    assert before == health_pb2.HealthCheckResponse.NOT_SERVING
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.details()
    assert after == health_pb2.HealthCheckResponse.SERVING and frames == 9


def test_cli_serves_and_stops_on_sigterm(tiny_checkpoint):
    async def call(address):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = perception_pb2_grpc.PerceptionServiceStub(channel)
            return await stub.Encode(pb.EncodeRequest(waveform=to_proto_np(WAVE), sample_rate_hz=RATE))

    with service_process("perception", tiny_checkpoint) as (address, process):
        assert asyncio.run(call(address)).frames == 9
        assert terminate(process) == 0


def test_engine_arrays_are_float32(direct):
    result, frames = direct
    assert result.audio_embeds.dtype == mx.float32 and frames[0].audio_embedding.dtype == mx.float32
