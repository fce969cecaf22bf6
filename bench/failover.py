"""The pause a conversation sees when a replica holding it fails, as a function of the conversation's age.

    python -m bench.failover --model DIR [--ages 10,60,300] [--networks perception,llm,tts,codec]
                             [--input examples/question.wav] [--frame-deadline 15] [--service-flags NAME=FLAGS]
                             [--snapshot-seconds S] [--json]

Two replicas of each network run as child processes (as `orchestrator serve --replicas all=2` starts them), one
`ipv4:` target per network. For each age A (seconds of audio) and each network, one conversation (the input file
looped) is pushed as fast as the pipeline takes it for A seconds; then the replica holding the conversation's
stream of that network is killed (SIGKILL), the conversation goes on, and the replica is started again. The pause
is the time from the kill to the conversation's next audio frame: the stream's replay on the other replica (every
request of the session, sent back to back; with --snapshot-seconds S, the latest snapshot restored and only the
requests since it) plus that frame. A row also gives the frame interval before the fault, the session's replay log
(its serialized bytes, and per frame), the steps the failover ran again and the latest snapshot's size.

Each row's conversation is also run once undisturbed first, and the bench fails if the faulted run's events differ
(the failover's guarantee).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from orchestrator.clients import Deadlines
from orchestrator.failover import FailoverPolicy
from orchestrator.launcher import ServiceProcess, spawn_service, stop, wait_ready
from orchestrator.session import OnlineSession, transcript_vocabulary
from orchestrator.stream_clients import grpc_stream_clients
from orchestrator.text import TextDecoder
from services.common.config import VoiceChatConfig
from services.common.metrics import scrape

NETWORK = ("perception", "llm", "tts", "codec")
HOST = "127.0.0.1"
FRAME = 1280  # input samples per 80 ms frame


class Replicas:
    """Replicas "NAME-0" and "NAME-1" of each network as child processes (each with --metrics-port 0 and
    --drain-seconds 1, plus `flags[NAME]`), and stream clients whose channels spread over both."""

    def __init__(self, model: Path, deadlines: Deadlines, flags: dict[str, list[str]] | None = None,
                 failover: FailoverPolicy | None = None):
        self.model, self.flags = model, flags or {}
        self.children: dict[str, ServiceProcess] = {}
        self.ports: dict[str, int] = {}
        try:
            self.start([f"{name}-{r}" for name in NETWORK for r in range(2)])
        except BaseException:
            stop(list(self.children.values()))
            raise
        self.ports = {name: int(child.address.rpartition(":")[2]) for name, child in self.children.items()}
        addresses = {name: f"ipv4:{HOST}:{self.ports[f'{name}-0']},{HOST}:{self.ports[f'{name}-1']}"
                     for name in NETWORK}
        self.clients = grpc_stream_clients(addresses, deadlines, failover or FailoverPolicy(snapshot_frames=0))
        self.config = VoiceChatConfig.load(model)
        self.decoder, self.vocabulary = TextDecoder(model, self.config), transcript_vocabulary(model, self.config)
        time.sleep(1.0)  # every channel connects to both replicas (round robin picks among connected ones)

    def start(self, names: list[str]) -> None:
        """Start the replicas (on the port each had, if any) and wait until they serve and announce metrics."""
        started = []
        for name in names:
            network = name.split("-")[0]
            extra = ["--drain-seconds", "1", "--metrics-port", "0", *self.flags.get(network, [])]
            if name in self.ports:
                extra += ["--port", str(self.ports[name])]
            started.append(spawn_service(network, self.model, extra))
            self.children[name] = started[-1]
        wait_ready(started)
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
        """The replica of `network` holding the one open session's stream."""
        holding = [name for name in (f"{network}-0", f"{network}-1")
                   if _active_sessions(self.children[name].metrics_url, network)]
        if len(holding) != 1:
            raise RuntimeError(f"expected one {network} replica to hold the session, found {holding or 'none'}")
        return holding[0]

    def kill_holder(self, network: str, sig: int = signal.SIGKILL) -> str:
        victim = self.holder(network)
        os.kill(self.children[victim].process.pid, sig)
        return victim

    def close(self) -> None:
        if hasattr(self, "clients"):
            self.clients.close()
        stop(list(self.children.values()))


def _active_sessions(url: str, network: str) -> float:
    return scrape(url).get(("voicechat_active_sessions", frozenset({"service": network}.items())), 0.0)


@dataclass
class Conversation:
    events: list  # every event, in order
    arrivals: list[float]  # monotonic time of each audio event
    faults: list[tuple[float, int]]  # (monotonic time of the fault, audio events out before it)
    moves: dict[str, int]  # failovers of each network's stream
    history_bytes: dict[str, int]  # each network's replay log at the end, serialized bytes
    replayed: dict[str, int] = field(default_factory=dict)  # steps each network's last failover ran again
    snapshot_bytes: dict[str, int] = field(default_factory=dict)  # each network's latest snapshot at the end

    def pauses(self) -> list[float]:
        """Seconds from each fault to the next audio event."""
        return [self.arrivals[seen] - at for at, seen in self.faults if seen < len(self.arrivals)]


