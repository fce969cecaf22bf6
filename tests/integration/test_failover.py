"""Failover: two replicas of each network as child processes (as `orchestrator serve --replicas all=2` starts them),
one `ipv4:` target per network; a replica holding a live conversation is killed, hung or drained, and the
conversation moves to the other replica by replay. Its whole event stream (every event's fields and every audio
frame's codes and samples, byte for byte) must equal an uninterrupted run's, which equals the golden."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from orchestrator.clients import Deadlines
from orchestrator.launcher import ServiceProcess, spawn_service, stop, wait_ready
from orchestrator.session import OnlineSession, transcript_vocabulary
from orchestrator.stream_clients import grpc_stream_clients
from orchestrator.text import TextDecoder
from services.common.config import VoiceChatConfig
from services.common.metrics import scrape
from tests.conftest import load_golden
from tests.integration.test_process_metrics import value

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals")

HOST = "127.0.0.1"
N = 1280
NETWORK = ("perception", "llm", "tts", "codec")
FRAME_DEADLINE_S = 2.0


class Replicas:
    """Replicas "NAME-0" and "NAME-1" of each network, and stream clients whose channels spread over both."""

    def __init__(self, model):
        self.model = model
        self.children: dict[str, ServiceProcess] = {}
        self.start([f"{name}-{r}" for name in NETWORK for r in range(2)])
        self.ports = {name: int(child.address.rpartition(":")[2]) for name, child in self.children.items()}
        addresses = {name: f"ipv4:{HOST}:{self.ports[f'{name}-0']},{HOST}:{self.ports[f'{name}-1']}"
                     for name in NETWORK}
        self.clients = grpc_stream_clients(addresses, Deadlines(open_s=30.0, frame_s=FRAME_DEADLINE_S))
        self.config = VoiceChatConfig.load(model)
        self.decoder, self.vocabulary = TextDecoder(model, self.config), transcript_vocabulary(model, self.config)
        time.sleep(1.0)  # every channel connects to both replicas

    def start(self, names: list[str]) -> None:
        """Start the replicas (on the port each had, if any) and wait until they serve and announce metrics."""
        started = []
        for name in names:
            port = getattr(self, "ports", {}).get(name)
            extra = ["--drain-seconds", "1", "--metrics-port", "0"] + (["--port", str(port)] if port else [])
            started.append(spawn_service(name.split("-")[0], self.model, extra))
            self.children[name] = started[-1]
        wait_ready(started, timeout_s=120)
        deadline = time.monotonic() + 10
        while not all(child.metrics_url for child in started) and time.monotonic() < deadline:
            time.sleep(0.02)

    def revive(self) -> None:
        """Restart every replica that is gone, and give the channels time to find them (backoff is 2 s at most)."""
        gone = [name for name, child in self.children.items() if child.process.poll() is not None]
        if gone:
            self.start(gone)
            time.sleep(3.0)

    def holder(self, network: str) -> str:
        """The replica of `network` the one open session's stream is on."""
        holding = [name for name in (f"{network}-0", f"{network}-1")
                   if value(scrape(self.children[name].metrics_url), "voicechat_active_sessions", network)]
        assert len(holding) == 1, holding
        return holding[0]

    def close(self) -> None:
        self.clients.close()
        stop(list(self.children.values()))


@pytest.fixture(scope="module")
def replicas(tiny_checkpoint):
    cluster = Replicas(tiny_checkpoint)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def golden():
    return load_golden("online")


def flat(events) -> list[tuple]:
    """Every field of every event, arrays as bytes."""
    return [(e.kind, e.frame_index, e.token_id, e.delta, e.text, e.message,
             *(None if a is None else a.tobytes() for a in (e.samples, e.audio_codes, e.raw_codes))) for e in events]


