"""One key for every front door: `--api-key` guards the gRPC ConversationService as it guards the WebSocket,
`--tls-cert/--tls-key` encrypt both, and what is not a front door (the network services, the metrics) listens on
this machine only unless told otherwise."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from protos.voicechat.v1 import codec_pb2, codec_pb2_grpc, conversation_pb2_grpc
from services.common import cli as service_cli
from services.common.engine_thread import EngineThread
from services.common.metrics import Metrics
from services.common.security import TlsError, bearer_matches, load_tls
from services.common.server import UNAUTHENTICATED_MESSAGE, full_service_name, start_server
from services.common.tensors import to_proto_np
from tests.integration.test_conversation_service import configure, describe
from tests.integration.test_server_common import FakeCodecServicer

HOST = "127.0.0.1"
KEY = "s3cret-key"


@pytest.mark.parametrize(("header", "ok"), [
    (f"Bearer {KEY}", True), (f"bearer {KEY}", True), (f"BEARER {KEY}", True), (f"  Bearer   {KEY} ", True),
    ("Bearer wrong", False), (f"Bearer {KEY}x", False), (f"Basic {KEY}", False), (KEY, False),
    (f"Bearer{KEY}", False), ("", False), (None, False)])
def test_the_bearer_scheme_is_case_insensitive_and_the_key_exact(header, ok):
    assert bearer_matches(header, KEY) is ok


def test_grpc_calls_need_the_key_and_health_checks_do_not():
    async def main():
        engine = EngineThread()
        metrics = Metrics("codec")
        servicer = FakeCodecServicer(engine)
        running = await start_server([(codec_pb2_grpc.add_CodecServiceServicer_to_server, servicer)],
                                     [full_service_name(codec_pb2, "CodecService")], host=HOST, port=0,
                                     metrics=metrics, api_key=KEY)
        await running.set_serving(True)
        request = codec_pb2.CodecEncodeRequest(waveform=to_proto_np(np.zeros(16, np.float32)))
        try:
            async with grpc.aio.insecure_channel(f"{HOST}:{running.port}") as channel:
                stub = codec_pb2_grpc.CodecServiceStub(channel)
                codes = {}
                for label, metadata in (("none", ()), ("wrong", (("authorization", "Bearer nope"),)),
                                        ("lower", (("authorization", f"bearer {KEY}"),))):
                    try:
                        await stub.Encode(request, metadata=metadata)
                        codes[label] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as exc:
                        codes[label] = exc.code()
                        assert exc.details() == UNAUTHENTICATED_MESSAGE
                stream = stub.DecodeStream(iter([codec_pb2.CodecDecodeStreamRequest(open={})]))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    [r async for r in stream]
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        finally:
            await running.stop(0)
            engine.close()
        return codes, refused.value.code(), health.status, metrics.value("voicechat_errors_total",
                                                                         code="UNAUTHENTICATED")

    codes, stream_code, health, counted = asyncio.run(main())
    assert codes == {"none": grpc.StatusCode.UNAUTHENTICATED, "wrong": grpc.StatusCode.UNAUTHENTICATED,
                     "lower": grpc.StatusCode.OK}
    assert stream_code == grpc.StatusCode.UNAUTHENTICATED
    assert health == health_pb2.HealthCheckResponse.SERVING  # probes need no key
    assert counted == 3


def test_internal_services_and_metrics_listen_on_this_machine_only(tiny_checkpoint):
    args = service_cli.parse_args(service_cli.build_parser("services.codec", "test"),
                                  ["--model", str(tiny_checkpoint), "--metrics-port", "0"])
    assert (args.host, args.metrics_host) == ("127.0.0.1", "127.0.0.1")
    from orchestrator.cli import build_parser

    serve = build_parser().parse_args(["serve"])
    assert (serve.host, serve.realtime_host, serve.metrics_host) == ("[::]", "127.0.0.1", "127.0.0.1")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def test_tls_flags_are_checked_before_any_server_starts(certificate, tmp_path):
    cert, key = certificate
    assert load_tls(None, None) is None
    with pytest.raises(TlsError, match="--tls-cert and --tls-key go together"):
        load_tls(cert, None)
    with pytest.raises(TlsError, match=f"--tls-key {tmp_path / 'missing.pem'}: No such file or directory"):
        load_tls(cert, tmp_path / "missing.pem")
    with pytest.raises(TlsError, match="not a PEM certificate and its private key"):
        load_tls(key, cert)


def test_serve_guards_both_front_doors_with_one_key_over_tls(tiny_checkpoint, certificate):
    from services.common.cli import parse_ready_line

    cert, key = certificate
    process = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--model", str(tiny_checkpoint),
                                "--in-process", "--host", HOST, "--port", "0", "--realtime-port", "0",
                                "--api-key", KEY, "--tls-cert", str(cert), "--tls-key", str(key)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().split()[-1]
        ready = parse_ready_line(process.stdout.readline())
        assert url.startswith("wss://") and ready is not None, process.stderr.read()
        address = f"{HOST}:{ready[1]}"
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())

        def converse(metadata=(), secure=True):
            channel = (grpc.secure_channel(address, credentials) if secure else grpc.insecure_channel(address))
            with channel:
                stub = conversation_pb2_grpc.ConversationServiceStub(channel)
                try:
                    return describe(next(stub.Converse(iter([configure()]), metadata=metadata, timeout=30)))
                except grpc.RpcError as exc:
                    return exc.code()

        assert converse() == grpc.StatusCode.UNAUTHENTICATED
        assert converse((("authorization", "Bearer wrong"),)) == grpc.StatusCode.UNAUTHENTICATED
        assert converse((("authorization", f"Bearer {KEY}"),)) == ("ready",)
        assert converse((("authorization", f"bearer {KEY}"),)) == ("ready",)
        assert converse((("authorization", f"Bearer {KEY}"),), secure=False) == grpc.StatusCode.UNAVAILABLE

        # A 2-core CI machine running the suite has taken over websockets' default 10 s to answer an upgrade here.
        context = ssl.create_default_context(cafile=str(cert))
        with connect(url, ssl=context, additional_headers={"Authorization": f"BEARER {KEY}"},
                     open_timeout=60) as socket:
            assert json.loads(socket.recv(timeout=60))["type"] == "session.created"
        with pytest.raises(InvalidStatus) as refused:
            connect(url, ssl=context, open_timeout=60)
        assert refused.value.response.status_code == 401
    finally:
        process.terminate()
        process.wait(30)
