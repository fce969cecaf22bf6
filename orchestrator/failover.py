"""Failover: a session's stream to one network that survives its replica, by restoring its latest snapshot and
replaying what the network received since.

Every answer a network gives a session is a deterministic function of the requests the session sent it (the
stream's opening message, then every step: audio, text ids, codes, seeds, forced ids, all inside the messages).
A ReplayStream keeps those whole request messages; when its replica dies (UNAVAILABLE, the stream broken), hangs
past its deadline, or drains and cuts the stream, it opens a new stream on the same channel (round robin with
health checking sends it to a healthy replica), sends the log again, discards the answers the session already
took (checking that the last of them is byte for byte what the first replica gave: a determinism guard), and hands
on the answers still owed. The caller sees a slower answer, never an error:

    stream = ReplayStream(channel, "Stream", FailoverPolicy())  # what Channel.stream returns
    opened = stream.call(open_message)                        # answer 0
    pending = stream.send(step_message)                       # logged, then sent
    reply = pending.result()                                  # after a failover if the replica died meanwhile

Snapshots bound the replay: every `snapshot_frames` steps the stream also sends a snapshot request (answered in
order by the session's state, protos/voicechat/v1/snapshot.proto; never handed to the caller), keeps the latest
snapshot and drops the log before it. A failover then opens the new stream with the opening message marked
`restore` followed by the snapshot's parts, and replays only the steps since: the pause no longer grows with the
session's age, and the log never passes the interval. The new replica's answer to the restoring open must equal
the first one's (the guard's other half).

Each request after the first names the snapshot the stream holds as its base, and the service answers with a
delta (the attention keys written since, the fixed-size states whole), which the stream merges into the state it
holds (`snapshot.Held`): what crosses each interval is bounded by the interval, not by the session's age. A delta
that does not apply (its base unknown) is dropped, the log kept, and the next request asks for a whole snapshot;
after a failover the next one is whole too (the new replica knows only the state it restored).

Memory: the log holds each request as sent (its serialized size, per 80 ms frame, on the full model: perception
5137 B (1280 float32 samples), language about 17.9 KB (a 4480-float32 audio embedding), speech about 8 B, codec
139 B; about 23 KB a frame in all, 17 MB a minute), at most one interval of it; a snapshot holds the session's
state (docs/operations.md gives its size per network). Without snapshots, past `max_history_frames` steps (7500,
600 s, by default) a stream drops its log: the session goes on, but a later failure of its replica ends it with an
error saying so.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from orchestrator.clients import BidiStream, Channel, ServiceError
from orchestrator.pending import Pending
from protos.voicechat.v1 import snapshot_pb2
from services.common.snapshot import Held

log = logging.getLogger(__name__)

# The failures another replica can recover from: the replica went away, hung, or cut the stream. A refused or
# failed request (INVALID_ARGUMENT, INTERNAL, ...) would fail the same way anywhere.
RECOVERABLE = (None, "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED")
DEFAULT_HISTORY_FRAMES = 7500  # 600 s of 80 ms frames: the conversation service's default stream length
# Off by default: on the full model a session's state is about 146 MB on the language model (its Mamba states) and
# 516 KB a frame of age on the speech model (its attention caches: 0.5 GB at one minute, 3.9 GB at ten), which the
# orchestrator would hold, and receive each interval the fixed-size states and the keys written since (160 MB plus
# 549 KB a frame; `python -m tools.snapshot_cost`, docs/operations.md)
DEFAULT_SNAPSHOT_FRAMES = 0


@dataclass(frozen=True)
class FailoverPolicy:
    """How a session's stream moves to another replica. `attempts`: replays tried for one failure (a replay that
    lands on a replica that fails too counts one); `max_history_frames`: steps kept for replay (see the module);
    `snapshot_frames`: steps between snapshots of the session's state (0: none, the whole log is replayed)."""

    attempts: int = 3
    max_history_frames: int = DEFAULT_HISTORY_FRAMES
    snapshot_frames: int = DEFAULT_SNAPSHOT_FRAMES

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.max_history_frames < 0:
            raise ValueError(f"failover attempts must be >= 1 and max_history_frames >= 0, got {self}")
        if not 0 <= self.snapshot_frames <= self.max_history_frames:
            raise ValueError(f"snapshot_frames must be 0 (no snapshots) or up to max_history_frames "
                             f"({self.max_history_frames}): the log kept between snapshots, got {self.snapshot_frames}")

    @classmethod
    def every(cls, seconds: float, frame_s: float = 0.08) -> FailoverPolicy:
        """A snapshot every `seconds` of conversation (0: never), e.g. from `--snapshot-seconds`."""
        if not 0 <= seconds <= DEFAULT_HISTORY_FRAMES * frame_s:
            raise ValueError(f"--snapshot-seconds {seconds:g}: must be 0 (never) up to "
                             f"{DEFAULT_HISTORY_FRAMES * frame_s:g}, the history kept for failover")
        return cls(snapshot_frames=max(1, round(seconds / frame_s)) if seconds else 0)

    def uncovered(self, seconds: float, frame_s: float = 0.08) -> str | None:
        """A warning when conversations of up to `seconds` would outlive the log kept for failover (no snapshots
        and more than `max_history_frames` frames), else None."""
        horizon = self.max_history_frames * frame_s
        if self.snapshot_frames or seconds <= horizon:
            return None
        return (f"conversations may run {seconds:g} s, but without snapshots a conversation keeps what it sent "
                f"for failover for its first {horizon:g} s only: past that, its replica's failure ends it. Pass "
                "--snapshot-seconds S (e.g. 10) to keep every conversation movable to another replica")


