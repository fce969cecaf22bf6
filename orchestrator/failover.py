"""Failover: a session's stream to one network that survives its replica, by replaying what the network received.

Every answer a network gives a session is a deterministic function of the requests the session sent it (the
stream's opening message, then every step: audio, text ids, codes, seeds, forced ids, all inside the messages).
A ReplayStream keeps those whole request messages; when its replica dies (UNAVAILABLE, the stream broken), hangs
past its deadline, or drains and cuts the stream, it opens a new stream on the same channel (round robin with
health checking sends it to a healthy replica), sends the whole log again, discards the answers the session already
took (checking that the last of them is byte for byte what the first replica gave: a determinism guard), and hands
on the answers still owed. The caller sees a slower answer, never an error:

    stream = ReplayStream(channel, "Stream", FailoverPolicy())  # what Channel.stream returns
    opened = stream.call(open_message)                        # answer 0
    pending = stream.send(step_message)                       # logged, then sent
    reply = pending.result()                                  # after a failover if the replica died meanwhile

Memory: the log holds each request as sent (its serialized size, per 80 ms frame, on the full model: perception
5137 B (1280 float32 samples), language about 17.9 KB (a 4480-float32 audio embedding), speech about 8 B, codec
139 B; about 23 KB a frame in all, 17 MB a minute). Past `max_history_frames` steps (7500, 600 s, by default) a
stream drops its log: the session goes on, but a later failure of its replica ends it with an error saying so.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from orchestrator.clients import BidiStream, Channel, ServiceError
from orchestrator.pending import Pending

log = logging.getLogger(__name__)

# The failures another replica can recover from: the replica went away, hung, or cut the stream. A refused or
# failed request (INVALID_ARGUMENT, INTERNAL, ...) would fail the same way anywhere.
RECOVERABLE = (None, "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED")
DEFAULT_HISTORY_FRAMES = 7500  # 600 s of 80 ms frames: the conversation service's default stream length


@dataclass(frozen=True)
class FailoverPolicy:
    """How a session's stream moves to another replica. `attempts`: replays tried for one failure (a replay that
    lands on a replica that fails too counts one); `max_history_frames`: steps kept for replay (see the module)."""

    attempts: int = 3
    max_history_frames: int = DEFAULT_HISTORY_FRAMES

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.max_history_frames < 0:
            raise ValueError(f"failover attempts must be >= 1 and max_history_frames >= 0, got {self}")


DEFAULT_FAILOVER = FailoverPolicy()


def recoverable(exc: ServiceError) -> bool:
    return exc.code in RECOVERABLE


class ReplayStream:
    """A BidiStream (same `call`/`send`/`close`) that fails over to another replica of its channel.

    Requests and answers stay paired in order across a failover: requests sent while one is under way are logged
    and go to the new replica after the replayed ones. `failovers` counts the moves; `history_bytes` is the log's
    serialized size.
    """

    def __init__(self, channel: Channel, method: str, policy: FailoverPolicy):
        self.channel, self.method, self.policy = channel, method, policy
        self._stream = BidiStream(channel, method)
        self._log: list | None = []  # every request of the session in order; None once past the cap
        self._taken = 0  # answers handed to the caller
        self._last = None  # the last of them (the replay's determinism guard)
        self._send_lock = threading.Lock()  # the log and the stream it goes to change together
        self._take_lock = threading.Lock()  # one taker of answers at a time (and the failover runs under it)
        self._closed = False
        self.failovers = 0
        self.history_bytes = 0

    def call(self, message):
        return self.send(message).result()

    def send(self, message) -> Pending:
        """Log and send one request; its answer comes from the returned Pending, after earlier requests'."""
        with self._send_lock:
            self._record(message)
            try:
                self._stream.send(message)
            except ServiceError:
                if self._log is None:
                    raise
                # the stream broke before this request: the taker's failover replays it with the rest
        return Pending(self._receive)

    def _record(self, message) -> None:
        if self._log is None:
            return
        if len(self._log) > self.policy.max_history_frames:  # the opening message plus max_history_frames steps
            log.warning("the %s session passed %d frames: its log is dropped, and it can no longer move to another "
                        "replica", self.channel.name, self.policy.max_history_frames)
            self._log, self.history_bytes = None, 0
            return
        self._log.append(message)
        self.history_bytes += message.ByteSize()

    def _receive(self):
        with self._take_lock:
            while True:
                try:
                    reply = self._stream.receive()
                except ServiceError as exc:
                    if self._closed or not recoverable(exc):
                        raise
                    self._fail_over(exc)
                    continue
                self._taken += 1
                self._last = reply  # kept as is: serialized only if a failover compares it
                return reply

    def _fail_over(self, failure: ServiceError) -> None:
        """Replay the log on a new stream until one replica takes the session, or raise a ServiceError."""
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
            log.warning("the %s session moved to another replica (attempt %d) after: %s", name, attempt, failure)
            return
        raise ServiceError(f"{failure}; no healthy {name} replica took the session over in {self.policy.attempts} "
                           f"attempts (last: {last}). Start more {name} replicas (--replicas {name}=N)",
                           last.code) from failure

    def _replay(self) -> BidiStream:
        """A new stream (round robin picks a healthy replica) sent the whole log; the old one closed."""
        with self._send_lock:
            if self._closed:
                raise ServiceError(f"the {self.channel.name} session was closed during its failover", "CANCELLED")
            # every answer, the opening one too, within the frame deadline: a replica that hangs as well is
            # left in seconds for the next attempt, when the channel's keepalive has taken it out of the rotation
            old, self._stream = self._stream, BidiStream(self.channel, self.method, warm=True)
            for message in self._log:
                self._stream.send(message)
        old.close()
        return self._stream

    def _discard_answered(self, stream: BidiStream) -> None:
        """Take the answers the caller already has from the replay; the last must equal the one it got."""
        reply = None
        for _ in range(self._taken):
            reply = stream.receive()
        if reply is not None and reply.SerializeToString() != self._last.SerializeToString():
            raise ServiceError(f"the {self.channel.name} replica that took the session over answered request "
                               f"{self._taken - 1} differently from the one that failed: the replicas do not run the "
                               "same checkpoint and flags, so the session cannot continue", "DATA_LOSS")

    def close(self) -> None:
        with self._send_lock:
            self._closed = True
            self._log, self.history_bytes = None, 0
            self._stream.close()
