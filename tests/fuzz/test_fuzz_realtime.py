"""Fuzz the `/v1/realtime` WebSocket (docs/protocol.md) over the four network services running as real processes.

An example is one connection: session.created, then a few messages of one scenario (SCENARIOS): random JSON values,
objects with valid or random `type`s and random payloads, invalid base64 audio, binary frames, deeply nested and
oversized messages before or after a valid session.update; session.updates with broken fields; appends with valid
or broken audio and rates; commits. After each message the client sends
`session.ping`, so the pong marks where that message's answer ends. Each answer is checked against the protocol:
a bad message gets its `error` event (the code the protocol names), a good one its normal events; only a commit,
a cancel and an oversized message end the connection (1000, 1000, 1009). After each example the session slot is
free again, every service process has closed the session's stream (its open-session count, from its /metrics, is
back to 0) and every server still serves; at the end a fresh session answers exactly as the first one did.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.fuzz.harness import DEADLINE_S, REALTIME_LIMITS, fuzz, reference_answers, wait_until
from tests.realtime.fakes import VARYING_FIELDS

PING = json.dumps({"type": "session.ping"})
CLIENT_TYPES = ["session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "session.cancel",
                "response.cancel", "session.ping"]
FRAME_EVENTS = {"conversation.item.input_audio_transcription.delta", "response.text.delta",
                "response.function.delta", "response.audio.delta"}
SERVER_EVENTS = FRAME_EVENTS | {"session.created", "session.updated", "input_audio_buffer.committed",
                                "response.done", "response.cancelled", "session.pong", "error"}
ERROR_CODES = {"invalid_request", "server_busy", "session_initialization_failed", "inference_error"}
EVENT_ID = re.compile(r"^event_[0-9a-f]{16}$")
MAX_BYTES = REALTIME_LIMITS.max_message_bytes
OUT_SAMPLES = 1764

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=16),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8)


def pcm16(samples: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return base64.b64encode(rng.integers(-(2**15), 2**15, samples, dtype=np.int16).astype("<i2").tobytes()).decode()


def valid_session() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"seed": st.integers(0, 2**32)},
                                 optional={"system_prompt": st.sampled_from(["", "Be brief."]),
                                           "max_streaming_seconds": st.sampled_from([0.5, 1.0, 600.0]),
                                           "model": st.text(max_size=8)})


def sessions() -> st.SearchStrategy:
    """session.update's `session`: valid, valid fields with random values, or any JSON value."""
    keys = st.sampled_from(["seed", "system_prompt", "max_streaming_seconds", "model"])
    field_values = st.one_of(JSON, st.integers(-(2**70), 2**70), st.sampled_from([math.inf, -1, 0, 1e-300]))
    return st.one_of(valid_session(), st.dictionaries(keys, field_values, max_size=4), JSON)


def audio_payloads() -> st.SearchStrategy:
    """An append's `audio`: valid base64 PCM16, an odd byte count, text that is not base64, or not a string."""
    valid = st.builds(pcm16, st.integers(0, 2560), st.integers(0, 2**32 - 1))
    odd = st.binary(min_size=1, max_size=33).filter(lambda b: len(b) % 2).map(lambda b: base64.b64encode(b).decode())
    not_base64 = st.one_of(st.text(min_size=1, max_size=24), st.sampled_from(["A", "AAA", "AA=A", "!!!!", "AAAA===="]))
    return st.one_of(valid, valid, odd, not_base64, JSON)


def typed_messages() -> st.SearchStrategy[dict]:
    """Objects with a valid or random `type` and random or plausible payload fields."""
    kinds = st.one_of(st.sampled_from(CLIENT_TYPES), st.sampled_from(sorted(SERVER_EVENTS)), st.text(max_size=12),
                      JSON)
    extra = st.dictionaries(st.text(max_size=8), JSON, max_size=2)

    @st.composite
    def message(draw) -> dict:
        kind = draw(kinds)
        body = {"type": kind, **{k: v for k, v in draw(extra).items() if k != "type"}}
        if kind == "session.update" or draw(st.booleans()):
            body["session"] = draw(sessions())
        if kind == "input_audio_buffer.append" or draw(st.booleans()):
            body["audio"] = draw(audio_payloads())
        if draw(st.booleans()):
            body["sample_rate"] = draw(st.one_of(st.just(16000), st.integers(), JSON))
        if draw(st.booleans()):
            body["pad_partial"] = draw(st.one_of(st.booleans(), JSON))
        return body

    return message()


