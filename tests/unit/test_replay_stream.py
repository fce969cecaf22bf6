"""ReplayStream against scripted replicas: what is replayed, what the caller gets, and each way a failover ends."""

from __future__ import annotations

import pytest

from orchestrator import failover
from orchestrator.clients import Deadlines, ServiceError
from orchestrator.failover import FailoverPolicy, ReplayStream
from orchestrator.pending import Pending
from protos.voicechat.v1 import speech_pb2


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
    with pytest.raises(ServiceError, match="answered request 1 differently") as raised:
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
    stream = ReplayStream(Channel(), "Stream", FailoverPolicy(max_history_frames=2))
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
