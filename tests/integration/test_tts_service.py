"""The TTS SpeechService over a real grpc.aio server on port 0: codes byte-identical to the engine called
directly (and to the reference's goldens), interleaved sessions independent, bad input INVALID_ARGUMENT."""

import asyncio
import contextlib
import json
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.voicechat.v1 import speech_pb2, speech_pb2_grpc
from services.common.engine_thread import EngineThread
from services.common.server import start_server
from services.common.tensors import from_proto_np, to_proto_np
from services.tts.engine import TTSEngine
from services.tts.service import SERVICE_NAME, SpeechServicer
from tests.conftest import service_process, terminate

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "parity" / "golden"
HOST = "127.0.0.1"
FRAMES = 12  # steps per session: enough to pass the tiny model's 48-key sliding window with the prompt


@pytest.fixture(scope="module")
def engine_and_goldens(tiny_checkpoint):
    engine_thread = EngineThread("tts-test")
    engine = engine_thread.submit_sync(TTSEngine.load, tiny_checkpoint)
    goldens = {name: np.load(GOLDEN / f"{name}.npz") for name in ("offline", "offline_seed7")}
    yield engine_thread, engine, goldens
    engine_thread.close()


@contextlib.asynccontextmanager
async def tts_server(engine_thread, engine):
    servicer = SpeechServicer(engine_thread, engine)
    registrations = [(speech_pb2_grpc.add_SpeechServiceServicer_to_server, servicer)]
    running = await start_server(registrations, [SERVICE_NAME], host=HOST, port=0)
    await running.set_serving(True)
    channel = grpc.aio.insecure_channel(f"{HOST}:{running.port}")
    try:
        yield speech_pb2_grpc.SpeechServiceStub(channel), channel
    finally:
        await channel.close()
        await running.stop(0)


def open_request(seed, prompt_codes, prefix_steps=0):
    return speech_pb2.SpeechStreamRequest(open=speech_pb2.SpeechOpen(
        seed=seed, prompt_codes=to_proto_np(np.asarray(prompt_codes)), prefix_steps=prefix_steps))


def step_request(frame_index, text_id):
    return speech_pb2.SpeechStreamRequest(step=speech_pb2.SpeechStep(frame_index=frame_index, text_token_id=text_id))


async def open_stream(stub, seed, prompt_codes):
    call = stub.Stream()
    await call.write(open_request(seed, prompt_codes))
    opened = await call.read()
    assert opened.WhichOneof("payload") == "opened"
    assert opened.opened.prompt_frames == prompt_codes.shape[0]
    return call


async def step(call, frame_index, text_id):
    await call.write(step_request(frame_index, text_id))
    result = (await call.read()).step
    assert result.frame_index == frame_index
    raw, clean = from_proto_np(result.codes), from_proto_np(result.clean_codes)
    assert raw.dtype == clean.dtype == np.int32 and raw.shape == clean.shape == (31,)
    return raw, clean


def test_stream_codes_are_byte_identical_to_the_engine_and_the_reference(engine_and_goldens):
    engine_thread, engine, goldens = engine_and_goldens
    g = goldens["offline"]
    text = [int(t) for t in g["text_tokens"][1 : FRAMES + 1]]

    def direct():
        session = engine.open_session(0, g["prompt_codes"], 0)
        return [session.step(t) for t in text]

    expected = engine_thread.submit_sync(direct)

    async def main():
        async with tts_server(engine_thread, engine) as (stub, _):
            call = await open_stream(stub, 0, g["prompt_codes"])
            got = [await step(call, i + 1, t) for i, t in enumerate(text)]
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
            return got

    got = asyncio.run(main())
    for (raw, clean), (raw_e, clean_e), ref_raw, ref_clean in zip(
        got, expected, g["audio_codes_raw"][1:], g["audio_codes"][1:], strict=False
    ):
        assert raw.tobytes() == raw_e.tobytes() and clean.tobytes() == clean_e.tobytes()
        np.testing.assert_array_equal(raw, ref_raw)
        np.testing.assert_array_equal(clean, ref_clean)