def valid_append() -> st.SearchStrategy[dict]:
    return st.builds(lambda n, seed: {"type": "input_audio_buffer.append", "audio": pcm16(n, seed)},
                     st.integers(1, 2560), st.integers(0, 2**32 - 1))


def nested(depth: int, brace: bool) -> str:
    return '{"a":' * depth + "0" + "}" * depth if brace else "[" * depth + "]" * depth


def frames() -> st.SearchStrategy[str | bytes]:
    """One client frame: text or binary, JSON or not, small or past the message limit."""
    return st.one_of(
        typed_messages().map(json.dumps), typed_messages().map(json.dumps), valid_append().map(json.dumps),
        JSON.map(json.dumps), st.text(max_size=32), st.binary(max_size=64),
        st.builds(nested, st.integers(100, 20_000), st.booleans()),
        st.builds(lambda n, c: json.dumps({"type": "input_audio_buffer.append", "audio": c * n}),
                  st.integers(MAX_BYTES, 2 * MAX_BYTES), st.sampled_from(["A", "!"])),
        st.integers(MAX_BYTES + 1, 2 * MAX_BYTES).map(lambda n: "x" * n))


def appends() -> st.SearchStrategy[dict]:
    """Appends with valid or broken audio and sample rates (and now and then a stray field)."""
    return st.fixed_dictionaries({"type": st.just("input_audio_buffer.append"), "audio": audio_payloads()},
                                 optional={"sample_rate": st.one_of(st.just(16000), integers_json()),
                                           "pad_partial": JSON})


def integers_json() -> st.SearchStrategy:
    return st.one_of(st.integers(-(2**40), 2**40), st.sampled_from([0, 8000, 16001, 2**63]), JSON)


def commits() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"type": st.just("input_audio_buffer.commit")},
                                 optional={"pad_partial": st.one_of(st.booleans(), JSON)})


UPDATE = st.builds(lambda session: json.dumps({"type": "session.update", "session": session}), valid_session())
# What a scenario's connection sends after session.created:
SCENARIOS = {
    # anything at all, mostly before any session.update
    "anything": st.lists(frames(), min_size=1, max_size=4),
    # session.update with valid or broken fields, then a little valid audio and a commit (or more updates)
    "update": st.tuples(
        st.lists(st.builds(lambda s: json.dumps({"type": "session.update", "session": s}), sessions()),
                 min_size=1, max_size=2),
        st.lists(st.one_of(valid_append().map(json.dumps), UPDATE), max_size=2),
        st.lists(commits().map(json.dumps), max_size=1)).map(lambda parts: [m for part in parts for m in part]),
    # a valid update, then appends with good or broken audio and rates, and a commit with any pad_partial
    "audio": st.tuples(UPDATE, st.lists(appends().map(json.dumps), min_size=1, max_size=4),
                       st.lists(commits().map(json.dumps), max_size=1)).map(lambda p: [p[0], *p[1], *p[2]]),
    # a valid update, then anything, then perhaps a valid commit
    "configured": st.tuples(UPDATE, st.lists(frames(), min_size=1, max_size=4),
                            st.lists(st.just(json.dumps({"type": "input_audio_buffer.commit"})), max_size=1)
                            ).map(lambda p: [p[0], *p[1], *p[2]]),
}


# --------------------------------------------------------------------------------------------- the oracle


@dataclass
class Expect:
    """What the answer to one message must be."""

    types: tuple[str, ...] = ()  # the answer is one event of each of these (in this order) ...
    error: str | None = None  # ... or one error event with this code
    frames: bool = False  # frame events may precede (append, commit)
    close: int | None = None  # the server then closes with this code
    may_fail: str | None = None  # this error code may replace (or, for appends, end) the normal answer
    configures: bool = False


