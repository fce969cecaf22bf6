"""The codec service over real gRPC (grpc.aio on port 0) against the engine called directly."""

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.voicechat.v1 import codec_pb2, codec_pb2_grpc
from services.codec.engine import CodecEngine
from services.codec.service import SERVICE_NAME, build_spec
from services.common.server import start_server
from services.common.tensors import from_proto_np, to_proto_np
from tests.conftest import GOLDEN, service_process, terminate

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
Q = 31


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> CodecEngine:
    return CodecEngine.load(tiny_checkpoint)


@contextlib.asynccontextmanager
async def codec_service(model_dir, max_frames=4096, max_message_mb=64):
    spec = build_spec(model_dir, max_frames)
    running = await start_server(
        spec.registrations, spec.service_names, host=HOST, port=0, max_message_mb=max_message_mb
    )
    channel = grpc.aio.insecure_channel(f"{HOST}:{running.port}")
    try:
        await running.become_ready(spec.load)
        yield codec_pb2_grpc.CodecServiceStub(channel), channel
    finally:
        await channel.close()
        await running.stop(0)
        spec.close()


def open_request():
    return codec_pb2.CodecDecodeStreamRequest(open=codec_pb2.CodecDecodeOpen())


def frame_request(index, codes):
    return codec_pb2.CodecDecodeStreamRequest(
        frame=codec_pb2.CodecDecodeFrameInput(frame_index=index, codes=to_proto_np(np.asarray(codes)))
    )


def random_codes(frames, seed):
    return np.random.default_rng(seed).integers(0, 256, (frames, Q), np.int32)


def test_unary_calls_are_byte_identical_to_the_engine(tiny_checkpoint, engine):
    wave = np.random.default_rng(0).uniform(-0.5, 0.5, 3 * 1764).astype(np.float32)
    codes = random_codes(4, seed=1)

    async def main():
        async with codec_service(tiny_checkpoint) as (stub, channel):
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            encoded = await stub.Encode(codec_pb2.CodecEncodeRequest(waveform=to_proto_np(wave), sample_rate_hz=22050))
            decoded = await stub.Decode(codec_pb2.CodecDecodeRequest(codes=to_proto_np(codes)))
            return encoded, decoded

    encoded, decoded = asyncio.run(main())
    assert encoded.codes == to_proto_np(engine.encode(wave))
    assert decoded.waveform == to_proto_np(engine.decode(codes))
    assert decoded.sample_rate_hz == 22050
    assert from_proto_np(decoded.waveform).shape == (4 * 1764,)


def test_interleaved_streams_are_independent_and_match_the_engine(tiny_checkpoint, engine):
    codes = {name: random_codes(5, seed) for name, seed in (("a", 2), ("b", 3))}
    expected = {}
    for name, frames in codes.items():
        stream = engine.open_stream()
        expected[name] = [stream.decode_frame(i, c) for i, c in enumerate(frames)]

    async def main():
        async with codec_service(tiny_checkpoint) as (stub, _):
            calls = {name: stub.DecodeStream() for name in codes}
            for call in calls.values():
                await call.write(open_request())
                opened = await call.read()
                assert (opened.opened.samples_per_frame, opened.opened.sample_rate_hz) == (1764, 22050)
            got = {name: [] for name in codes}
            for i in range(5):  # alternate the two sessions frame by frame
                for name, call in calls.items():
                    await call.write(frame_request(i, codes[name][i]))
                    response = await call.read()
                    assert response.frame.frame_index == i
                    got[name].append(response.frame.samples)
            for call in calls.values():
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
            return got

    got = asyncio.run(main())
    for name in codes:
        assert got[name] == [to_proto_np(s) for s in expected[name]]


async def status_of(coro):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value.code(), err.value.details()