def test_interleaved_sessions_with_different_seeds_equal_separate_runs(engine_and_goldens):
    engine_thread, engine, goldens = engine_and_goldens
    runs = {0: goldens["offline"], 7: goldens["offline_seed7"]}

    async def main():
        async with tts_server(engine_thread, engine) as (stub, _):
            calls = {seed: await open_stream(stub, seed, g["prompt_codes"]) for seed, g in runs.items()}
            got = {seed: [] for seed in runs}
            for frame in range(1, FRAMES + 1):
                for seed, g in runs.items():  # alternate the two streams step by step
                    got[seed].append(await step(calls[seed], frame, int(g["text_tokens"][frame])))
            for call in calls.values():
                await call.done_writing()
            return got

    got = asyncio.run(main())
    for seed, g in runs.items():
        raw = np.stack([r for r, _ in got[seed]])
        np.testing.assert_array_equal(raw, g["audio_codes_raw"][1 : FRAMES + 1])
    assert not np.array_equal(got[0][-1][0], got[7][-1][0])


async def expect_invalid(stub, requests, match):
    call = stub.Stream()
    for request in requests:
        await call.write(request)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while True:
            if await call.read() == grpc.aio.EOF:
                break
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert match in err.value.details()


def test_bad_input_is_invalid_argument(engine_and_goldens):
    engine_thread, engine, goldens = engine_and_goldens
    codes = goldens["offline"]["prompt_codes"]

    async def main():
        async with tts_server(engine_thread, engine) as (stub, _):
            await expect_invalid(stub, [step_request(1, 5)], "first SpeechStream message must be `open`")
            await expect_invalid(stub, [open_request(0, codes[:-1])], "prompt_codes must have shape (37, 31)")
            await expect_invalid(stub, [open_request(0, codes.astype(np.float32))], "integer codes")
            await expect_invalid(stub, [speech_pb2.SpeechStreamRequest(open=speech_pb2.SpeechOpen(seed=1))],
                                 "prompt_codes is required")
            await expect_invalid(stub, [open_request(0, codes), step_request(1, 1024)], "text id 1024")
            await expect_invalid(stub, [open_request(0, codes), step_request(1, -3)], "text id -3")
            await expect_invalid(stub, [open_request(0, codes), step_request(1, 5), step_request(3, 5)],
                                 "frame_index 3: expected 2")
            await expect_invalid(stub, [open_request(0, codes), open_request(0, codes)], "must be a `step`")

    asyncio.run(main())


def test_prefix_steps_past_the_limit_are_refused_before_any_work(engine_and_goldens, tiny_checkpoint):
    """A huge prefix_steps used to run that many model steps at open (years for 2**31 - 1), holding the engine
    thread and so every other session; it is RESOURCE_EXHAUSTED at once, and the limit is a flag."""
    engine_thread, engine, goldens = engine_and_goldens
    codes = goldens["offline"]["prompt_codes"]

    async def main():
        async with tts_server(engine_thread, engine) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Stream(iter([open_request(0, codes, prefix_steps=2**31 - 1)]), timeout=10):
                    pass
            return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert "prefix_steps 2147483647 exceeds this service's limit of 1024" in err.details()

    with service_process("tts", tiny_checkpoint, "--max-prefix-steps", "2") as (address, _):
        with grpc.insecure_channel(address) as channel:
            stub = speech_pb2_grpc.SpeechServiceStub(channel)
            opened = list(stub.Stream(iter([open_request(0, codes, prefix_steps=2)]), timeout=30))
            assert [r.WhichOneof("payload") for r in opened] == ["opened"]
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Stream(iter([open_request(0, codes, prefix_steps=3)]), timeout=30))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 2 (--max-prefix-steps)" in refused.value.details()


def test_main_serves_health_and_stops_on_sigterm(tiny_checkpoint):
    async def check(address):
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            response = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            return response.status

    with service_process("tts", tiny_checkpoint) as (address, process):
        assert asyncio.run(check(address)) == health_pb2.HealthCheckResponse.SERVING
        assert terminate(process) == 0


def test_describe_reports_the_prompt_length_and_code_conventions(engine_and_goldens):
    engine_thread, engine, goldens = engine_and_goldens
    meta = json.loads(str(goldens["offline"]["meta"]))

    async def run():
        async with tts_server(engine_thread, engine) as (stub, _):
            return await stub.Describe(speech_pb2.SpeechDescribeRequest())

    reply = asyncio.run(run())
    assert reply.prompt_frames == goldens["offline"]["prompt_codes"].shape[0] == 37
    assert reply.num_quantizers == 31 and reply.codebook_size == engine.config.tts_config.codebook_size
    assert list(reply.control_codes) == meta["control_codes"]
    assert list(reply.silence_codes) == meta["codec_silence_tokens"]