def _parse(frame: str | bytes):
    if isinstance(frame, bytes):
        return None
    try:
        message = json.loads(frame)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def _valid_session(session) -> bool:
    if session is None:
        return True
    if not isinstance(session, dict):
        return False
    seed, seconds = session.get("seed"), session.get("max_streaming_seconds")
    number = isinstance(seconds, int | float) and not isinstance(seconds, bool)
    return (all(session.get(key) is None or isinstance(session.get(key), str) for key in ("system_prompt", "model"))
            and (seed is None or (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0))
            and (seconds is None or (number and math.isfinite(seconds) and seconds > 0)))


def _valid_audio(message: dict) -> bool:
    audio, rate = message.get("audio"), message.get("sample_rate", 16000)
    if not isinstance(audio, str) or not isinstance(rate, int) or isinstance(rate, bool):
        return False
    try:
        return len(base64.b64decode(audio, validate=True)) % 2 == 0
    except (binascii.Error, ValueError):
        return False


def expect(frame: str | bytes, configured: bool) -> Expect:
    """docs/protocol.md, message by message."""
    if len(frame.encode() if isinstance(frame, str) else frame) > MAX_BYTES:
        return Expect(close=1009)
    message = _parse(frame)
    if message is None:
        return Expect(error="invalid_request")
    kind = message.get("type")
    if kind == "session.ping":
        return Expect(types=("session.pong",))
    if kind == "session.update":
        if configured:
            return Expect(error="invalid_request")
        if not _valid_session(message.get("session")):
            return Expect(error="session_initialization_failed")
        return Expect(types=("session.updated",), may_fail="session_initialization_failed", configures=True)
    if not configured:
        return Expect(error="invalid_request")
    if kind == "input_audio_buffer.append":
        if not _valid_audio(message):
            return Expect(error="inference_error")
        if message.get("sample_rate", 16000) != 16000:
            return Expect(error="inference_error")
        return Expect(frames=True, may_fail="inference_error")
    if kind == "input_audio_buffer.commit":
        if not isinstance(message.get("pad_partial", True), bool):
            return Expect(error="invalid_request")
        return Expect(types=("input_audio_buffer.committed", "response.done"), frames=True, close=1000)
    if kind in ("session.cancel", "response.cancel"):
        return Expect(types=("response.cancelled",), close=1000)
    return Expect(error="invalid_request")


def check_answer(want: Expect, events: list[dict], close: int | None, frame: str | bytes) -> bool:
    """Assert that `events` (and the close code, None while open) answer the message as `want` says; returns
    whether the message configured the session."""
    context = f"message {frame[:200]!r} ({len(frame)} bytes) got {[e.get('type') for e in events]}, close {close}"
    for event in events:
        assert event.get("type") in SERVER_EVENTS and EVENT_ID.match(event.get("event_id", "")), context
        if event["type"] == "error":
            assert event["error"]["code"] in ERROR_CODES and event["error"]["message"].strip(), event
        if event["type"] == "response.audio.delta":
            assert len(base64.b64decode(event["delta"])) == 2 * OUT_SAMPLES and len(event["audio_codes"]) == 31
    assert close == want.close, context
    types = [e["type"] for e in events]
    if want.error is not None:
        assert types == ["error"] and events[0]["error"]["code"] == want.error, context
        return False
    rest = [t for t in types if t not in FRAME_EVENTS] if want.frames else types
    if rest and rest[-1] == "error" and want.may_fail is not None:  # the optional failure
        assert events[-1]["error"]["code"] == want.may_fail, context
        assert rest == ["error"] or (want.frames and rest == [*want.types[:1], "error"]), context
        return False
    assert rest == list(want.types), context
    if want.frames and "response.done" in types:
        assert types.index("input_audio_buffer.committed") < min(
            [i for i, t in enumerate(types) if t in FRAME_EVENTS], default=len(types)), context
    return want.configures


def exchange(ws: ClientConnection, frame: str | bytes, pongs: int) -> tuple[list[dict], int | None]:
    """Send a frame and a ping; the events up to the ping's pong (excluded), or up to the close."""
    events: list[dict] = []
    try:
        ws.send(frame)
        ws.send(PING)
    except ConnectionClosed:
        pass  # closed while sending (an oversized message); the reads below see the close
    while True:
        try:
            raw = ws.recv(timeout=DEADLINE_S)
        except TimeoutError:
            raise AssertionError(f"no answer within {DEADLINE_S:g} s to {frame[:200]!r}; so far {events}") from None
        except ConnectionClosed:
            return events, ws.close_code
        event = json.loads(raw)
        events.append(event)
        if event.get("type") == "session.pong":
            pongs -= 1
            if pongs == 0:
                return events[:-1], None