def converse(replicas: Replicas, wave: np.ndarray, faults: dict | None = None, *, seed: int = 0,
             system_prompt: str | None = None) -> Conversation:
    """One conversation pushed frame by frame as fast as the pipeline takes it, then flushed; `faults[k]()` runs
    once frames 0..k are through every stage (the session is k + 1 frames old), and the frames after it are
    pushed at once, so several are in flight when the fault is found."""
    out = Conversation([], [], [], {}, {})

    def arrived(event) -> None:
        out.events.append(event)
        if event.kind == "audio":
            out.arrivals.append(time.monotonic())

    session = OnlineSession(replicas.clients, replicas.config, replicas.decoder, seed=seed,
                            system_prompt=system_prompt, rnnt_vocabulary=replicas.vocabulary, on_event=arrived)
    try:
        for i, start in enumerate(range(0, len(wave), FRAME)):
            session.push_audio(wave[start : start + FRAME])
            if faults and i in faults:
                session.drain()
                out.faults.append((time.monotonic(), len(out.arrivals)))
                faults[i]()
        session.drain()
        streams = dict(zip(NETWORK, (session.perception, session.language, session.speech, session.codec),
                           strict=True))
        out.history_bytes = {name: s.stream.history_bytes for name, s in streams.items()}
        out.snapshot_bytes = {name: getattr(s.stream, "snapshot_bytes", 0) for name, s in streams.items()}
        session.flush(pad_partial=True)
        out.moves = {name: s.stream.failovers for name, s in streams.items()}
        out.replayed = {name: getattr(s.stream, "replayed", 0) for name, s in streams.items()}
    finally:
        session.close()
    return out


def flat(events) -> list[tuple]:
    """Every field of every event, arrays as bytes: two runs are equal byte for byte when these are."""
    return [(e.kind, e.frame_index, e.token_id, e.delta, e.text, e.message,
             *(None if a is None else a.tobytes() for a in (e.samples, e.audio_codes, e.raw_codes))) for e in events]


@dataclass
class Row:
    network: str
    age_s: float
    frames: int
    pause_s: float
    frame_s: float  # the median interval between audio frames before the fault
    history_bytes: int  # the network's replay log after the undisturbed run's last whole frame
    bytes_per_frame: float
    identical: bool
    replayed: int = 0  # steps the failover ran again (since the snapshot it restored, or since the open)
    snapshot_bytes: int = 0  # the network's latest snapshot in the undisturbed run


def looped(path: Path, seconds: float) -> np.ndarray:
    from orchestrator.audio import read_audio

    audio = read_audio(path)
    samples = int(round(seconds * 16_000 / FRAME)) * FRAME + FRAME  # the age, plus one frame after the fault
    return np.resize(audio, samples).astype(np.float32)


def measure(replicas: Replicas, network: str, age_s: float, wave: np.ndarray) -> Row:
    frames = len(wave) // FRAME - 1
    calm = converse(replicas, wave)
    faulted = converse(replicas, wave, {frames - 1: lambda: replicas.kill_holder(network)})
    replicas.revive()
    gaps = np.diff(calm.arrivals)
    history = calm.history_bytes[network]
    return Row(network, age_s, frames, faulted.pauses()[0], float(np.median(gaps)) if len(gaps) else 0.0, history,
               history / max(frames, 1), flat(faulted.events) == flat(calm.events) and faulted.moves[network] == 1,
               faulted.replayed[network], calm.snapshot_bytes[network])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--ages", default="10,60,300", help="conversation ages at the fault, seconds of audio")
    parser.add_argument("--networks", default=",".join(NETWORK))
    parser.add_argument("--input", type=Path, default=Path(__file__).resolve().parent.parent / "examples/question.wav")
    parser.add_argument("--frame-deadline", type=float, default=15.0, help="seconds (Deadlines.frame_s)")
    parser.add_argument("--service-flags", action="append", default=[], metavar="NAME=FLAGS",
                        help="extra flags for a network's replicas (NAME one of the four or all), repeatable")
    parser.add_argument("--snapshot-seconds", type=float, default=0.0,
                        help="seconds between snapshots of each stream's session (default 0: replay the whole log)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from orchestrator.connect import parse_service_flags, service_flags

    try:
        ages = [float(a) for a in args.ages.split(",")]
        networks = [n.strip() for n in args.networks.split(",")]
        flags = service_flags([parse_service_flags(text) for text in args.service_flags])
        failover = FailoverPolicy.every(args.snapshot_seconds)
    except ValueError as exc:
        parser.error(str(exc))
    if unknown := [n for n in networks if n not in NETWORK]:
        parser.error(f"--networks: unknown {', '.join(unknown)}; choose from {', '.join(NETWORK)}")
    replicas = Replicas(args.model, Deadlines(frame_s=args.frame_deadline), flags, failover)
    rows = []
    try:
        for age in ages:
            wave = looped(args.input, age)
            for network in networks:
                rows.append(measure(replicas, network, age, wave))
                if not args.json:
                    r = rows[-1]
                    print(f"{r.network:>10} age {r.age_s:6.0f} s ({r.frames} frames): pause {r.pause_s:7.3f} s  "
                          f"frame {r.frame_s * 1000:6.1f} ms  log {r.history_bytes / 1e6:7.2f} MB "
                          f"({r.bytes_per_frame:.0f} B/frame)  replayed {r.replayed}  snapshot "
                          f"{r.snapshot_bytes / 1e6:.2f} MB  identical {r.identical}", flush=True)
    finally:
        replicas.close()
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    else:
        by_age = {age: statistics.mean(r.pause_s for r in rows if r.age_s == age) for age in ages}
        print("mean pause by age: " + ", ".join(f"{age:g} s -> {p:.3f} s" for age, p in by_age.items()))
    return 0 if all(r.identical for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
