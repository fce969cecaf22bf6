"""BidiStream on each transport (orchestrator/transport.py) against real gRPC services: answers in order under
concurrent streams, the frame deadline on a service that hangs, a killed service, a close with a request in
flight, and the unary calls."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from orchestrator.clients import TRANSPORTS, BidiStream, Channel, Deadlines, ServiceError

FRAME_S = 0.5
HANG = b"hang"


def _stub(channel) -> SimpleNamespace:
    """A stub of raw-bytes methods (no serializers: requests and answers are bytes)."""
    return SimpleNamespace(Stream=channel.stream_stream("/bench.Echo/Stream"),
                           Echo=channel.unary_unary("/bench.Echo/Echo"))


@pytest.fixture(scope="module")
def service():
    """An in-process echo service whose stream stops answering at a request `hang` (until the test ends)."""
    released = threading.Event()

    def stream(requests, context):
        for request in requests:
            if request == HANG:
                released.wait(30)
                return
            yield request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=40))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request[::-1]),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    released.set()
    server.stop(0)


@pytest.fixture(params=TRANSPORTS)
def channel(request, service):
    channel = Channel("tts", service, _stub, Deadlines(open_s=FRAME_S, frame_s=FRAME_S), transport=request.param)
    yield channel
    channel.close()


def test_answers_come_in_order_on_every_stream_under_concurrent_callers(channel):
    errors: list[BaseException] = []

    def converse(session: int) -> None:
        stream = BidiStream(channel, "Stream")
        try:
            ahead = [stream.send(f"{session}:{i}".encode()) for i in range(3)]  # sent before any answer is taken
            for i in range(3, 60):
                ahead.append(stream.send(f"{session}:{i}".encode()))
                assert ahead.pop(0).result() == f"{session}:{i - 3}".encode()
            assert [p.result() for p in ahead] == [f"{session}:{i}".encode() for i in range(57, 60)]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            stream.close()

    threads = [threading.Thread(target=converse, args=(session,)) for session in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []


def test_a_service_that_hangs_raises_a_service_error_within_the_frame_deadline(channel):
    stream = BidiStream(channel, "Stream")
    assert stream.call(b"open") == b"open"
    pending = stream.send(HANG)
    started = time.monotonic()
    with pytest.raises(ServiceError, match=rf"the tts service at {channel.address} did not answer within 0.5 s"):
        pending.result()
    assert FRAME_S <= time.monotonic() - started < FRAME_S + 0.5
    with pytest.raises(ServiceError, match="did not answer"):  # broken for good: no late answer is taken
        stream.send(b"next")


def test_close_with_a_request_in_flight_ends_the_stream_at_once(channel):
    stream = BidiStream(channel, "Stream")
    assert stream.call(b"open") == b"open"
    pending = stream.send(HANG)
    stream.close()
    started = time.monotonic()
    with pytest.raises(ServiceError, match="the tts service .* stopped responding \\(CANCELLED"):
        pending.result()
    assert time.monotonic() - started < FRAME_S  # the cancel, not the deadline
    assert BidiStream(channel, "Stream").call(b"again") == b"again"  # the channel (and its loop) serve on


def test_unary_calls_go_through_the_same_transport(channel):
    assert channel.unary("Echo", b"abc") == b"cba"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_killed_service_raises_a_service_error_naming_it(transport):
    child = subprocess.Popen([sys.executable, "-m", "bench.transport", "--serve"], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        address = f"127.0.0.1:{int(child.stdout.readline())}"
        channel = Channel("codec", address, _stub, Deadlines(open_s=10, frame_s=10), transport=transport)
        stream = BidiStream(channel, "Stream")
        assert stream.call(b"open") == b"open"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        started = time.monotonic()
        with pytest.raises(ServiceError, match=rf"the codec service at {address} stopped responding \(UNAVAILABLE") \
                as raised:
            stream.call(b"frame")
        assert raised.value.code == "UNAVAILABLE" and time.monotonic() - started < 5  # at once, not at 10 s
        stream.close()
        channel.close()
    finally:
        child.kill()
        child.wait()


def test_an_unknown_transport_is_refused_with_the_choices(service):
    with pytest.raises(ValueError, match="transport 'fibres': must be one of aio, threads"):
        Channel("tts", service, _stub, transport="fibres")


def test_the_transport_bench_measures_every_variant_over_every_round_trip(capsys):
    import json

    from bench.transport import main

    assert main(["--streams", "3", "--ahead", "1,2", "--rounds", "10", "--size", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["variant"], r["ahead"]) for r in report["rows"]] == [
        (variant, ahead) for ahead in (1, 2) for variant in ("threads", "aio", "mux", "mux-coalesce")]
    for row in report["rows"]:
        assert row["streams"] == 3 and row["round_trips"] == 30  # 3 streams x 10, the warm-up left out
        assert row["client_ms"] > 0 and row["server_ms"] >= 0 and row["per_s"] > 0


def test_the_environment_picks_the_transport_and_a_wrong_one_is_refused(monkeypatch):
    from orchestrator.clients import DEFAULT_TRANSPORT, TRANSPORT_ENV, pick_transport

    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    assert pick_transport() == DEFAULT_TRANSPORT == "aio"
    monkeypatch.setenv(TRANSPORT_ENV, "threads")
    assert pick_transport() == "threads" and pick_transport("aio") == "aio"  # an explicit choice wins
    monkeypatch.setenv(TRANSPORT_ENV, "green")
    with pytest.raises(ValueError, match="VOICECHAT_TRANSPORT 'green': must be one of aio, threads"):
        pick_transport()


def test_grpc_aios_internal_error_for_a_write_into_an_ended_stream_counts_as_the_stream_breaking():
    from orchestrator import transport
    from orchestrator.clients import _fail
    from orchestrator.failover import recoverable

    class Failed(grpc.RpcError):
        def __init__(self, code, details):
            self._code, self._details = code, details

        def code(self):
            return self._code

        def details(self):
            return self._details

    # a replica killed while a request was being written: grpc.aio reports INTERNAL from its own core
    broken = transport._as_reported(Failed(grpc.StatusCode.INTERNAL, transport.CORE_WRITE_FAILURE))
    assert broken.code() == grpc.StatusCode.UNAVAILABLE
    assert recoverable(_fail("perception", "ipv4:a,b", broken))  # the session moves to another replica
    # a service's own INTERNAL error (its handler failed) stays what it is: no replica would answer otherwise
    own = Failed(grpc.StatusCode.INTERNAL, "RuntimeError: the engine failed")
    assert transport._as_reported(own) is own and not recoverable(_fail("perception", "ipv4:a,b", own))