def converse(url: str, messages: list[str | bytes]) -> list[tuple[Expect, list[dict], int | None]]:
    """Play one connection; each message's expectation, answer and close code (the last may be a close)."""
    answers = []
    with connect(url, open_timeout=DEADLINE_S, close_timeout=5, compression=None, max_size=None) as ws:
        created = json.loads(ws.recv(timeout=DEADLINE_S))
        assert created["type"] == "session.created", created
        configured = False
        for frame in messages:
            want = expect(frame, configured)
            pongs = 2 if isinstance(frame, str) and (_parse(frame) or {}).get("type") == "session.ping" else 1
            events, close = exchange(ws, frame, pongs)
            configured = check_answer(want, events, close, frame) or configured
            answers.append((want, events, close))
            if close is not None:
                break
    return answers


def check_stack(orchestrator, network) -> None:
    """The connection freed its slot and closed its session on every service; every server still serves."""
    wait_until(lambda: orchestrator.realtime.live_sessions == 0, 10, "the realtime slot's release")
    assert orchestrator.thread.is_alive()
    for service in network.values():
        service.assert_idle()


def _normal(events: list[dict]) -> list[dict]:
    """Events without what differs from run to run (their random ids, the server's latency measure)."""
    out = []
    for event in events:
        event = {k: v for k, v in event.items() if k not in VARYING_FIELDS}
        if "session" in event:
            event["session"] = {k: v for k, v in event["session"].items() if k != "id"}
        out.append(event)
    return out


def reference_session(url: str) -> list[dict]:
    script = [json.dumps({"type": "session.update", "session": {"system_prompt": "Be brief.", "seed": 3}}),
              *(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16(1500, seed)}) for seed in range(3)),
              json.dumps({"type": "input_audio_buffer.commit"})]
    answers = converse(url, script)
    assert answers[-1][2] == 1000 and answers[-1][1][-1]["type"] == "response.done", answers[-1]
    return [_normal(events) for _, events, _ in answers]


@pytest.fixture(scope="module")
def first_session(orchestrator, reference) -> list[list[dict]]:
    """A fixed valid session's events on the fresh stack, before any fuzzing (and the network services' reference
    answers taken before it)."""
    return reference_session(orchestrator.realtime.url)


def test_the_oracle_knows_the_documented_errors():
    """A few messages from docs/protocol.md's tables, classified by the oracle the fuzzing uses."""
    assert expect(b"\x00", False).error == "invalid_request"
    assert expect("[1]", True).error == "invalid_request"
    assert expect(nested(5000, False), True).error == "invalid_request"
    assert expect(json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}), False).error == (
        "invalid_request")
    assert expect(json.dumps({"type": "input_audio_buffer.append", "audio": "AAA"}), True).error == "inference_error"
    assert expect(json.dumps({"type": "session.update", "session": {"seed": -1}}), False).error == (
        "session_initialization_failed")
    assert expect(json.dumps({"type": "session.update"}), True).error == "invalid_request"
    assert expect(json.dumps({"type": "input_audio_buffer.commit", "pad_partial": 1}), True).error == (
        "invalid_request")
    assert expect("x" * (MAX_BYTES + 1), True).close == 1009


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_random_messages_on_the_socket(scenario, orchestrator, network, first_session):
    def check(messages: list[str | bytes]) -> None:
        converse(orchestrator.realtime.url, messages)
        check_stack(orchestrator, network)

    fuzz(SCENARIOS[scenario], 40, check)


def test_after_the_fuzzing_a_session_answers_as_the_first(orchestrator, network, facts, reference, first_session):
    """Runs last in this module: no slot is held, a fresh session's events equal the first one's, the network
    services answer as they did before the fuzzing, and none of them ever answered the gateway INTERNAL."""
    assert orchestrator.realtime.live_sessions == 0
    assert reference_session(orchestrator.realtime.url) == first_session
    assert reference_answers(network, facts) == reference
    check_stack(orchestrator, network)
    assert {name: service.counts() for name, service in network.items()} == dict.fromkeys(network, (0, 0))