DEFAULT_FAILOVER = FailoverPolicy()


def recoverable(exc: ServiceError) -> bool:
    return exc.code in RECOVERABLE


class ReplayStream:
    """A BidiStream (same `call`/`send`/`close`) that fails over to another replica of its channel.

    Requests and answers stay paired in order across a failover: requests sent while one is under way are logged
    and go to the new replica after the replayed ones. `failovers` counts the moves, `snapshots` the snapshots
    taken (`deltas` of them deltas), `replayed` the steps the last move ran again to rebuild the session (those
    answered before it: since the snapshot it restored, or since the open); `history_bytes` is the opening
    message's and the log's serialized size, `snapshot_bytes` the held snapshot's arrays and texts, `received_bytes`
    the serialized size of the last snapshot received (a delta: what an interval costs).
    """

    def __init__(self, channel: Channel, method: str, policy: FailoverPolicy):
        self.channel, self.method, self.policy = channel, method, policy
        self._stream = BidiStream(channel, method)
        self._open = None  # the opening message (a restore sends it again, marked `restore`)
        self._opened: bytes | None = None  # the digest of its answer, which a restore's must equal
        self._log: list | None = []  # the steps from caller request `_base` on; None once past the cap
        self._base = 1  # the caller's request index of _log[0] (0 is the opening message)
        self._sent = 0  # caller requests sent
        self._snapshot: Held | None = None  # the latest, taken at request `_base`, deltas merged
        self._builds_on = 0  # the snapshot the next request names as its base (0: ask for a whole one)
        self._asked: deque[int] = deque()  # snapshot requests on this stream: the caller requests sent before each
        self._taken = 0  # answers handed to the caller
        self._last = None  # the last of them (the replay's determinism guard)
        self._send_lock = threading.Lock()  # the log and the stream it goes to change together
        self._take_lock = threading.Lock()  # one taker of answers at a time (and the failover runs under it)
        self._closed = False
        self.failovers = self.snapshots = self.deltas = self.replayed = 0
        self.history_bytes = self.snapshot_bytes = self.received_bytes = 0

    def call(self, message):
        return self.send(message).result()

    def send(self, message) -> Pending:
        """Log and send one request; its answer comes from the returned Pending, after earlier requests'."""
        with self._send_lock:
            self._record(message)
            try:
                self._stream.send(message)
                if self._snapshot_due():
                    self._stream.send(type(message)(snapshot=snapshot_pb2.SnapshotRequest(base=self._builds_on)))
                    self._asked.append(self._sent)
            except ServiceError:
                if self._log is None:
                    raise
                # the stream broke before this request: the taker's failover replays it with the rest
        return Pending(self._receive)

    def _snapshot_due(self) -> bool:
        every = self.policy.snapshot_frames
        return bool(every) and self._log is not None and not self._asked and self._sent - self._base >= every

    def _record(self, message) -> None:
        self._sent += 1
        if self._open is None:
            self._open = message
            self.history_bytes += message.ByteSize()
            return
        if self._log is None:
            return
        if len(self._log) >= self.policy.max_history_frames:
            log.warning("the %s session passed %d frames: its log is dropped, and it can no longer move to another "
                        "replica", self.channel.name, self.policy.max_history_frames)
            self._log, self._snapshot, self.history_bytes, self.snapshot_bytes = None, None, 0, 0
            return
        self._log.append(message)
        self.history_bytes += message.ByteSize()

    def _receive(self):
        with self._take_lock:
            while True:
                try:
                    if self._asked and self._asked[0] == self._taken:  # a snapshot's parts come first
                        self._keep_snapshot(self._asked[0])
                        continue
                    reply = self._stream.receive()
                except ServiceError as exc:
                    if self._closed or not recoverable(exc):
                        raise
                    self._fail_over(exc)
                    continue
                if self._taken == 0:
                    self._opened = _digest(reply)
                self._taken += 1
                self._last = reply  # kept as is: serialized only if a failover compares it
                return reply

    def _keep_snapshot(self, at: int) -> None:
        """Take the parts of the snapshot asked for after `at` caller requests; merge it into the held one (a
        whole one replaces it) and drop the log before. A delta that does not apply leaves both as they were."""
        parts = []
        while not parts or not parts[-1].last:
            reply = self._stream.receive()
            if reply.WhichOneof("payload") != "snapshot":
                raise ServiceError(f"the {self.channel.name} service answered a snapshot request with "
                                   f"{reply.WhichOneof('payload')}: it does not take snapshots (update it, or run the "
                                   "orchestrator with --snapshot-seconds 0)", "UNIMPLEMENTED")
            parts.append(reply.snapshot)
        # only this thread (the taker's) changes or reads the held state, off the lock the senders take
        held = self._snapshot if self._snapshot is not None and parts[0].base else Held()
        try:
            taken = held.apply(parts)
        except ValueError as exc:
            log.warning("the %s session's snapshot could not be merged (%s): the next one is asked whole",
                        self.channel.name, exc)
            taken = False
        with self._send_lock:
            # asked until now: a sender meanwhile must not ask the next one against the base this one replaces
            self._asked.popleft()
            if not taken:
                self._builds_on = 0
                return
            if self._log is None:
                return
            dropped, self._log = self._log[: at - self._base], self._log[at - self._base :]
            self.history_bytes -= sum(message.ByteSize() for message in dropped)
            self._snapshot, self._base, self._builds_on = held, at, held.id
            self.snapshot_bytes = held.nbytes
            self.received_bytes = sum(part.ByteSize() for part in parts)
            self.snapshots += 1
            self.deltas += bool(parts[0].base)

    def _fail_over(self, failure: ServiceError) -> None:
        """Restore or replay on a new stream until one replica takes the session, or raise a ServiceError."""
        name = self.channel.name
        if self._log is None:
            raise ServiceError(f"{failure}; the session had passed {self.policy.max_history_frames} frames, the "
                               "history kept for failover, so it could not move to another replica",
                               failure.code) from failure
        last = failure
        for attempt in range(1, self.policy.attempts + 1):
            stream = self._replay()
            try:
                self._discard_answered(stream)
            except ServiceError as exc:
                if not (recoverable(exc) or exc.code == "RESOURCE_EXHAUSTED"):  # full: the next pick may not be
                    raise
                last = exc
                continue
            self.failovers += 1
            self.replayed = max(self._taken - self._base, 0)
            log.warning("the %s session moved to another replica (attempt %d, %s, %d steps run again) after: %s",
                        name, attempt, "restored from a snapshot" if self._snapshot else "no snapshot",
                        self.replayed, failure)
            return
        raise ServiceError(f"{failure}; no healthy {name} replica took the session over in {self.policy.attempts} "
                           f"attempts (last: {last}). Start more {name} replicas (--replicas {name}=N)",
                           last.code) from failure

    def _replay(self) -> BidiStream:
        """A new stream (round robin picks a healthy replica) sent the opening message (with the snapshot to
        restore, when there is one) and the log; the old one closed."""
        with self._send_lock:
            if self._closed:
                raise ServiceError(f"the {self.channel.name} session was closed during its failover", "CANCELLED")
            # every answer, the opening one too, within the frame deadline: a replica that hangs as well is
            # left in seconds for the next attempt, when the channel's keepalive has taken it out of the rotation
            old, self._stream = self._stream, BidiStream(self.channel, self.method, warm=True)
            self._asked.clear()  # the snapshots asked of the old stream are lost with it
            self._builds_on = 0  # and the new replica knows no snapshot of the session to build on
            for message in self._opening():
                self._stream.send(message)
            for message in self._log:
                self._stream.send(message)
        old.close()
        return self._stream

    def _opening(self) -> Iterator:
        """The opening message, or with a snapshot: it marked `restore`, then the held state's parts (each made as
        the one before goes, so a large state is never all messages at once)."""
        if self._snapshot is None:
            yield self._open
            return
        opening = type(self._open)()
        opening.CopyFrom(self._open)
        opening.open.restore = True
        yield opening

        def request() -> tuple:
            message = type(self._open)()
            return message, message.restore

        yield from self._snapshot.parts(into=request)

    def _discard_answered(self, stream: BidiStream) -> None:
        """Take the answers the caller already has from the new stream: its open's, which must equal the first
        one's, and the replayed steps' up to the last taken, which must equal the one the caller got."""
        if self._taken == 0:
            return
        opened = stream.receive()
        if _digest(opened) != self._opened:
            self._differs(0)
        reply = None
        for _ in range(self._taken - self._base):
            reply = stream.receive()
        if reply is not None and reply.SerializeToString() != self._last.SerializeToString():
            self._differs(self._taken - 1)

    def _differs(self, request: int) -> None:
        raise ServiceError(f"the {self.channel.name} replica that took the session over answered request {request} "
                           "differently from the one that failed: the replicas do not run the same checkpoint and "
                           "flags, so the session cannot continue", "DATA_LOSS")

    def close(self) -> None:
        with self._send_lock:
            self._closed = True
            self._log, self._snapshot, self.history_bytes, self.snapshot_bytes = None, None, 0, 0
            self._stream.close()


def _digest(reply) -> bytes:
    return hashlib.sha256(reply.SerializeToString()).digest()
