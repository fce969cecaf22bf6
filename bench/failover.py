"""The pause a conversation sees when a replica holding it fails, as a function of the conversation's age.

    python -m bench.failover --model DIR [--ages 10,60,300] [--networks perception,llm,tts,codec]
                             [--spacing 2] [--input examples/question.wav] [--frame-deadline 15]
                             [--service-flags NAME=FLAGS] [--snapshot-seconds S] [--json]

Two replicas of each network run as child processes (as `orchestrator serve --replicas all=2` starts them), one
`ipv4:` target per network. For each age A (seconds of audio), one conversation (the input file looped) is pushed
as fast as the pipeline takes it; when it is A seconds old the replica holding its stream of the first network is
killed (SIGKILL), the conversation goes on, and every --spacing seconds after that (2 by default) the next
network's holder is killed the same way, so one run measures every network at about the same age (A, A + 2, ...).
The killed replicas are started again after the run. A network's pause is the time from its kill to the
conversation's next audio frame: the stream's replay on the other replica (every request of the session, sent
back to back; with --snapshot-seconds S, the latest snapshot restored and only the requests since it) plus that
frame. A row also gives the frame interval before the faults, the session's replay log (its serialized bytes, and
per frame), the steps the failover ran again and the latest snapshot's size.

Each age's conversation is also run once undisturbed first, and the bench fails if the faulted run's events differ
(the failover's guarantee). Two runs per age in all, whatever the number of networks.
"""

from __future__ import annotations

import argparse
import functools
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
from orchestrator.launcher import LaunchError, ServiceProcess, spawn_service, stop, wait_ready
from orchestrator.session import OnlineSession, transcript_vocabulary
from orchestrator.stream_clients import grpc_stream_clients
from orchestrator.text import TextDecoder
from services.common.config import VoiceChatConfig
from services.common.metrics import scrape

NETWORK = ("perception", "llm", "tts", "codec")
HOST = "127.0.0.1"
FRAME = 1280  # input samples per 80 ms frame
FRAME_S = 0.08


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

    def revive(self, attempts: int = 5) -> None:
        """Restart every replica that is gone, and give the channels time to find them (backoff is 2 s at most).
        A replica goes back on its old port, which another process may hold for a moment (the system handed it
        out again meanwhile): that start is tried again a second later, `attempts` times in all."""
        for attempt in range(attempts):
            gone = [name for name, child in self.children.items() if child.process.poll() is not None]
            if not gone:
                break
            try:
                self.start(gone)
            except LaunchError as exc:
                if "the port is in use" not in str(exc) or attempt == attempts - 1:
                    raise
                time.sleep(1.0)
                continue
            time.sleep(3.0)
            break

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
    deltas: dict[str, int] = field(default_factory=dict)  # snapshots each network's stream took as deltas
    received_bytes: dict[str, int] = field(default_factory=dict)  # each network's last snapshot as received

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
        out.deltas = {name: getattr(s.stream, "deltas", 0) for name, s in streams.items()}
        out.received_bytes = {name: getattr(s.stream, "received_bytes", 0) for name, s in streams.items()}
    finally:
        session.close()
    return out


def flat(events) -> list[tuple]:
    """Every field of every event, arrays as bytes: two runs are equal byte for byte when these are."""
    return [(e.kind, e.frame_index, e.token_id, e.delta, e.text, e.text_start, e.message,
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
    snapshot_bytes: int = 0  # the network's latest snapshot in the undisturbed run (the state held)
    received_bytes: int = 0  # the last snapshot as it came in that run (a delta after the first: an interval's cost)


def looped(path: Path, frames: int) -> np.ndarray:
    """The input looped to `frames` frames."""
    from orchestrator.audio import read_audio

    return np.resize(read_audio(path), frames * FRAME).astype(np.float32)


def fault_frames(age_s: float, count: int, spacing_s: float) -> list[int]:
    """The frame after which each of `count` faults comes: the first when the session is `age_s` old (that many
    frames through every stage), the others `spacing_s` apart.

    >>> fault_frames(1.0, 3, 0.4)
    [11, 16, 21]
    """
    first, step = round(age_s / FRAME_S), max(round(spacing_s / FRAME_S), 1)
    return [first - 1 + i * step for i in range(count)]


def measure(replicas: Replicas, networks: list[str], age_s: float, spacing_s: float, path: Path) -> list[Row]:
    """One undisturbed run and one run that kills each network's holder in turn (in `networks`' order)."""
    at = fault_frames(age_s, len(networks), spacing_s)
    wave = looped(path, at[-1] + 2)  # one frame after the last fault, and the partial flush's
    calm = converse(replicas, wave)
    faulted = converse(replicas, wave, {k: functools.partial(replicas.kill_holder, network)
                                        for k, network in zip(at, networks, strict=True)})
    replicas.revive()
    gaps = np.diff(calm.arrivals[: at[0] + 1])
    same = flat(faulted.events) == flat(calm.events)
    rows = []
    for k, network, pause in zip(at, networks, faulted.pauses(), strict=True):
        frames = k + 1
        history = calm.history_bytes[network]
        rows.append(Row(network, frames * FRAME_S, frames, pause, float(np.median(gaps)) if len(gaps) else 0.0,
                        history, history / max(len(calm.arrivals), 1), same and faulted.moves[network] == 1,
                        faulted.replayed[network], calm.snapshot_bytes[network], calm.received_bytes[network]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--ages", default="10,60,300", help="conversation ages at the fault, seconds of audio")
    parser.add_argument("--networks", default=",".join(NETWORK), help="killed in this order, --spacing apart")
    parser.add_argument("--spacing", type=float, default=2.0,
                        help="seconds of audio between one network's fault and the next's (default 2)")
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
    if len(set(networks)) != len(networks):
        parser.error(f"--networks {args.networks}: name each network once (one fault each per run)")
    replicas = Replicas(args.model, Deadlines(frame_s=args.frame_deadline), flags, failover)
    rows: list[Row] = []
    means: dict[float, float] = {}  # each age's mean pause over the networks
    try:
        for age in ages:
            run = measure(replicas, networks, age, args.spacing, args.input)
            rows += run
            means[age] = statistics.mean(r.pause_s for r in run)
            for r in run:
                if not args.json:
                    print(f"{r.network:>10} age {r.age_s:6.1f} s ({r.frames} frames): pause {r.pause_s:7.3f} s  "
                          f"frame {r.frame_s * 1000:6.1f} ms  log {r.history_bytes / 1e6:7.2f} MB "
                          f"({r.bytes_per_frame:.0f} B/frame)  replayed {r.replayed}  snapshot "
                          f"{r.snapshot_bytes / 1e6:.2f} MB (last received {r.received_bytes / 1e6:.2f} MB)  "
                          f"identical {r.identical}", flush=True)
    finally:
        replicas.close()
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    else:
        print("mean pause by age: " + ", ".join(f"{age:g} s -> {p:.3f} s" for age, p in means.items()))
    return 0 if all(r.identical for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
