"""A port already in use: the second server fails with one line and exit code 2 instead of sharing the port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from protos.voicechat.v1 import codec_pb2
from services.common.errors import EXIT_BIND, BindError
from services.common.server import full_service_name, start_server

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


@contextlib.contextmanager
def held_port():
    """A port some other program listens on (a plain socket, as any server would hold it)."""
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        yield holder.getsockname()[1]


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def test_a_second_grpc_server_on_one_port_fails_instead_of_splitting_the_traffic():
    async def main():
        first = await start_server([], [full_service_name(codec_pb2, "CodecService")], host=HOST, port=0)
        try:
            with pytest.raises(BindError, match=rf"^cannot listen on {HOST}:{first.port}: the port is in use$"):
                await start_server([], ["x"], host=HOST, port=first.port)
        finally:
            await first.stop(0)

    asyncio.run(main())


def test_a_service_on_a_busy_port_exits_2_with_one_line(tiny_checkpoint):
    with held_port() as port:
        done = run_cli("services.codec", "--model", str(tiny_checkpoint), "--host", HOST, "--port", str(port))
    assert done.returncode == EXIT_BIND == 2
    assert done.stderr.strip().splitlines() == [f"services.codec: error: cannot listen on {HOST}:{port}: the port is "
                                                "in use"]


def test_serve_on_a_busy_realtime_port_exits_2_with_one_line(tiny_checkpoint):
    with held_port() as port:
        done = run_cli("orchestrator.cli", "serve", "--model", str(tiny_checkpoint), "--in-process",
                       "--host", HOST, "--realtime-port", str(port))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == f"error: cannot listen on {HOST}:{port} for /v1/realtime: the port is in use"
    assert not any("Traceback" in line for line in lines)