def converse(replicas: Replicas, wave: np.ndarray, faults: dict[int, callable] | None = None):
    """One conversation (the golden's input, prompt and seed) pushed frame by frame as fast as the pipeline takes
    it; `faults[k]()` runs right after frame k is pushed, with frames still in flight. Returns the events and, per
    fault, the seconds from the fault to the next audio event, and how many times each network's stream moved."""
    arrivals: list[float] = []  # when each audio event came out
    events: list = []

    def arrived(event) -> None:
        events.append(event)
        if event.kind == "audio":
            arrivals.append(time.monotonic())

    session = OnlineSession(replicas.clients, replicas.config, replicas.decoder, rnnt_vocabulary=replicas.vocabulary,
                            on_event=arrived)
    pauses = []
    for i, start in enumerate(range(0, len(wave), N)):
        session.push_audio(wave[start : start + N])
        if faults and i in faults:
            pauses.append((time.monotonic(), len(arrivals)))
            faults[i]()
    session.flush(pad_partial=True)
    session.close()
    streams = (session.perception, session.language, session.speech, session.codec)
    moves = {name: s.stream.failovers for name, s in zip(NETWORK, streams, strict=True)}
    return events, [arrivals[seen] - faulted for faulted, seen in pauses if seen < len(arrivals)], moves


@pytest.fixture(scope="module")
def uninterrupted(replicas, golden):
    data, meta = golden
    events, _, moves = converse(replicas, data["waveform"])
    assert moves == dict.fromkeys(NETWORK, 0)
    assert [e.describe() for e in events if e.kind != "audio"] == meta["events"]
    assert np.array_equal(np.stack([e.audio_codes for e in events if e.kind == "audio"]), data["audio_codes"])
    return flat(events)


def kill_holder(replicas: Replicas, network: str, sig=signal.SIGKILL) -> callable:
    def fault() -> None:
        victim = replicas.holder(network)
        os.kill(replicas.children[victim].process.pid, sig)
        killed.append(victim)

    killed: list[str] = []
    fault.killed = killed
    return fault


def test_a_conversation_survives_a_killed_replica_of_each_network_in_turn(replicas, golden, uninterrupted):
    faults = {10 + 12 * k: kill_holder(replicas, network) for k, network in enumerate(NETWORK)}
    try:
        events, pauses, moves = converse(replicas, golden[0]["waveform"], faults)
        assert flat(events) == uninterrupted
        assert moves == dict.fromkeys(NETWORK, 1)
        # each fault hit the replica holding the conversation, which died; the conversation went on elsewhere
        assert [f.killed[0].split("-")[0] for f in faults.values()] == list(NETWORK)
        assert all(replicas.children[f.killed[0]].process.wait(10) == -signal.SIGKILL for f in faults.values())
        assert len(pauses) == 4 and all(p < FRAME_DEADLINE_S for p in pauses), pauses
    finally:
        replicas.revive()


def test_a_conversation_survives_a_hung_replica_past_the_frame_deadline(replicas, golden, uninterrupted):
    stopped: list[int] = []

    def hang() -> None:
        stopped.append(replicas.children[replicas.holder("llm")].process.pid)
        os.kill(stopped[0], signal.SIGSTOP)

    started = time.monotonic()
    try:
        events, pauses, moves = converse(replicas, golden[0]["waveform"], {20: hang})
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert flat(events) == uninterrupted
    assert moves == {**dict.fromkeys(NETWORK, 0), "llm": 1}
    # the frame deadline (or the channel's 4 s keepalive) called the replica gone; the replay then took
    # well under the rest of the budget on the other one
    assert FRAME_DEADLINE_S * 0.9 < pauses[0] < FRAME_DEADLINE_S + 6.0, pauses
    assert time.monotonic() - started < 60
    time.sleep(3.0)  # the resumed replica's channel reconnects


def test_a_rolling_restart_drains_a_conversation_to_the_other_replica(replicas, golden, uninterrupted):
    drained: list[ServiceProcess] = []

    def sigterm() -> None:
        drained.append(replicas.children[replicas.holder("tts")])
        drained[0].process.send_signal(signal.SIGTERM)  # --drain-seconds 1: the stream is cut after 1 s

    def after_cut() -> None:
        time.sleep(1.5)  # frames keep flowing on the draining replica meanwhile

    try:
        events, _, moves = converse(replicas, golden[0]["waveform"], {16: sigterm, 17: after_cut})
        assert flat(events) == uninterrupted
        assert moves == {**dict.fromkeys(NETWORK, 0), "tts": 1}
        assert drained[0].process.wait(10) == 0  # drained and exited cleanly
    finally:
        replicas.revive()
