"""Faults survived: the network services run as real processes (two replicas of the language service behind one
`ipv4:` target, spread by gRPC's round_robin with client health checking), the conversation service runs in this
process on a background event loop, and the tests kill, stop, drain and restart services under running
conversations.

Every conversation's outputs are compared with a solo run of the same input and seed made while all was well.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from orchestrator.clients import Deadlines
from orchestrator.conversation import SERVICE_NAME, ConversationServicer, registrations
from orchestrator.launcher import ServiceProcess, spawn_service, stop, wait_ready
from orchestrator.stream_clients import grpc_stream_clients
from protos.voicechat.v1 import conversation_pb2_grpc
from services.common.server import start_server
from tests.conftest import load_golden
from tests.integration.test_conversation_service import chunks, configure, converse, describe, flush
from tests.integration.test_process_metrics import scrape, value

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals")

HOST = "127.0.0.1"
N = 1280
FRAME_DEADLINE_S = 2.0
FRAMES = 24


class Cluster:
    """perception, tts and codec once, llm twice (replicas "a" and "b"), and the conversation service here."""

    def __init__(self, model):
        self.model = model
        self.children: dict[str, ServiceProcess] = {}
        for name in ("perception", "tts", "codec", "llm-a", "llm-b"):
            self.start(name)
        self.ports = {name: int(child.address.rpartition(":")[2]) for name, child in self.children.items()}
        addresses = {name: self.children[name].address for name in ("perception", "tts", "codec")}
        addresses["llm"] = f"ipv4:{HOST}:{self.ports['llm-a']},{HOST}:{self.ports['llm-b']}"
        self.addresses = addresses
        self.clients = grpc_stream_clients(addresses, Deadlines(open_s=30.0, frame_s=FRAME_DEADLINE_S))
        self.conversation = ConversationServicer(self.clients, model, max_sessions=8, max_streaming_seconds=60.0)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.run(self._serve())
        self.address = f"{HOST}:{self.server.port}"

    def start(self, name: str, port: int = 0) -> None:
        extra = ["--drain-seconds", "1", "--metrics-port", "0"] + (["--port", str(port)] if port else [])
        child = spawn_service(name.split("-")[0], self.model, extra)
        wait_ready([child], timeout_s=60)
        deadline = time.monotonic() + 10
        while not child.metrics_url and time.monotonic() < deadline:  # printed right after the ready line
            time.sleep(0.02)
        self.children[name] = child

    def run(self, coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _serve(self):
        running = await start_server(registrations(self.conversation), [SERVICE_NAME], host=HOST, port=0)
        await running.become_ready()
        return running

    def sessions(self) -> dict[str, int]:
        """Open sessions: the conversation service's, and each running service process's (from its /metrics)."""
        counts = {"conversation": self.conversation.live_sessions}
        for name, child in self.children.items():
            if child.process.poll() is None:
                role = name.split("-")[0]
                counts[name] = int(value(scrape(child.metrics_url), "voicechat_active_sessions", role))
        return counts

    def wait_idle(self, timeout_s: float = 10.0) -> dict[str, int]:
        """Every count back to zero (or what is left after timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while any((counts := self.sessions()).values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return counts

    def close(self) -> None:
        self.run(self.server.stop(0))
        self.clients.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        stop(list(self.children.values()))


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    cluster = Cluster(tiny_checkpoint)
    yield cluster
    cluster.close()


@pytest.fixture(autouse=True)
def _every_service_running(request):
    """A test that failed between killing a replica and restarting it leaves the next test every service."""
    if "cluster" in request.fixturenames:
        cluster = request.getfixturevalue("cluster")
        for name, child in list(cluster.children.items()):
            if child.process.poll() is not None:
                restart(cluster, name)


@pytest.fixture(scope="module")
def wave():
    return load_golden("online")[0]["waveform"]


def inputs(wave, count: int) -> list[tuple[np.ndarray, int]]:
    """`count` different conversations: a different stretch of the input and a different seed each."""
    return [(np.roll(wave, -N * 3 * k)[: N * FRAMES], 10 + k) for k in range(count)]


async def talk(address: str, samples: np.ndarray, seed: int, *, hold_after: int | None = None,
               held: asyncio.Event | None = None, resume: asyncio.Event | None = None) -> list[tuple]:
    """One conversation; with hold_after, it pushes that many frames, waits until their audio is back (then sets
    `held`) and pushes the rest once `resume` is set. Returns the described responses and, as the last item,
    the seconds from resuming to the end of the stream."""
    frames = chunks(samples)
    got: list[tuple] = []
    audio_seen = asyncio.Event()
    ended = asyncio.Event()  # the server ended the conversation with an error: send nothing more
    resumed_at: list[float] = []

    async def requests():
        yield configure(seed=seed)
        for i, chunk in enumerate(frames):
            if i == hold_after:
                await audio_seen.wait()
                held.set()
                await resume.wait()
                resumed_at.append(time.monotonic())
            if ended.is_set():
                return
            yield chunk
        yield flush()

    async with grpc.aio.insecure_channel(address) as channel:
        call = conversation_pb2_grpc.ConversationServiceStub(channel).Converse(requests(), timeout=120)
        try:
            async for response in call:
                got.append(describe(response))
                if got[-1][0] == "error":
                    ended.set()
                if hold_after is not None and sum(e[0] == "audio" for e in got) == hold_after:
                    audio_seen.set()
        except grpc.aio.AioRpcError as exc:
            # a frame already on its way when the server ends the conversation fails on this side (INTERNAL)
            # if its send loses the race with the server's status; the conversation had ended with its error
            if not (ended.is_set() and exc.code() == grpc.StatusCode.INTERNAL):
                raise
    return got, (time.monotonic() - resumed_at[0]) if resumed_at else None


def solo(cluster: Cluster, samples, seed) -> list[tuple]:
    return asyncio.run(talk(cluster.address, samples, seed))[0]


async def held_conversations(cluster: Cluster, conversations, hold_after: int, fault) -> list:
    """Run the conversations together, apply `fault()` once every one holds after `hold_after` frames, resume."""
    held = [asyncio.Event() for _ in conversations]
    resume = asyncio.Event()
    tasks = [asyncio.create_task(talk(cluster.address, samples, seed, hold_after=hold_after, held=h, resume=resume))
             for (samples, seed), h in zip(conversations, held, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(h.wait() for h in held)), 60)
    fault()
    resume.set()
    return await asyncio.gather(*tasks)


def restart(cluster: Cluster, name: str) -> None:
    """Start `name` again on the port it had, and give the channel time to find it healthy."""
    cluster.start(name, cluster.ports[name])
    time.sleep(3.0)  # above the channel's longest reconnect backoff (2 s)


def test_a_killed_replicas_conversations_move_to_the_survivor_and_a_restarted_one_serves_again(cluster, wave):
    conversations = inputs(wave, 4)
    expected = [solo(cluster, samples, seed) for samples, seed in conversations]
    assert len({tuple(e) for e in expected}) == 4 and all(e[-1] == ("done", FRAMES) for e in expected)

    victim = cluster.children["llm-a"].process
    results = asyncio.run(held_conversations(cluster, conversations, 8, lambda: os.kill(victim.pid, signal.SIGKILL)))
    victim.wait(10)

    # round_robin spread the four language sessions over both replicas: the two on the killed one moved to the
    # survivor by replay (orchestrator/failover.py), and every conversation is what it would have been
    assert [got for got, _ in results] == expected
    assert not any(cluster.wait_idle().values())

    # every new session now lands on the survivor
    for (samples, seed), want in zip(conversations[:2], expected, strict=False):
        assert solo(cluster, samples, seed) == want

    restart(cluster, "llm-a")
    os.kill(cluster.children["llm-b"].process.pid, signal.SIGKILL)  # only the restarted replica is left
    cluster.children["llm-b"].process.wait(10)
    samples, seed = conversations[3]
    assert solo(cluster, samples, seed) == expected[3]
    restart(cluster, "llm-b")
    assert not any(cluster.wait_idle().values())


def test_a_hung_service_trips_the_frame_deadline(cluster, wave):
    (samples, seed), = inputs(wave, 1)
    expected = solo(cluster, samples, seed)
    codec = cluster.children["codec"].process

    def hang() -> None:
        os.kill(codec.pid, signal.SIGSTOP)

    try:
        ((got, seconds),) = asyncio.run(held_conversations(cluster, [(samples, seed)], 6, hang))
    finally:
        os.kill(codec.pid, signal.SIGCONT)
    # one codec replica, hung: the deadline (or the keepalive's 4 s) trips, and each replay attempt of the failover
    # (3) gives up within the frame deadline
    assert got[-1][:2] == ("error", "ERROR_CODE_SERVICE_UNAVAILABLE") and "the codec service" in got[-1][2]
    assert "no healthy codec replica took the session over" in got[-1][2]
    assert seconds < FRAME_DEADLINE_S * 4 + 3.0
    assert not any(cluster.wait_idle().values())
    assert codec.poll() is None
    time.sleep(3.0)  # the resumed service's channel reconnects
    assert solo(cluster, samples, seed) == expected


def test_a_draining_replica_takes_no_new_sessions_and_its_cut_ones_move_on(cluster, wave):
    conversations = inputs(wave, 2)
    expected = [solo(cluster, samples, seed) for samples, seed in conversations]
    victim = cluster.children["llm-b"].process

    async def scenario():
        held = [asyncio.Event() for _ in conversations]
        resume = asyncio.Event()
        tasks = [asyncio.create_task(talk(cluster.address, samples, seed, hold_after=4, held=h, resume=resume))
                 for (samples, seed), h in zip(conversations, held, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(h.wait() for h in held)), 60)
        victim.send_signal(signal.SIGTERM)  # --drain-seconds 1: NOT_SERVING now, sessions cut after 1 s
        await asyncio.sleep(0.3)
        fresh = await talk(cluster.address, *conversations[0])  # a new session avoids the draining replica
        await asyncio.sleep(1.5)
        resume.set()
        return fresh[0], await asyncio.gather(*tasks)

    fresh, results = asyncio.run(scenario())
    assert victim.wait(10) == 0
    assert fresh == expected[0]
    # the drained replica cut its session after 1 s; that conversation moved to the other replica by replay
    assert [got for got, _ in results] == expected
    restart(cluster, "llm-b")
    assert not any(cluster.wait_idle().values())


def test_sigterm_drains_the_orchestrator(cluster, wave):
    import json
    import subprocess
    import sys

    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import connect

    from services.common.cli import parse_ready_line

    (finishing, cut) = inputs(wave, 2)
    expected = solo(cluster, *finishing)
    services = ",".join(f"{name}={address}" for name, address in cluster.addresses.items())
    process = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--model", str(cluster.model),
                                "--services", services, "--host", HOST, "--port", "0", "--realtime-port", "0",
                                "--drain-seconds", "6"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().split()[-1]
        ready = parse_ready_line(process.stdout.readline())
        assert ready is not None and url.startswith("ws://"), process.stderr.read()
        address = f"{HOST}:{ready[1]}"
        socket = connect(url, legacy=True)  # held open across the drain below
        assert json.loads(socket.recv(timeout=10))["type"] == "session.created"
        socket.send(json.dumps({"type": "session.update", "session": {}}))
        assert json.loads(socket.recv(timeout=30))["type"] == "session.updated"

        async def scenario():
            held = [asyncio.Event(), asyncio.Event()]
            resume = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(talk(address, samples, seed, hold_after=4, held=h, resume=r))
                     for (samples, seed), h, r in zip((finishing, cut), held, resume, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(h.wait() for h in held)), 60)
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = await asyncio.to_thread(converse, address, [configure()])
            resume[0].set()  # this one finishes within the drain period; the other stays silent past it
            return refused, await asyncio.gather(*tasks)

        started = time.monotonic()
        refused, ((finished, _), (ended, _)) = asyncio.run(scenario())
        assert refused[0][:2] == ("error", "ERROR_CODE_SERVICE_UNAVAILABLE") and "shutting down" in refused[0][2]
        assert finished == expected
        assert ended[-1][:2] == ("error", "ERROR_CODE_SERVICE_UNAVAILABLE") and "shutting down" in ended[-1][2]
        assert sum(e[0] == "audio" for e in ended) == 4

        farewell = json.loads(socket.recv(timeout=10))
        assert farewell["type"] == "error" and farewell["error"]["code"] == "server_shutting_down"
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv(timeout=10)
        assert closed.value.rcvd.code == 1001
        with pytest.raises((InvalidStatus, ConnectionRefusedError, OSError)):
            connect(url, open_timeout=5)
        assert process.wait(30) == 0
        assert time.monotonic() - started < 25
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
