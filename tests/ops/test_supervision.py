"""`orchestrator serve` supervises the services it started: each of the four, killed in turn, is logged, health
goes NOT_SERVING while it restarts (new conversations are refused naming it) and SERVING once it serves again,
and a conversation then succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.launcher import SERVICES
from orchestrator.supervisor import describe_exit
from protos.voicechat.v1 import conversation_pb2_grpc
from services.common.cli import parse_ready_line
from tests.integration.test_conversation_service import N, chunks, configure, converse, describe, flush
from tests.integration.test_offline_turn import children_of

HOST = "127.0.0.1"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the service processes through /proc")


def test_exits_in_words():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(3) == "exited with code 3 (its device failed)"
    assert describe_exit(2) == "exited with code 2 (its port is in use)"
    assert describe_exit(-200) == "killed by signal 200"


def service_pids(pid: int) -> dict[str, int]:
    """The serve process's service children, by service name."""
    found = {}
    for child, command in children_of(pid).items():
        for name in SERVICES:
            if f"services.{name} " in command:
                found[name] = child
    return found


def health(channel) -> int | None:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
    except grpc.RpcError:
        return None


def statuses_until_serving(channel, timeout_s: float = 90) -> list[int]:
    """Health answers (deduplicated) from now until SERVING follows NOT_SERVING."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = health(channel)
        if status is not None and (not seen or seen[-1] != status):
            seen.append(status)
        if seen[-2:] == [NOT_SERVING, SERVING]:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"health went {seen}, not NOT_SERVING then SERVING within {timeout_s} s")


def test_each_killed_service_is_restarted_and_conversations_succeed_again(tiny_checkpoint, golden_wave, tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--model",
                                    str(tiny_checkpoint), "--host", HOST, "--port", "0", "--no-realtime"],
                                   stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        ready = parse_ready_line(process.stdout.readline())
        assert ready is not None, log.read_text()
        address = f"{HOST}:{ready[1]}"
        with grpc.insecure_channel(address) as channel:
            assert health(channel) == SERVING
            for name in SERVICES:
                before = service_pids(process.pid)
                release = threading.Event()

                def held(release=release):
                    yield configure()
                    yield from chunks(golden_wave[:N])
                    release.wait(60)
                    yield from chunks(golden_wave[N : 2 * N])
                    yield flush()

                call = conversation_pb2_grpc.ConversationServiceStub(channel).Converse(held(), timeout=120)
                while describe(next(call))[0] != "audio":  # the conversation runs on every service
                    pass
                os.kill(before[name], signal.SIGKILL)
                killed = time.monotonic()
                while health(channel) != NOT_SERVING:
                    assert time.monotonic() - killed < 30, f"health still SERVING 30 s after the {name} service died"
                    time.sleep(0.005)
                release.set()
                errors = [e for e in map(describe, call) if e[0] == "error"]
                assert len(errors) == 1 and errors[0][1] == "ERROR_CODE_SERVICE_UNAVAILABLE", errors
                assert errors[0][2].startswith(f"the {name} service at "), errors
                refused = converse(address, [configure()])
                assert refused == [("error", "ERROR_CODE_SERVICE_UNAVAILABLE", f"the {name} service is restarting "
                                    f"({name} killed by SIGKILL); try again shortly")]
                assert statuses_until_serving(channel)[-2:] == [NOT_SERVING, SERVING]
                after = service_pids(process.pid)
                assert after[name] != before[name] and after.keys() == before.keys()
                got = converse(address, [configure(), *chunks(golden_wave[:N]), flush()])
                assert got[0] == ("ready",) and got[-1] == ("done", 1), (name, got)
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    text = log.read_text()
    for name in SERVICES:
        assert f"the {name} service (pid " in text and "died: killed by SIGKILL" in text, text
        assert f"the {name} service serves again on " in text
    assert code == 0, text


@pytest.fixture(scope="module")
def golden_wave():
    from tests.conftest import load_golden

    return load_golden("online")[0]["waveform"]
