"""The language service over a real grpc.aio server on port 0, against the engine called directly."""

import asyncio
import contextlib

import grpc
import mlx.core as mx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.voicechat.v1 import language_pb2, language_pb2_grpc, tensor_pb2
from services.common.server import start_server
from services.common.tensors import from_proto_np, to_proto, to_proto_np
from services.llm.engine import LanguageEngine
from services.llm.service import SERVICE_NAME, build_spec
from tests.conftest import GOLDEN, service_process, terminate

HOST = "127.0.0.1"
PROMPT = "Be concise and answer in one sentence."
MAX_PROMPT = 32


@pytest.fixture(scope="module")
def embeds():
    z = np.load(GOLDEN / "offline_prompt.npz")
    return z["audio_embeds"][len(z["prompt_ids"]) :][:24]


@contextlib.asynccontextmanager
async def llm_server(model_dir):
    spec = build_spec(model_dir, max_prompt_tokens=MAX_PROMPT)
    running = await start_server(spec.registrations, spec.service_names, host=HOST, port=0)
    channel = grpc.aio.insecure_channel(f"{HOST}:{running.port}")
    try:
        await running.become_ready(spec.load)
        servicer = spec.registrations[0][1]
        yield language_pb2_grpc.LanguageServiceStub(channel), servicer, channel
    finally:
        await channel.close()
        await running.stop(0)
        spec.close()


def open_request(prompt="", ids=(), full_history=False, precision=language_pb2.PREFIX_PRECISION_UNSPECIFIED):
    return language_pb2.LanguageStreamRequest(open=language_pb2.LanguageOpen(
        system_prompt=prompt, prompt_token_ids=list(ids), full_history=full_history, prefix_precision=precision))


def step_request(index, row, return_logits=False):
    tensor = to_proto(row) if isinstance(row, mx.array) else to_proto_np(row)
    return language_pb2.LanguageStreamRequest(step=language_pb2.LanguageStep(
        frame_index=index, audio_embedding=tensor, return_logits=return_logits))


async def run_stream(stub, rows, prompt="", return_logits=False, precision=language_pb2.PREFIX_PRECISION_UNSPECIFIED):
    call = stub.Stream()
    await call.write(open_request(prompt, precision=precision))
    opened = (await call.read()).opened
    results = []
    for i, row in enumerate(rows):
        await call.write(step_request(i, row, return_logits))
        results.append((await call.read()).step)
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    return opened, results


def engine_run(engine, rows, prompt=""):
    session = engine.open_session(system_prompt=prompt)
    outs = [session.step(mx.array(row), return_logits=True) for row in rows]
    engine.close_session(session)
    return session, outs


async def live_sessions(servicer):
    return await servicer.engine_thread.run(lambda: servicer.engine.live_sessions)


def test_stream_gives_the_engines_ids_and_logits_byte_for_byte(tiny_checkpoint, embeds):
    direct_session, direct = engine_run(LanguageEngine.load(tiny_checkpoint), embeds, PROMPT)

    async def main():
        async with llm_server(tiny_checkpoint) as (stub, servicer, channel):
            health_stub = health_pb2_grpc.HealthStub(channel)
            health = await health_stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            opened, results = await run_stream(stub, embeds, PROMPT, return_logits=True)
            assert opened.prompt_positions == direct_session.prompt_positions == 15
            assert opened.hidden_size == 128
            assert [r.frame_index for r in results] == list(range(len(embeds)))
            assert [(r.text_token_id, r.function_token_id) for r in results] == \
                [(o.text_id, o.function_id) for o in direct]
            for r, o in zip(results, direct, strict=True):
                assert from_proto_np(r.text_logits).tobytes() == np.array(o.text_logits).tobytes()
                assert from_proto_np(r.function_logits).tobytes() == np.array(o.function_logits).tobytes()
            _, plain = await run_stream(stub, embeds[:3])
            assert not plain[0].HasField("text_logits")  # logits only when asked for
            assert await live_sessions(servicer) == 0

    asyncio.run(main())


def test_four_interleaved_streams_match_four_separate_runs(tiny_checkpoint, embeds):
    prompts = ["", PROMPT, "", "Hello there."]
    rows = embeds[:10]

    async def main():
        async with llm_server(tiny_checkpoint) as (stub, servicer, _):
            separate = [[(r.text_token_id, r.function_token_id) for r in (await run_stream(stub, rows, p))[1]]
                        for p in prompts]
            calls = [stub.Stream() for _ in prompts]
            for call, p in zip(calls, prompts, strict=True):
                await call.write(open_request(p))
                await call.read()
            assert await live_sessions(servicer) == 4
            together = [[] for _ in prompts]
            for i, row in enumerate(rows):
                for call in calls:  # all four writes in flight before any read
                    await call.write(step_request(i, row))
                for k, call in enumerate(calls):
                    step = (await call.read()).step
                    together[k].append((step.text_token_id, step.function_token_id))
            for call in calls:
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
            assert together == separate
            assert await live_sessions(servicer) == 0

    asyncio.run(main())


