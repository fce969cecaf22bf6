"""`python -m services.common.healthcheck` against a real service, a server that says NOT_SERVING, and a port
where nothing listens."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.healthcheck import main
from tests.conftest import ROOT, service_process


def run_healthcheck(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "services.common.healthcheck", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=60)


@contextlib.contextmanager
def health_server(status: health_pb2.HealthCheckResponse.ServingStatus):
    """A plain gRPC server with only grpc.health.v1, reporting `status` for ""; yields (address, servicer)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    servicer.set("", status)
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


@contextlib.contextmanager
def silent_port():
    """A local port that is bound but not listening, so a connection is refused (and nobody else takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_a_running_service_is_healthy(tiny_checkpoint):
    with service_process("codec", tiny_checkpoint) as (address, _process):
        done = run_healthcheck("--address", address)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
        assert main(["--address", address, "--service", "voicechat.v1.CodecService"]) == 0


def test_an_unknown_service_name_fails(tiny_checkpoint, capsys):
    with service_process("codec", tiny_checkpoint) as (address, _process):
        assert main(["--address", address, "--service", "voicechat.v1.NoSuchService"]) == 1
    assert capsys.readouterr().err == f"health: {address} does not know the service 'voicechat.v1.NoSuchService'\n"


def test_not_serving_fails_then_serving_passes(capsys):
    with health_server(health_pb2.HealthCheckResponse.NOT_SERVING) as (address, servicer):
        assert main(["--address", address]) == 1
        assert capsys.readouterr().err == f"health: {address} answered NOT_SERVING\n"
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert main(["--address", address]) == 0
        assert capsys.readouterr().err == ""


def test_nothing_listening_fails_within_the_timeout():
    with silent_port() as port:
        started = time.monotonic()
        done = run_healthcheck("--address", f"127.0.0.1:{port}", "--timeout", "0.5")
        elapsed = time.monotonic() - started
    assert done.returncode == 1
    assert done.stderr == f"health: nothing answered at 127.0.0.1:{port} within 0.5 s\n"
    assert elapsed < 10, f"the check took {elapsed:.1f} s with --timeout 0.5"


def test_a_non_positive_timeout_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--timeout", "0"])
    assert exited.value.code == 2
    assert "--timeout 0.0: must be positive" in capsys.readouterr().err


def test_it_imports_nothing_heavy():
    code = ("import sys, services.common.healthcheck; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'numpy', 'orchestrator', 'soundfile'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr
