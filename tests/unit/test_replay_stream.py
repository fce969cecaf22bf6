"""ReplayStream against scripted replicas: what is replayed, what the caller gets, and each way a failover ends."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator import failover
from orchestrator.clients import Deadlines, ServiceError
from orchestrator.failover import FailoverPolicy, ReplayStream
from orchestrator.pending import Pending
from protos.voicechat.v1 import snapshot_pb2, speech_pb2
from services.common.snapshot import Snapshot
from services.common.tensors import to_proto_np


def request(i: int) -> speech_pb2.SpeechStreamRequest:
    return speech_pb2.SpeechStreamRequest(step=speech_pb2.SpeechStep(frame_index=i, text_token_id=100 + i))


def answer(i: int, shift: int = 0) -> speech_pb2.SpeechStreamResponse:
    return speech_pb2.SpeechStreamResponse(step=speech_pb2.SpeechStepResult(frame_index=i + shift))


class Replica:
    """A scripted stream: answers request i with answer(i, shift) until it has answered `dies_after` (then every
    receive raises `error`)."""

    def __init__(self, dies_after: int | None = None, error: ServiceError | None = None, shift: int = 0):
        self.dies_after, self.shift = dies_after, shift
        self.error = error or ServiceError("the tts service at x stopped responding (UNAVAILABLE: gone)", "UNAVAILABLE")
        self.received: list[int] = []
        self.answered = 0
        self.closed = False

    def send(self, message) -> Pending:
        self.received.append(message.step.frame_index)
        return Pending(self.receive)

    def receive(self):
        if self.dies_after is not None and self.answered >= self.dies_after:
            raise self.error
        self.answered += 1
        return answer(self.received[self.answered - 1], self.shift)

    def close(self) -> None:
        self.closed = True


class Channel:
    name, address, deadlines = "tts", "ipv4:a,b", Deadlines()


@pytest.fixture
def replicas(monkeypatch):
    """The replicas the next streams land on, in order (what round robin would pick)."""
    queue: list[Replica] = []
    monkeypatch.setattr(failover, "BidiStream", lambda channel, method, warm=False: queue.pop(0))
    return queue


def test_a_failover_replays_everything_sent_and_hands_on_only_the_answers_still_owed(replicas):
    first, second = Replica(dies_after=3), Replica()
    replicas += [first, second]
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy())
    taken = [stream.call(request(0)).step.frame_index]
    taken += [stream.send(request(i)).result().step.frame_index for i in (1, 2)]
    in_flight = [stream.send(request(i)) for i in (3, 4)]  # sent to the first replica, which dies before answering
    taken += [p.result().step.frame_index for p in in_flight]
    taken.append(stream.call(request(5)).step.frame_index)
    assert taken == [0, 1, 2, 3, 4, 5]
    assert first.received == [0, 1, 2, 3, 4] and first.closed
    assert second.received == [0, 1, 2, 3, 4, 5]  # the whole log, then the new request
    assert stream.failovers == 1
    assert stream.history_bytes == sum(request(i).ByteSize() for i in range(6))


def test_a_replica_that_answers_differently_stops_the_session(replicas):
    replicas += [Replica(dies_after=2), Replica(shift=1)]
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy())
    for i in range(2):
        stream.call(request(i))
    with pytest.raises(ServiceError, match="answered request 0 differently") as raised:  # the open's answer
        stream.call(request(2))
    assert raised.value.code == "DATA_LOSS"


def test_a_refused_request_is_not_replayed(replicas):
    refused = ServiceError("the tts service at x failed: INVALID_ARGUMENT: bad id", "INVALID_ARGUMENT")
    replicas += [Replica(dies_after=1, error=refused)]
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy())
    stream.call(request(0))
    with pytest.raises(ServiceError, match="bad id"):
        stream.call(request(1))
    assert stream.failovers == 0 and not replicas


def test_the_attempts_are_bounded_and_the_error_names_the_service(replicas):
    replicas += [Replica(dies_after=1), Replica(dies_after=0), Replica(dies_after=0)]
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy(attempts=2))
    stream.call(request(0))
    with pytest.raises(ServiceError, match=r"stopped responding .*; no healthy tts replica took the session over in "
                                           r"2 attempts .*--replicas tts=N"):
        stream.call(request(1))
    assert len(replicas) == 0


def test_past_the_history_cap_the_log_is_dropped_and_a_failure_says_why(replicas):
    replicas += [Replica(dies_after=4), Replica()]
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy(max_history_frames=2, snapshot_frames=0))
    for i in range(3):  # the opening message and two steps: still replayable
        stream.call(request(i))
    assert stream.history_bytes > 0
    stream.call(request(3))  # a third step passes the cap
    assert stream.history_bytes == 0
    with pytest.raises(ServiceError, match="had passed 2 frames, the history kept for failover"):
        stream.call(request(4))
    assert len(replicas) == 1  # no replay was tried


def test_a_full_replica_during_the_replay_leaves_it_to_the_next_attempt(replicas):
    full = ServiceError("the tts service at x failed: RESOURCE_EXHAUSTED: 64 sessions open", "RESOURCE_EXHAUSTED")
    replicas += [Replica(dies_after=2), Replica(dies_after=0, error=full), Replica()]
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy())
    assert [stream.call(request(i)).step.frame_index for i in range(4)] == [0, 1, 2, 3]
    assert stream.failovers == 1 and not replicas


# ---- snapshots ------------------------------------------------------------------------------------------------


def opening() -> speech_pb2.SpeechStreamRequest:
    return speech_pb2.SpeechStreamRequest(open=speech_pb2.SpeechOpen(seed=5))


class Session:
    """A scripted replica holding real state: each step's answer is the sum of every text id so far (so only a
    session restored whole answers right); snapshot requests are answered by `parts` parts of that state."""

    def __init__(self, dies_after: int | None = None, parts: int = 2):
        self.dies_after, self.parts = dies_after, parts
        self.seen: list[int] = []
        self.received: list[str] = []  # each request's kind: open, open+restore, restore, snapshot, step N
        self.answers: list = []
        self.restoring: list[int] | None = None
        self.closed = False

    def send(self, message) -> Pending:
        kind = message.WhichOneof("payload")
        if kind == "open":
            self.received.append("open+restore" if message.open.restore else "open")
            if message.open.restore:
                self.restoring = []
            else:
                self.answers.append(speech_pb2.SpeechStreamResponse(opened=speech_pb2.SpeechOpened(prompt_frames=3)))
        elif kind == "restore":
            self.received.append("restore")
            self.restoring += [int(e.text) for e in message.restore.entries]
            if message.restore.last:
                self.seen, self.restoring = self.restoring, None
                self.answers.append(speech_pb2.SpeechStreamResponse(opened=speech_pb2.SpeechOpened(prompt_frames=3)))
        elif kind == "snapshot":
            self.received.append("snapshot")
            chunks = [self.seen[i :: self.parts] for i in range(self.parts)]  # any split: the order is the test's
            for i, chunk in enumerate(chunks):
                part = snapshot_pb2.SnapshotPart(last=i == self.parts - 1, entries=[
                    snapshot_pb2.SnapshotEntry(name=f"{i}.{n}", text=str(v)) for n, v in enumerate(chunk)])
                self.answers.append(speech_pb2.SpeechStreamResponse(snapshot=part))
            self.seen = [v for chunk in chunks for v in chunk]  # what a restore of these parts holds
        else:
            self.received.append(f"step {message.step.frame_index}")
            self.seen.append(message.step.text_token_id)
            self.answers.append(speech_pb2.SpeechStreamResponse(
                step=speech_pb2.SpeechStepResult(frame_index=sum(self.seen))))
        return Pending(self.receive)

    def receive(self):
        if self.dies_after is not None and self.dies_after <= 0:
            raise ServiceError("the tts service at x stopped responding (UNAVAILABLE: gone)", "UNAVAILABLE")
        if self.dies_after is not None:
            self.dies_after -= 1
        return self.answers.pop(0)

    def close(self) -> None:
        self.closed = True


def converse(stream, steps: range) -> list[int]:
    """The step answers the caller gets (the open's answer taken first when `steps` starts at 1)."""
    if steps.start == 1:
        assert stream.call(opening()).WhichOneof("payload") == "opened"
    return [stream.send(request(i)).result().step.frame_index for i in steps]


def uninterrupted(steps: int) -> list[int]:
    return [sum(100 + i for i in range(1, k + 1)) for k in range(1, steps + 1)]


def test_every_interval_a_snapshot_is_kept_and_the_log_before_it_dropped(replicas):
    replica = Session()
    replicas.append(replica)
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy(snapshot_frames=3))
    assert converse(stream, range(1, 11)) == uninterrupted(10)  # no snapshot part reaches the caller
    steps = [f"step {i}" for i in range(1, 11)]
    assert replica.received == ["open", *steps[:3], "snapshot", *steps[3:6], "snapshot", *steps[6:9], "snapshot",
                                steps[9]]
    assert stream.snapshots == 3 and stream.snapshot_bytes > 0
    assert stream.history_bytes == opening().ByteSize() + request(10).ByteSize()  # the log since the last snapshot


