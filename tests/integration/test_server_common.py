"""The shared server bootstrap against a real grpc.aio server on port 0, with a fake codec engine."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import mlx.core as mx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.voicechat.v1 import codec_pb2, codec_pb2_grpc
from services.common import cli
from services.common.engine_thread import EngineThread
from services.common.errors import EXIT_DEVICE_LOST, DeviceLost, LimitExceeded, ServiceUnavailable
from services.common.server import full_service_name, serve, start_server
from services.common.tensors import from_proto_np, to_proto_np

ROOT = Path(__file__).resolve().parents[2]
CODEC = full_service_name(codec_pb2, "CodecService")
HOST = "127.0.0.1"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
Q, SAMPLES_PER_FRAME = 4, 8
LOST = -77  # a first code the fake decoder meets with the device fault below
FULL = -78  # a first code the fake decoder meets with the device's memory running out, as MLX's CUDA backend says it
OUT_OF_MEMORY = "cudaMallocAsync(&data, size, stream) failed: out of memory"
# as MLX's CUDA backend reported one on an H100 (the codec, out of memory just before)
DEVICE_FAULT = ("cudaGraphAddKernelNode(&node, graph_, NULL, 0, &params) failed: an illegal memory access was "
                "encountered")


class FakeCodecEngine:
    """Stands in for the MLX codec: records which thread ran each call."""

    def __init__(self):
        self.thread_ids = []
        self.cached_at_failure = None  # the buffer cache's bytes when the device's memory ran out

    def encode(self, waveform: np.ndarray) -> np.ndarray:
        self.thread_ids.append(threading.get_ident())
        if waveform.size == 0:
            raise ValueError("waveform is empty: send at least one sample")
        if waveform.size > 1000:
            raise LimitExceeded(f"waveform has {waveform.size} samples; this codec takes at most 1000")
        return np.zeros((waveform.size // SAMPLES_PER_FRAME, Q), np.int32)

    def decode_frame(self, codes: np.ndarray) -> np.ndarray:
        self.thread_ids.append(threading.get_ident())
        if codes.shape != (Q,):
            raise ValueError(f"codes must have shape ({Q},), got {codes.shape}")
        if codes[0] == LOST:
            raise RuntimeError(DEVICE_FAULT)
        if codes[0] == FULL:
            self.cached_at_failure = leave_buffers_cached()
            raise RuntimeError(OUT_OF_MEMORY)
        if codes[0] < 0:
            raise RuntimeError("decoder exploded")
        return np.full(SAMPLES_PER_FRAME, codes.sum(), np.float32)


def leave_buffers_cached() -> int:
    """Evaluate and drop a 4 MB array, so MLX's buffer cache holds it; the cache's bytes then."""
    mx.eval(mx.ones((1 << 20,), mx.float32) + 1)
    return mx.get_cache_memory()


class FakeCodecServicer(codec_pb2_grpc.CodecServiceServicer):
    """A thin servicer in the house style: no try/except, work on the engine thread."""

    def __init__(self, engine_thread: EngineThread):
        self.engine_thread = engine_thread
        self.engine = FakeCodecEngine()

    async def Encode(self, request, context):
        codes = await self.engine_thread.run(self.engine.encode, from_proto_np(request.waveform))
        return codec_pb2.CodecEncodeResponse(codes=to_proto_np(codes))

    async def Decode(self, request, context):
        raise ServiceUnavailable("the decoder is warming up")

    async def DecodeStream(self, request_iterator, context):
        first = await anext(request_iterator)
        if first.WhichOneof("payload") != "open":
            raise ValueError("the first DecodeStream message must be `open`")
        yield codec_pb2.CodecDecodeStreamResponse(
            opened=codec_pb2.CodecDecodeOpened(samples_per_frame=SAMPLES_PER_FRAME, sample_rate_hz=22050)
        )
        async for request in request_iterator:
            frame = request.frame
            samples = await self.engine_thread.run(self.engine.decode_frame, from_proto_np(frame.codes))
            yield codec_pb2.CodecDecodeStreamResponse(
                frame=codec_pb2.CodecDecodedFrame(frame_index=frame.frame_index, samples=to_proto_np(samples))
            )


@contextlib.asynccontextmanager
async def codec_server(max_message_mb=64, serving=True):
    engine_thread = EngineThread()
    servicer = FakeCodecServicer(engine_thread)
    registrations = [(codec_pb2_grpc.add_CodecServiceServicer_to_server, servicer)]
    running = await start_server(registrations, [CODEC], host=HOST, port=0, max_message_mb=max_message_mb)
    channel = grpc.aio.insecure_channel(f"{HOST}:{running.port}")
    try:
        if serving:
            await running.set_serving(True)
        yield running, channel, servicer
    finally:
        await channel.close()
        await running.stop(0)
        engine_thread.close()


async def health_status(channel, service=""):
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return response.status


def encode_request(n):
    return codec_pb2.CodecEncodeRequest(waveform=to_proto_np(np.zeros(n, np.float32)))


def frame(index, codes):
    return codec_pb2.CodecDecodeStreamRequest(
        frame=codec_pb2.CodecDecodeFrameInput(frame_index=index, codes=to_proto_np(np.array(codes, np.int32)))
    )


OPEN = codec_pb2.CodecDecodeStreamRequest(open=codec_pb2.CodecDecodeOpen())


def test_port_zero_binds_an_ephemeral_port_and_serves():
    async def main():
        async with codec_server() as (running, channel, _):
            assert running.port > 0
            response = await codec_pb2_grpc.CodecServiceStub(channel).Encode(encode_request(32))
            assert from_proto_np(response.codes).shape == (4, Q)

    asyncio.run(main())


def test_health_goes_from_not_serving_to_serving_once_loaded():
    async def main():
        async with codec_server(serving=False) as (running, channel, _):
            loaded = asyncio.Event()
            ready = asyncio.create_task(running.become_ready(loaded.wait))
            await asyncio.sleep(0)
            assert await health_status(channel) == NOT_SERVING
            assert await health_status(channel, CODEC) == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await codec_pb2_grpc.CodecServiceStub(channel).Encode(encode_request(8))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in err.value.details()
            loaded.set()
            await ready
            assert running.serving
            assert await health_status(channel) == SERVING
            assert await health_status(channel, CODEC) == SERVING

    asyncio.run(main())


def test_reflection_lists_and_describes_the_service():
    async def main():
        async with codec_server() as (_, channel, _):
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            requests = [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=CODEC),
            ]
            responses = [r async for r in stub.ServerReflectionInfo(iter(requests))]
            names = {s.name for s in responses[0].list_services_response.service}
            assert {CODEC, "grpc.health.v1.Health"} <= names
            assert responses[1].file_descriptor_response.file_descriptor_proto

    asyncio.run(main())


@pytest.mark.parametrize(
    ("samples", "code", "message"),
    [
        (0, grpc.StatusCode.INVALID_ARGUMENT, "waveform is empty: send at least one sample"),
        (
            2000,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "waveform has 2000 samples; this codec takes at most 1000",
        ),
    ],
)
def test_unary_exceptions_map_to_status_codes(samples, code, message):
    async def main():
        async with codec_server() as (_, channel, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await codec_pb2_grpc.CodecServiceStub(channel).Encode(encode_request(samples))
            assert err.value.code() == code
            assert err.value.details() == message

    asyncio.run(main())


def test_service_unavailable_maps_to_unavailable():
    async def main():
        async with codec_server() as (_, channel, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await codec_pb2_grpc.CodecServiceStub(channel).Decode(codec_pb2.CodecDecodeRequest())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == "the decoder is warming up"

    asyncio.run(main())


@pytest.mark.parametrize(
    ("bad", "code", "message"),
    [
        ([1, 2], grpc.StatusCode.INVALID_ARGUMENT, "codes must have shape (4,), got (2,)"),
        ([-1, 0, 0, 0], grpc.StatusCode.INTERNAL, "RuntimeError: decoder exploded"),
    ],
)
def test_stream_exceptions_map_to_status_codes_after_good_frames(bad, code, message):
    async def main():
        async with codec_server() as (_, channel, _):
            call = codec_pb2_grpc.CodecServiceStub(channel).DecodeStream(
                iter([OPEN, frame(0, [1, 2, 3, 4]), frame(1, bad)])
            )
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for response in call:
                    received.append(response)
            assert err.value.code() == code
            assert err.value.details() == message
            assert [r.WhichOneof("payload") for r in received] == ["opened", "frame"]
            assert from_proto_np(received[1].frame.samples).tolist() == [10.0] * SAMPLES_PER_FRAME

    asyncio.run(main())


def test_a_lost_device_answers_unavailable_and_ends_serve_with_device_lost():
    async def main():
        stop = asyncio.Event()
        ready = asyncio.get_running_loop().create_future()
        servicer = FakeCodecServicer(EngineThread())
        registrations = [(codec_pb2_grpc.add_CodecServiceServicer_to_server, servicer)]
        task = asyncio.create_task(serve(registrations, [CODEC], host=HOST, port=0, grace_s=30, stop=stop,
                                         on_ready=ready.set_result))
        running = await asyncio.wait_for(ready, 5)
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = codec_pb2_grpc.CodecServiceStub(channel)
            # an ordinary failure leaves the service up
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.DecodeStream(iter([OPEN, frame(0, [-1, 0, 0, 0])])):
                    pass
            assert err.value.code() == grpc.StatusCode.INTERNAL and not task.done()
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for response in stub.DecodeStream(iter([OPEN, frame(0, [1, 2, 3, 4]), frame(1, [LOST, 0, 0,
                                                                                                        0])])):
                    received.append(response)
            # the caller's failover may take it elsewhere: UNAVAILABLE, with what failed and what to do
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == (f"the service's device failed (RuntimeError: {DEVICE_FAULT}); the "
                                           "service is restarting: retry")
            assert len(received) == 2
        # serve ends at once (not after the 30 s grace) and says why
        with pytest.raises(DeviceLost, match="illegal memory access"):
            await asyncio.wait_for(task, 5)
        servicer.engine_thread.close()

    asyncio.run(main())


def test_a_service_whose_device_failed_exits_with_its_code(tmp_path):
    script = textwrap.dedent(
        f"""
        from protos.voicechat.v1 import codec_pb2, codec_pb2_grpc
        from services.common.cli import ServiceSpec, run_service
        from services.common.server import full_service_name

        class Servicer(codec_pb2_grpc.CodecServiceServicer):
            async def Encode(self, request, context):
                raise RuntimeError({DEVICE_FAULT!r})

        def build(args):
            return ServiceSpec([(codec_pb2_grpc.add_CodecServiceServicer_to_server, Servicer())],
                               [full_service_name(codec_pb2, "CodecService")])

        argv = ["--model", {str(tmp_path)!r}, "--host", "{HOST}", "--port", "0", "--log-level", "warning"]
        raise SystemExit(run_service(build, prog="fake", description="fake", argv=argv))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        parsed = cli.parse_ready_line(proc.stdout.readline())
        assert parsed is not None, proc.stderr.read()
        with grpc.insecure_channel(f"{HOST}:{parsed[1]}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                codec_pb2_grpc.CodecServiceStub(channel).Encode(encode_request(8), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(timeout=10) == EXIT_DEVICE_LOST
        assert f"fake: error: the device failed: RuntimeError: {DEVICE_FAULT}" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_service_that_runs_out_of_device_memory_while_it_starts_says_what_to_change(tmp_path, capsys,
                                                                                      monkeypatch):
    monkeypatch.setattr(cli, "process_settings", lambda: None)  # a process's entry settings: not this one's
    async def load():
        raise RuntimeError(OUT_OF_MEMORY)  # as compiling its batch sizes met it on an 80 GB GPU

    def build(args):
        return cli.ServiceSpec([(codec_pb2_grpc.add_CodecServiceServicer_to_server, FakeCodecServicer(None))],
                               [full_service_name(codec_pb2, "CodecService")], load=load)

    argv = ["--model", str(tmp_path), "--host", HOST, "--port", "0", "--log-level", "warning"]
    assert cli.run_service(build, prog="fake", description="fake", argv=argv) == 1
    assert capsys.readouterr().err == (
        f"fake: error: the device ran out of memory while the service started (RuntimeError: {OUT_OF_MEMORY}). Its "
        "weights and the batch sizes it compiles must fit beside whatever else holds the device: compile fewer "
        "sizes (--precompile-batches), batch fewer sessions (--max-batch), or give it a device with more free "
        "memory\n")


def test_stream_must_open_first():
    async def main():
        async with codec_server() as (_, channel, _):
            call = codec_pb2_grpc.CodecServiceStub(channel).DecodeStream(iter([frame(0, [1, 2, 3, 4])]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in call]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "must be `open`" in err.value.details()

    asyncio.run(main())


def test_a_stream_message_that_does_not_parse_is_invalid_argument():
    async def main():
        async with codec_server() as (_, channel, _):
            raw = channel.stream_stream("/voicechat.v1.CodecService/DecodeStream", request_serializer=None,
                                        response_deserializer=None)
            call = raw(iter([OPEN.SerializeToString(), b"\xff\xff\xff\xff"]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in call]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("a request message does not parse")

    asyncio.run(main())


def test_a_stream_idle_under_client_keepalive_pings_stays_open():
    """A client pinging every 1.1 s while its stream is idle: the server's default policy would answer GOAWAY
    "too_many_pings" after a few pings and end the stream."""

    async def main():
        async with codec_server() as (running, _, _):
            options = [("grpc.keepalive_time_ms", 1100), ("grpc.keepalive_timeout_ms", 2000),
                       ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
            async with grpc.aio.insecure_channel(f"{HOST}:{running.port}", options=options) as channel:
                requests: asyncio.Queue = asyncio.Queue()

                async def messages():
                    while (message := await requests.get()) is not None:
                        yield message

                call = codec_pb2_grpc.CodecServiceStub(channel).DecodeStream(messages())
                await requests.put(OPEN)
                assert (await call.read()).WhichOneof("payload") == "opened"
                await asyncio.sleep(8.0)  # idle: only pings on the connection
                await requests.put(frame(0, [1, 2, 3, 4]))
                assert (await call.read()).WhichOneof("payload") == "frame"
                await requests.put(None)

    asyncio.run(main())


def test_message_size_limit_is_enforced():
    async def main():
        async with codec_server(max_message_mb=1) as (_, channel, _):
            stub = codec_pb2_grpc.CodecServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Encode(encode_request(300_000))  # 1.2 MB of float32
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await stub.Encode(encode_request(800))  # the server is still fine

    asyncio.run(main())


def test_a_step_that_runs_the_device_out_of_memory_answers_resource_exhausted_and_frees_the_cache():
    async def main():
        async with codec_server() as (_, channel, servicer):
            call = codec_pb2_grpc.CodecServiceStub(channel).DecodeStream(
                iter([OPEN, frame(0, [1, 2, 3, 4]), frame(1, [FULL, 0, 0, 0])]))
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for response in call:
                    received.append(response)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details().startswith(
                f"the service ran out of device memory (RuntimeError: {OUT_OF_MEMORY}); it released its buffer cache")
            assert [r.WhichOneof("payload") for r in received] == ["opened", "frame"]
            # the server still serves: a new stream decodes
            again = codec_pb2_grpc.CodecServiceStub(channel).DecodeStream(iter([OPEN, frame(0, [1, 1, 1, 1])]))
            assert len([r async for r in again]) == 2
            return servicer.engine.cached_at_failure

    assert asyncio.run(main()) >= 4 << 20
    assert mx.get_cache_memory() == 0


def test_the_engine_thread_releases_the_buffer_cache_when_the_device_runs_out_of_memory():
    def fails():
        leave_buffers_cached()
        raise RuntimeError(OUT_OF_MEMORY)

    def fails_otherwise():
        leave_buffers_cached()
        raise RuntimeError("decoder exploded")

    with EngineThread() as engine:
        with pytest.raises(RuntimeError, match="decoder exploded"):
            engine.submit_sync(fails_otherwise)
        assert mx.get_cache_memory() >= 4 << 20  # another failure leaves the cache as it is
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.submit_sync(fails)
        assert mx.get_cache_memory() == 0
        engine.submit_sync(leave_buffers_cached)
        with pytest.raises(RuntimeError, match="out of memory"):
            asyncio.run(engine.run(fails))
        assert mx.get_cache_memory() == 0


def test_engine_work_runs_on_one_thread():
    async def main():
        async with codec_server() as (_, channel, servicer):
            stub = codec_pb2_grpc.CodecServiceStub(channel)
            await asyncio.gather(*(stub.Encode(encode_request(16 * (i + 1))) for i in range(8)))
            call = stub.DecodeStream(iter([OPEN, *(frame(i, [i, 0, 0, 0]) for i in range(4))]))
            assert len([r async for r in call]) == 5
            return servicer

    servicer = asyncio.run(main())
    assert len(servicer.engine.thread_ids) == 12
    assert len(set(servicer.engine.thread_ids)) == 1
    assert servicer.engine.thread_ids[0] == servicer.engine_thread.ident != threading.get_ident()


def test_engine_thread_propagates_errors_and_closes():
    engine = EngineThread()
    assert engine.submit_sync(threading.get_ident) == engine.ident
    assert engine.submit_sync(lambda: engine.submit_sync(threading.get_ident)) == engine.ident  # no deadlock
    with pytest.raises(ZeroDivisionError):
        engine.submit_sync(lambda: 1 / 0)
    with pytest.raises(KeyError):
        asyncio.run(engine.run({}.__getitem__, "missing"))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit_sync(int)


def test_serve_loads_then_serves_then_stops():
    async def main():
        stop = asyncio.Event()
        ready = asyncio.get_running_loop().create_future()
        order = []

        async def load():
            order.append("load")

        def on_ready(running):
            order.append("ready")
            ready.set_result(running)

        servicer = FakeCodecServicer(EngineThread())
        registrations = [(codec_pb2_grpc.add_CodecServiceServicer_to_server, servicer)]
        task = asyncio.create_task(
            serve(
                registrations,
                [CODEC],
                host=HOST,
                port=0,
                load=load,
                on_ready=on_ready,
                grace_s=0.1,
                stop=stop,
            )
        )
        running = await asyncio.wait_for(ready, 5)
        async with grpc.aio.insecure_channel(running.address) as channel:
            assert await health_status(channel, CODEC) == SERVING
        stop.set()
        await asyncio.wait_for(task, 5)
        servicer.engine_thread.close()
        assert order == ["load", "ready"]

    asyncio.run(main())


def test_serve_propagates_a_load_failure():
    async def main():
        async def load():
            raise FileNotFoundError("no config.json in /nowhere")

        with pytest.raises(FileNotFoundError, match="config.json"):
            await asyncio.wait_for(serve([], [CODEC], host=HOST, port=0, load=load, grace_s=0), 5)

    asyncio.run(main())


def test_cli_prints_the_ready_line_and_stops_on_sigterm(tmp_path):
    script = textwrap.dedent(
        f"""
        from protos.voicechat.v1 import codec_pb2, codec_pb2_grpc
        from services.common.cli import ServiceSpec, run_service
        from services.common.server import full_service_name

        def build(args):
            servicer = codec_pb2_grpc.CodecServiceServicer()
            return ServiceSpec([(codec_pb2_grpc.add_CodecServiceServicer_to_server, servicer)],
                               [full_service_name(codec_pb2, "CodecService")])

        argv = ["--model", {str(tmp_path)!r}, "--host", "{HOST}", "--port", "0", "--log-level", "warning"]
        raise SystemExit(run_service(build, prog="fake", description="fake", argv=argv))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        parsed = cli.parse_ready_line(line)
        assert parsed is not None and parsed[0] == HOST, line + proc.stderr.read()
        with grpc.insecure_channel(f"{HOST}:{parsed[1]}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(service=CODEC), timeout=5).status == SERVING
            with pytest.raises(grpc.RpcError) as err:  # an unimplemented method, through the error mapping
                codec_pb2_grpc.CodecServiceStub(channel).Encode(encode_request(8), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - start < 8
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_cache_limit_bounds_the_buffers_mlx_keeps():
    import mlx.core as mx

    previous = mx.set_cache_limit(1 << 34)  # restored after
    try:
        cli.apply_cache_limit(1.0)  # 1 MiB
        for _ in range(3):
            block = mx.ones((1024, 1024))  # 4 MiB each, freed at once
            mx.eval(block)
            del block
        assert mx.get_cache_memory() <= 1 << 20
        cli.apply_cache_limit(None)  # leaves the limit as it is
        block = mx.ones((1024, 1024))
        mx.eval(block)
        del block
        assert mx.get_cache_memory() <= 1 << 20
    finally:
        mx.set_cache_limit(previous)


def test_cli_flags(tmp_path, monkeypatch):
    parser = cli.build_parser("svc", "test")
    monkeypatch.delenv(cli.MODEL_ENV, raising=False)
    with pytest.raises(SystemExit):
        cli.parse_args(parser, ["--model", str(tmp_path / "missing")])
    args = cli.parse_args(parser, ["--model", str(tmp_path), "--port", "0", "--log-level", "debug"])
    assert (args.model, args.port, args.host, args.log_level) == (tmp_path, 0, "127.0.0.1", "DEBUG")
    monkeypatch.setenv(cli.MODEL_ENV, str(tmp_path))
    assert cli.parse_args(cli.build_parser("svc", "test"), []).model == tmp_path
    assert args.cache_limit_mb is None
    for bad in ("-1", "nan", "Shared", "half"):
        with pytest.raises(SystemExit):
            cli.parse_args(cli.build_parser("svc", "test"), ["--model", str(tmp_path), "--cache-limit-mb", bad])
    assert cli.parse_args(cli.build_parser("svc", "test"), ["--model", str(tmp_path), "--cache-limit-mb", "0.5"]
                          ).cache_limit_mb == 0.5
    assert cli.parse_args(cli.build_parser("svc", "test"), ["--model", str(tmp_path), "--cache-limit-mb", "shared"]
                          ).cache_limit_mb == cli.SHARED
    assert cli.parse_ready_line("listening on [::]:50051\n") == ("[::]", 50051)
    assert cli.parse_ready_line("loading weights") is None
