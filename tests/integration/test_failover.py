"""Failover: two replicas of each network as child processes (as `orchestrator serve --replicas all=2` starts them),
one `ipv4:` target per network; a replica holding a live conversation is killed, hung or drained, and the
conversation moves to the other replica by replay. Its whole event stream (every event's fields and every audio
frame's codes and samples, byte for byte) must equal an uninterrupted run's, which equals the golden."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from bench.failover import NETWORK, Replicas, converse, flat
from bench.failover import main as bench_main
from orchestrator.clients import Deadlines
from orchestrator.failover import FailoverPolicy
from tests.conftest import load_golden

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals")

FRAME_DEADLINE_S = 2.0
NO_MOVES = dict.fromkeys(NETWORK, 0)


@pytest.fixture(scope="module")
def replicas(tiny_checkpoint):
    cluster = Replicas(tiny_checkpoint, Deadlines(open_s=30.0, frame_s=FRAME_DEADLINE_S))
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def wave():
    return load_golden("online")[0]["waveform"]


@pytest.fixture(scope="module")
def uninterrupted(replicas, wave):
    data, meta = load_golden("online")
    run = converse(replicas, wave)
    assert [e.describe() for e in run.events if e.kind != "audio"] == meta["events"]
    assert np.array_equal(np.stack([e.audio_codes for e in run.events if e.kind == "audio"]), data["audio_codes"])
    assert run.moves == NO_MOVES
    # the replay logs after the 64 whole frames: the opening message plus one step a frame, each as serialized
    # (frame 0's index is proto3's default, so its step is 2 B shorter); perception: 1280 float32 samples + 17 B,
    # the codec: 31 int32 codes + 15 B, the language model: `hidden` float32 + its framing (ids of varying size)
    whole = len(wave) // 1280
    assert run.history_bytes["perception"] == 5 + whole * (4 * 1280 + 17) - 2
    assert run.history_bytes["codec"] == 2 + whole * (4 * 31 + 15) - 2
    hidden = replicas.config.text_config.hidden_size
    assert whole * 4 * hidden < run.history_bytes["llm"] - len(replicas.config.default_system_prompt) < whole * (
        4 * hidden + 24) + 64
    return flat(run.events)


def test_a_conversation_survives_a_killed_replica_of_each_network_in_turn(replicas, wave, uninterrupted):
    killed: list[str] = []
    faults = {10 + 12 * k: lambda network=network: killed.append(replicas.kill_holder(network)) for k, network in
              enumerate(NETWORK)}
    try:
        run = converse(replicas, wave, faults)
        assert flat(run.events) == uninterrupted
        assert run.moves == dict.fromkeys(NETWORK, 1)
        assert [name.split("-")[0] for name in killed] == list(NETWORK)
        assert all(replicas.children[name].process.wait(10) == -signal.SIGKILL for name in killed)
        assert len(run.pauses()) == 4 and all(p < FRAME_DEADLINE_S for p in run.pauses()), run.pauses()
    finally:
        replicas.revive()


SNAPSHOT_FRAMES = 8


@pytest.fixture
def snapshotting(replicas):
    """Every stream snapshots its session every SNAPSHOT_FRAMES steps."""
    channels = [c.channel for c in (replicas.clients.perception, replicas.clients.language, replicas.clients.speech,
                                    replicas.clients.codec)]
    before = [channel.failover for channel in channels]
    for channel in channels:
        channel.failover = FailoverPolicy(snapshot_frames=SNAPSHOT_FRAMES)
    yield
    for channel, policy in zip(channels, before, strict=True):
        channel.failover = policy


def test_with_snapshots_a_killed_replica_of_each_network_is_restored_and_replays_one_interval_at_most(
        replicas, wave, uninterrupted, snapshotting):
    faults = {10 + 12 * k + 3 * (k % 2): lambda network=network: replicas.kill_holder(network)
              for k, network in enumerate(NETWORK)}  # 1 to 7 steps past a snapshot
    try:
        run = converse(replicas, wave, faults)
        assert flat(run.events) == uninterrupted
        assert run.moves == dict.fromkeys(NETWORK, 1)
        # rebuilt from a snapshot, not from the open (10 steps or more): never more than the interval run again
        assert all(run.replayed[name] <= SNAPSHOT_FRAMES for name in NETWORK), run.replayed
        assert all(run.snapshot_bytes[name] > 0 for name in NETWORK), run.snapshot_bytes
        # after each stream's first snapshot (and the first after its move), the growing states came as deltas;
        # perception's and the codec's states are of a fixed size: whole each time
        assert run.deltas["llm"] > 0 and run.deltas["tts"] > 0 and run.deltas["perception"] == run.deltas["codec"] == 0
        assert all(run.history_bytes[name] < uninterrupted_log for name, uninterrupted_log in
                   {"perception": 9 * (4 * 1280 + 17) + 5, "codec": 9 * (4 * 31 + 15) + 2}.items())
    finally:
        replicas.revive()


def test_a_conversation_survives_a_hung_replica_past_the_frame_deadline(replicas, wave, uninterrupted):
    stopped: list[str] = []
    try:
        run = converse(replicas, wave, {20: lambda: stopped.append(replicas.kill_holder("llm", signal.SIGSTOP))})
    finally:
        for name in stopped:
            os.kill(replicas.children[name].process.pid, signal.SIGCONT)
    assert flat(run.events) == uninterrupted
    assert run.moves == {**NO_MOVES, "llm": 1}
    # the frame deadline (or the channel's 4 s keepalive) called the replica gone, then the replay on the other
    # replica (a first replay that landed on the hung one too gave up within the frame deadline)
    assert FRAME_DEADLINE_S * 0.9 < run.pauses()[0] < FRAME_DEADLINE_S * 2 + 3.0, run.pauses()
    time.sleep(3.0)  # the resumed replica's channel reconnects


def test_a_rolling_restart_drains_a_conversation_to_the_other_replica(replicas, wave, uninterrupted):
    drained: list[str] = []
    faults = {16: lambda: drained.append(replicas.kill_holder("tts", signal.SIGTERM)),  # --drain-seconds 1
              17: lambda: time.sleep(1.5)}  # the draining replica cuts the stream meanwhile
    try:
        run = converse(replicas, wave, faults)
        assert flat(run.events) == uninterrupted
        assert run.moves == {**NO_MOVES, "tts": 1}
        assert replicas.children[drained[0]].process.wait(10) == 0  # drained and exited cleanly
    finally:
        replicas.revive()


def test_past_the_history_cap_a_failure_ends_the_session_with_an_error_saying_so(replicas, wave):
    replicas.clients.codec.channel.failover = FailoverPolicy(max_history_frames=8, snapshot_frames=0)
    try:
        with pytest.raises(Exception, match="passed 8 frames, the history kept for failover"):
            converse(replicas, wave, {20: lambda: replicas.kill_holder("codec")})
    finally:
        replicas.clients.codec.channel.failover = FailoverPolicy(snapshot_frames=0)
        replicas.revive()


def test_bench_reports_the_pause_and_checks_the_events(tiny_checkpoint, capsys):
    assert bench_main(["--model", str(tiny_checkpoint), "--ages", "1", "--networks", "tts,llm", "--spacing", "0.4",
                       "--snapshot-seconds", "0.4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    # one run kills each network's holder in turn: tts at 12 frames of age, the language model 5 frames later
    assert [(r["network"], r["frames"]) for r in rows] == [("tts", 12), ("llm", 17)]
    for row in rows:
        assert row["identical"] and 0 < row["pause_s"] < 5
        assert row["replayed"] <= 5 and row["snapshot_bytes"] > 0  # a snapshot every 5 frames, the last restored
        assert row["received_bytes"] > 0
    # the last speech snapshot came as a delta: the keys of 5 frames, not the state held (the language model's
    # tiny state is almost all fixed-size Mamba state, sent whole each time)
    assert rows[0]["received_bytes"] < rows[0]["snapshot_bytes"]


def test_the_faults_of_one_run_come_spacing_apart():
    from bench.failover import fault_frames

    assert fault_frames(1.0, 3, 0.4) == [11, 16, 21]  # after 12 frames, then every 5
    assert fault_frames(10.0, 1, 2.0) == [124]
    assert fault_frames(0.5, 2, 0.01) == [5, 6]  # at least a frame apart (0.5 s: 6.25 frames, rounded to 6)