def test_a_failover_restores_the_snapshot_and_replays_only_the_steps_since(replicas):
    first, second = Session(dies_after=1 + 7 + 2 * 2), Session()  # the open, 7 steps and two snapshots answered
    replicas += [first, second]
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy(snapshot_frames=3))
    taken = converse(stream, range(1, 8))
    in_flight = [stream.send(request(i)) for i in (8, 9)]  # sent to the first replica, which dies unanswered
    taken += [p.result().step.frame_index for p in in_flight] + converse(stream, range(10, 12))
    assert taken == uninterrupted(11) and stream.failovers == 1
    # the snapshot after step 6, then steps 7 (answered already: discarded, the guard's check), 8 and 9; then
    # the new steps, the snapshot the first replica was asked for after step 9 (lost with it) asked again
    # (the snapshot held as one state, sent whole again: its values fit one part)
    assert second.received == ["open+restore", "restore", "step 7", "step 8", "step 9", "step 10", "snapshot",
                               "step 11"]
    assert stream.snapshots == 3


def test_a_failure_before_a_snapshot_answer_came_restores_the_one_before(replicas):
    first, second = Session(dies_after=1 + 3 + 2 + 3), Session()  # dies before the second snapshot's parts
    replicas += [first, second]
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy(snapshot_frames=3))
    assert converse(stream, range(1, 10)) == uninterrupted(9)
    # the snapshot after step 3 restored, the steps since replayed; the lost one asked again with the next step
    assert second.received == ["open+restore", "restore", "step 4", "step 5", "step 6", "step 7", "step 8",
                               "snapshot", "step 9"]
    assert stream.snapshots == 2