def test_a_closed_or_cancelled_stream_frees_its_session(tiny_checkpoint, embeds):
    async def main():
        async with llm_server(tiny_checkpoint) as (stub, servicer, _):
            call = stub.Stream()
            await call.write(open_request(PROMPT))
            await call.read()
            await call.write(step_request(0, embeds[0]))
            await call.read()
            assert await live_sessions(servicer) == 1
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
            assert await live_sessions(servicer) == 0

            call = stub.Stream()
            await call.write(open_request())
            await call.read()
            assert await live_sessions(servicer) == 1
            call.cancel()
            for _ in range(200):  # the server learns of the cancellation asynchronously
                if await live_sessions(servicer) == 0:
                    break
                await asyncio.sleep(0.01)
            assert await live_sessions(servicer) == 0

    asyncio.run(main())


BAD_STEPS = [
    (np.zeros(127, np.float32), "audio embedding must be float32 of shape (128,); got float32 of shape (127,)"),
    (np.zeros(128, np.float16), "audio embedding must be float32 of shape (128,); got float16 of shape (128,)"),
    (mx.zeros(128, mx.bfloat16),
     "audio embedding must be float32 of shape (128,); got bfloat16 of shape (128,)"),
    (np.zeros(128, np.int32), "audio embedding must be float32 of shape (128,); got int32 of shape (128,)"),
]


def test_bad_input_is_invalid_argument_with_a_clear_message(tiny_checkpoint, embeds):
    async def expect_invalid(requests, message):
        call = stub_holder[0].Stream()
        for request in requests:
            await call.write(request)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await call.read() != grpc.aio.EOF:
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == message

    stub_holder = []

    async def main():
        async with llm_server(tiny_checkpoint) as (stub, servicer, _):
            stub_holder.append(stub)
            await expect_invalid([step_request(0, embeds[0])],
                                 "the first Stream message must be `open` (LanguageOpen)")
            await expect_invalid([open_request(ids=[7] * 40)],
                                 f"system prompt is 40 tokens (bos/eos included); the limit is {MAX_PROMPT}")
            for row, message in BAD_STEPS:
                await expect_invalid([open_request(), step_request(0, row)], message)
            await expect_invalid([open_request(), step_request(0, embeds[0]), step_request(5, embeds[1])],
                                 "frame_index 5 is out of order; expected 1")
            await expect_invalid([open_request(), open_request()],
                                 "after `open`, every Stream message must be a `step` (LanguageStep)")
            assert await live_sessions(servicer) == 0

    asyncio.run(main())