def test_bad_input_is_invalid_argument(tiny_checkpoint):
    def decode(codes):
        return codec_pb2.CodecDecodeRequest(codes=to_proto_np(codes))

    def encode(wave, rate=0):
        return codec_pb2.CodecEncodeRequest(waveform=to_proto_np(wave), sample_rate_hz=rate)

    nan_wave = np.zeros(1764, np.float32)
    nan_wave[10] = np.nan
    cases = [
        ("Decode", decode(np.full((2, Q), 256, np.int32)), "code 256 is out of range"),
        ("Decode", decode(np.zeros((2, 8), np.int32)), "Q=31 codebooks, got shape (2, 8)"),
        ("Decode", decode(np.zeros((0, Q), np.int32)), "codes are empty"),
        ("Encode", encode(nan_wave), "1 non-finite samples"),
        ("Encode", encode(np.zeros(0, np.float32)), "has 0 samples; the codec needs at least 1764"),
        ("Encode", encode(np.zeros(1764, np.float32), rate=16000), "sample_rate_hz 16000 is not the codec's rate"),
    ]

    async def main():
        async with codec_service(tiny_checkpoint) as (stub, _):
            results = [await status_of(getattr(stub, method)(request)) for method, request, _ in cases]
            # the service still answers after the errors
            await stub.Decode(decode(np.zeros((1, Q), np.int32)))
            return results

    for (code, details), (_, _, message) in zip(asyncio.run(main()), cases, strict=True):
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in details


def test_stream_errors(tiny_checkpoint):
    async def run(requests):
        async with codec_service(tiny_checkpoint) as (stub, _):
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for response in stub.DecodeStream(iter(requests)):
                    received.append(response.WhichOneof("payload"))
            return err.value.code(), err.value.details(), received

    good = np.zeros(Q, np.int32)
    cases = [
        ([frame_request(0, good)], "the first DecodeStream message must be `open`", []),
        (
            [open_request(), frame_request(0, good), frame_request(2, good)],
            "frame_index 2 is out of order",
            ["opened", "frame"],
        ),
        ([open_request(), frame_request(0, np.zeros(Q + 1, np.int32))], "shape (Q,) with Q=31", ["opened"]),
        ([open_request(), frame_request(0, np.full(Q, 999, np.int32))], "code 999 is out of range", ["opened"]),
        ([open_request(), open_request()], "every DecodeStream message must be a `frame`", ["opened"]),
    ]
    for requests, message, payloads in cases:
        code, details, received = asyncio.run(run(requests))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in details
        assert received == payloads


def test_limits_are_resource_exhausted(tiny_checkpoint):
    async def main():
        async with codec_service(tiny_checkpoint, max_frames=2, max_message_mb=1) as (stub, _):
            too_many = codec_pb2.CodecDecodeRequest(codes=to_proto_np(np.zeros((3, Q), np.int32)))
            too_big = codec_pb2.CodecEncodeRequest(waveform=to_proto_np(np.zeros(300_000, np.float32)))
            return [await status_of(stub.Decode(too_many)), await status_of(stub.Encode(too_big))]

    (code, details), (big_code, _) = asyncio.run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 2" in details
    assert big_code == grpc.StatusCode.RESOURCE_EXHAUSTED  # the 1 MiB message limit


def test_main_serves_and_stops_on_sigterm(tiny_checkpoint):
    with service_process("codec", tiny_checkpoint) as (address, process):
        with grpc.insecure_channel(address) as channel:
            response = codec_pb2_grpc.CodecServiceStub(channel).Decode(
                codec_pb2.CodecDecodeRequest(codes=to_proto_np(np.zeros((1, Q), np.int32))), timeout=30
            )
            assert from_proto_np(response.waveform).shape == (1764,)
        assert terminate(process) == 0


def test_main_reports_a_bad_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    proc = subprocess.run(
        [sys.executable, "-m", "services.codec", "--model", str(tmp_path), "--port", "0"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("services.codec: error:")


def test_prompt_codes_are_the_reference_warmup_codes(tiny_checkpoint):
    golden = np.load(GOLDEN / "offline.npz")["prompt_codes"]

    async def main():
        async with codec_service(tiny_checkpoint) as (stub, channel):
            good = await stub.PromptCodes(codec_pb2.PromptCodesRequest(frames=golden.shape[0]))
            bad = await status_of(stub.PromptCodes(codec_pb2.PromptCodesRequest(frames=1)))
            return good, bad

    good, (code, message) = asyncio.run(main())
    assert np.array_equal(from_proto_np(good.codes), golden)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at least 2" in message