def test_a_restoring_replica_that_opens_differently_stops_the_session(replicas):
    class Other(Session):
        def send(self, message):
            pending = super().send(message)
            if self.answers and self.answers[-1].WhichOneof("payload") == "opened":
                self.answers[-1].opened.prompt_frames = 4
            return pending

    replicas += [Session(dies_after=1 + 4 + 2), Other()]
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy(snapshot_frames=3))
    with pytest.raises(ServiceError, match="answered request 0 differently") as raised:
        converse(stream, range(1, 6))
    assert raised.value.code == "DATA_LOSS"


def test_the_snapshot_interval_must_fit_in_the_history_kept():
    with pytest.raises(ValueError, match="snapshot_frames must be 0 .* up to max_history_frames"):
        FailoverPolicy(max_history_frames=10, snapshot_frames=11)
    assert FailoverPolicy.every(30).snapshot_frames == 375 and FailoverPolicy.every(0).snapshot_frames == 0
    with pytest.raises(ValueError, match="--snapshot-seconds -1: must be 0"):
        FailoverPolicy.every(-1)


# ---- deltas ---------------------------------------------------------------------------------------------------


class Growing(Session):
    """A scripted replica whose state grows: the text ids so far as one int64 array "seen". A snapshot asked against
    the last one it gave (and still known: `forget` makes it unknown) is a delta, the ids since as a slice."""

    def __init__(self, dies_after: int | None = None, refuse_base: bool = False):
        super().__init__(dies_after)
        self.refuse_base = refuse_base  # answer a delta against a base the client never got
        self.given: tuple[int, int] = (0, 0)  # the last snapshot's id and how many ids it held
        self.bases: list[int] = []  # each snapshot request's base

    def send(self, message) -> Pending:
        kind = message.WhichOneof("payload")
        if kind == "restore":
            self.received.append("restore")
            snapshot = Snapshot.from_parts([message.restore])  # a restore is whole: a delta here is a ValueError
            self.seen = snapshot.ints("seen")
            self.answers.append(speech_pb2.SpeechStreamResponse(opened=speech_pb2.SpeechOpened(prompt_frames=3)))
            return Pending(self.receive)
        if kind != "snapshot":
            return super().send(message)
        self.received.append("snapshot")
        base = message.snapshot.base
        self.bases.append(base)
        known, count = self.given
        new_id = 1000 + len(self.bases)
        entry = snapshot_pb2.SnapshotEntry(name="seen")
        if base and (base == known or self.refuse_base):
            entry.tensor.CopyFrom(to_proto_np(np.asarray(self.seen[count:], np.int64)))
            entry.slice.CopyFrom(snapshot_pb2.SnapshotSlice(axis=0, start=count, length=len(self.seen)))
            base = base if not self.refuse_base else 999
        else:
            entry.tensor.CopyFrom(to_proto_np(np.asarray(self.seen, np.int64)))
            base = 0
        counter = snapshot_pb2.SnapshotEntry(name="steps", tensor=to_proto_np(np.asarray(len(self.seen), np.int64)))
        part = snapshot_pb2.SnapshotPart(entries=[entry, counter], last=True, id=new_id, base=base)
        self.answers.append(speech_pb2.SpeechStreamResponse(snapshot=part))
        self.given = (new_id, len(self.seen))
        return Pending(self.receive)