def test_an_empty_embedding_with_a_dimension_past_mlx_limits_is_invalid_argument(tiny_checkpoint):
    """Shape [0, 2**31] has no elements, so its empty payload agrees with it; MLX dimensions are 32-bit, and the
    step used to fail inside MLX with OverflowError, answered INTERNAL. The row is checked before it reaches
    MLX."""
    empty = tensor_pb2.Tensor(shape=[0, 2**31], dtype=tensor_pb2.DTYPE_FLOAT32)
    step = language_pb2.LanguageStreamRequest(step=language_pb2.LanguageStep(frame_index=0, audio_embedding=empty))

    async def main():
        async with llm_server(tiny_checkpoint) as (stub, servicer, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Stream(iter([open_request(), step]), timeout=30):
                    pass
            assert await live_sessions(servicer) == 0
            return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details() == "audio embedding must be float32 of shape (128,); got float32 of shape (0, 2147483648)"


def test_python_m_services_llm_serves_and_stops_on_sigterm(tiny_checkpoint, embeds):
    with service_process("llm", tiny_checkpoint) as (address, process):
        with grpc.insecure_channel(address) as channel:
            stub = language_pb2_grpc.LanguageServiceStub(channel)
            responses = list(stub.Stream(iter([open_request(), step_request(0, embeds[0])]), timeout=30))
        assert responses[0].opened.hidden_size == 128
        assert responses[1].step.frame_index == 0
        assert terminate(process) == 0


@pytest.mark.parametrize("golden, precision", [
    ("offline_prompt", language_pb2.PREFIX_PRECISION_FLOAT32),
    ("online_prompt", language_pb2.PREFIX_PRECISION_BFLOAT16),
])
def test_each_stream_chooses_its_prefix_precision(tiny_checkpoint, golden, precision):
    """The offline turn feeds the prompt rows as float32, the online session as bf16; both match their golden."""
    z = np.load(GOLDEN / f"{golden}.npz")
    rows = z["stream_audio_embeds"] if "stream_audio_embeds" in z else z["audio_embeds"][len(z["prompt_ids"]):]
    offline = np.load(GOLDEN / "offline_prompt.npz")

    async def main():
        async with llm_server(tiny_checkpoint) as (stub, servicer, channel):
            return await run_stream(stub, rows, PROMPT, precision=precision)

    opened, results = asyncio.run(main())
    prefix = from_proto_np(opened.prompt_embeds)
    assert prefix.dtype == np.float32 and prefix.shape == (opened.prompt_positions, 128)
    assert np.array_equal(prefix, offline["audio_embeds"][: opened.prompt_positions])
    assert [r.text_token_id for r in results] == z["text_tokens"].tolist()
    assert [r.function_token_id for r in results] == z["function_tokens"].tolist()


@pytest.mark.parametrize("extra", [[], ["--float32-weights"]], ids=["bf16", "bf16-float32"])
def test_weights_dtype_bfloat16_serves_the_dequantized_model(tiny4_checkpoint, extra):
    """`--weights-dtype bfloat16` gives the reference's ids on the checkpoint dequantized to bf16, also with the
    dequantized weights kept in float32 (`--float32-weights`)."""
    golden = np.load(GOLDEN / "offline_4bit_bf16.npz")
    rows = golden["audio_embeds"][:6]
    with service_process("llm", tiny4_checkpoint, "--weights-dtype", "bfloat16", *extra) as (address, process):
        with grpc.insecure_channel(address) as channel:
            stub = language_pb2_grpc.LanguageServiceStub(channel)
            requests = [open_request(), *(step_request(i, row) for i, row in enumerate(rows))]
            responses = list(stub.Stream(iter(requests), timeout=30))
        assert [r.step.text_token_id for r in responses[1:]] == golden["text_tokens"][:6].tolist()
        assert terminate(process) == 0


def test_the_float32_weights_flag_reaches_the_engine(tiny4_checkpoint):
    """`python -m services.llm --float32-weights` loads the engine with the quantized layers' scales and biases
    kept in float32."""
    import asyncio

    from services.common.cli import build_parser, parse_args
    from services.llm.__main__ import add_arguments, build

    parser = build_parser("services.llm", "test")
    add_arguments(parser)
    for flags, dtype in (([], mx.bfloat16), (["--float32-weights"], mx.float32)):
        spec = build(parse_args(parser, ["--model", str(tiny4_checkpoint), *flags]))
        try:
            asyncio.run(spec.load())
            engine = spec.registrations[0][1].engine
            projection = engine.model.backbone.blocks[0].mixer.in_proj
            assert projection.spec is not None and projection.scales.dtype == dtype
        finally:
            spec.close()


def test_the_prompts_kept_flag_reaches_the_engine_and_a_negative_one_is_refused(tiny_checkpoint):
    """`--prompts-kept N` sets how many prompts' caches the engine keeps (default PROMPTS_KEPT; 0: none, so a
    second session with a prompt feeds it again); a negative N is an error naming the flag."""
    import asyncio

    from services.common.cli import build_parser, parse_args
    from services.llm.__main__ import add_arguments, build
    from services.llm.engine import PROMPTS_KEPT

    parser = build_parser("services.llm", "test")
    add_arguments(parser)
    for flags, kept in (([], PROMPTS_KEPT), (["--prompts-kept", "0"], 0), (["--prompts-kept", "7"], 7)):
        spec = build(parse_args(parser, ["--model", str(tiny_checkpoint), *flags]))
        try:
            asyncio.run(spec.load())
            engine = spec.registrations[0][1].engine
            assert engine.prompts_kept == kept
            for again in (False, True):
                session = engine.open_session(PROMPT, prefill=False)
                assert session.prompt_pending == (0 if kept and again else len(engine.prompt_ids(PROMPT)))
                while session.prompt_pending:
                    engine.prefill_batch([session])
                engine.close_session(session)
        finally:
            spec.close()
    with pytest.raises(ValueError, match="--prompts-kept -1"):
        build(parse_args(parser, ["--model", str(tiny_checkpoint), "--prompts-kept", "-1"]))