def test_after_the_first_snapshot_each_is_a_delta_merged_into_the_held_state(replicas):
    first, second = Growing(dies_after=1 + 10 + 3), Growing()  # the open, 10 steps and three snapshots answered
    replicas += [first, second]
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy(snapshot_frames=3))
    assert converse(stream, range(1, 11)) == uninterrupted(10)
    assert first.bases == [0, 1001, 1002] and (stream.snapshots, stream.deltas) == (3, 2)
    # the held state: nine ids and the step counter, int64; the last delta carried the three ids since (and its
    # framing), less than the state it completed
    assert stream.snapshot_bytes == 9 * 8 + 8 and 3 * 8 < stream.received_bytes < stream.snapshot_bytes
    taken = [stream.send(request(i)).result().step.frame_index for i in (11, 12)]  # the first replica died
    assert taken == uninterrupted(12)[10:] and stream.failovers == 1
    # the merged state restored (whole), step 10 run again, then the new steps, the next snapshot asked whole
    assert second.received == ["open+restore", "restore", "step 10", "step 11", "step 12", "snapshot"]
    assert second.bases == [0]  # the new replica knows no snapshot of the session


def test_a_delta_against_another_base_is_dropped_and_the_next_asked_whole(replicas):
    replica = Growing(refuse_base=True)
    replicas.append(replica)
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy(snapshot_frames=3))
    assert converse(stream, range(1, 11)) == uninterrupted(10)
    # whole, then a delta against base 999 (refused: the log since the first kept), then whole again
    assert replica.bases == [0, 1001, 0] and (stream.snapshots, stream.deltas) == (2, 0)



def test_no_snapshot_is_asked_while_the_last_one_is_still_being_taken(replicas):
    """A stage sends its next steps while the taker is still reading the last snapshot's parts: no snapshot may be
    asked then, against the base the one coming in is about to replace (it would come back whole)."""

    class Busy(Growing):
        meanwhile = None  # run once, in the middle of the first snapshot's parts

        def receive(self):
            reply = super().receive()
            if reply.WhichOneof("payload") == "snapshot" and self.meanwhile is not None:
                run, self.meanwhile = self.meanwhile, None
                run()
            return reply

    replica = Busy()
    replicas.append(replica)
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy(snapshot_frames=3))
    assert stream.call(opening()).WhichOneof("payload") == "opened"
    # the third step is followed by the first snapshot request, so the fourth's answer comes after its parts
    sent = [stream.send(request(i)) for i in (1, 2, 3, 4)]
    replica.meanwhile = lambda: sent.extend(stream.send(request(i)) for i in (5, 6, 7))
    taken = [p.result().step.frame_index for p in sent[:4]]  # the fourth's taker reads the parts: 5-7 go out
    taken += [p.result().step.frame_index for p in sent[4:]]
    taken += [stream.send(request(i)).result().step.frame_index for i in (8, 9, 10)]
    assert len(sent) == 7 and taken == uninterrupted(10)
    assert replica.bases == [0, 1001] and (stream.snapshots, stream.deltas) == (2, 1)
