"""Fuzz every RPC of the four network services (enumerated from the proto descriptors) as real processes.

Each example is one call with a deadline: well-typed requests with broken fields (or whole streams with a missing,
repeated or mutated open, out-of-order frame indices, broken tensors), or random bytes as the request bodies. The
call must end with a normal answer or an allowed status (INVALID_ARGUMENT and friends; INTERNAL or UNKNOWN only
for a body that does not parse; INVALID_ARGUMENT where the case knows a message is out of order; OK with one
answer per message for a valid session). Afterwards the process must still run and say SERVING, its open sessions
(its servicer's live_sessions, read from the process's /metrics) must be back to zero, and a well-typed example
must not have added to its INTERNAL error count.

At the end of the module every templated RPC must answer exactly as it did before the fuzzing: no state left by
the fuzzed sessions (shared between sessions, or cached) changes what a fresh session computes.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf.message import Message
from hypothesis import strategies as st

from tests.fuzz.harness import (
    ANY,
    INVALID,
    OK,
    STREAM_TEMPLATES,
    UNARY_TEMPLATES,
    Case,
    Facts,
    Rpc,
    StreamTemplate,
    call,
    check_outcome,
    fuzz,
    network_rpcs,
    parses,
    payload_kind,
    reference_answers,
    serialized,
)
from tests.fuzz.strategies import (
    frame_index_path,
    integers,
    mutated,
    random_message,
    raw_bodies,
    set_field,
    with_frame_index,
)

RPCS = network_rpcs()

# What a templated stream's cases break: its frames (after a valid open), its open (before valid frames), or the
# order of the messages (no open, a second open, empty messages, frame_index gaps).
SCENARIOS = ("frames", "open", "order")
TYPED_CASES = [(rpc, scenario) for rpc in RPCS
               for scenario in (SCENARIOS if rpc.path in STREAM_TEMPLATES else (None,))]


def _worse(verdict: str, new: str) -> str:
    """The verdict once a message of verdict `new` follows: the first invalid message decides."""
    return verdict if verdict != OK else new


def _first(draw, rpc: Rpc, template: StreamTemplate, facts: Facts, rng, scenario: str) -> tuple[Message, str]:
    """The first message of a stream case and its verdict."""
    if scenario == "open":  # a valid open with broken fields, or an open of random fields
        if draw(st.booleans()):
            first = draw(mutated(template.open(facts, rng)))
        else:
            first = rpc.request()
            field = rpc.request.DESCRIPTOR.fields_by_name["open"]
            set_field(first, field, draw(random_message(field.message_type)))
        return first, ANY if payload_kind(first) == "open" else INVALID
    how = "open" if scenario == "frames" else draw(st.sampled_from(["open", "open", "frame", "empty", "random"]))
    if how == "open":
        return template.open(facts, rng), OK
    if how == "frame":
        return template.frame(facts, rng, 0), INVALID
    first = rpc.request() if how == "empty" else draw(random_message(rpc.request.DESCRIPTOR))
    return first, ANY if payload_kind(first) == "open" else INVALID


@st.composite
def stream_case(draw, rpc: Rpc, template: StreamTemplate, facts: Facts, scenario: str) -> Case:
    """A session of a templated stream RPC broken as `scenario` says."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    first, verdict = _first(draw, rpc, template, facts, rng, scenario)
    requests = [first]
    ops = {"frames": ["frame", "mutated", "mutated"], "open": ["frame"],
           "order": ["frame", "gap", "open", "empty", "random"]}[scenario]
    index = frames = 0  # the next valid frame index; the frames a valid stream has sent
    for op in draw(st.lists(st.sampled_from(ops), min_size=scenario != "open", max_size=4)):
        frame = template.frame(facts, rng, index)
        if op == "frame":
            requests.append(frame)
            index, frames = index + 1, frames + 1
        elif op == "mutated":
            requests.append(draw(mutated(frame)))
            index, frames = index + 1, frames + 1
            verdict = _worse(verdict, ANY)
        elif op == "gap" and frame_index_path(frame) is not None:
            # (an index from 2**62 up stays in the `mutated` cases: a valid one there leaves no room for the next)
            wrong = draw(integers(-(2**63), 2**62).filter(lambda i, index=index: i != index))
            requests.append(with_frame_index(frame, wrong))
            if index == 0 and template.free_first_index and wrong >= 0:
                index, frames = wrong + 1, frames + 1  # a valid first index for this service
            else:
                verdict = _worse(verdict, INVALID)
        elif op == "open":
            requests.append(template.open(facts, rng))
            verdict = _worse(verdict, INVALID)
        elif op == "empty":
            requests.append(rpc.request())
            verdict = _worse(verdict, INVALID)
        else:
            message = draw(random_message(rpc.request.DESCRIPTOR))
            requests.append(message)
            # a snapshot request is valid too, answered by a number of parts the case does not know
            verdict = _worse(verdict, ANY if payload_kind(message) in (payload_kind(frame), "snapshot") else INVALID)
    return Case(requests, verdict, 1 + frames)


@st.composite
def unary_case(draw, rpc: Rpc, facts: Facts) -> Case:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    how = draw(st.sampled_from(["valid", "mutated", "mutated", "mutated", "random"]))
    if how == "valid":
        return Case([UNARY_TEMPLATES[rpc.path](facts, rng)], OK, 1)
    if how == "mutated":
        return Case([draw(mutated(UNARY_TEMPLATES[rpc.path](facts, rng)))])
    return Case([draw(random_message(rpc.request.DESCRIPTOR))])


def typed_case(rpc: Rpc, facts: Facts, scenario: str | None) -> st.SearchStrategy:
    if rpc.path in STREAM_TEMPLATES:
        return stream_case(rpc, STREAM_TEMPLATES[rpc.path], facts, scenario)
    if rpc.path in UNARY_TEMPLATES:
        return unary_case(rpc, facts)
    # an RPC nobody wrote a template for: random messages of its request type
    size = (0 if rpc.streaming else 1, 5 if rpc.streaming else 1)
    return st.builds(Case, st.lists(random_message(rpc.request.DESCRIPTOR), min_size=size[0], max_size=size[1]))


def test_every_rpc_is_fuzzed():
    """The suite covers what the descriptors declare; a template is optional (only deeper)."""
    paths = {rpc.path for rpc in RPCS}
    assert len(paths) == len(RPCS) >= 9
    assert set(STREAM_TEMPLATES) | set(UNARY_TEMPLATES) <= paths, "a template for an RPC that no longer exists"


@pytest.mark.parametrize(("rpc", "scenario"), TYPED_CASES, ids=lambda x: str(x) if x is not None else "")
def test_well_typed_but_malformed_requests(rpc, scenario, network, facts, reference):
    service = network[rpc.owner]

    internal = service.assert_idle()  # INTERNAL statuses so far; a well-typed example adds none

    def check(case: Case) -> None:
        outcome = call(service.channel, rpc, case.requests)
        check_outcome(outcome)
        if case.verdict == OK:
            assert outcome.code == grpc.StatusCode.OK, f"valid requests failed: {outcome}"
            assert len(outcome.responses) == case.responses, f"one response per message: {outcome}"
        elif case.verdict == INVALID:
            assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, f"invalid requests were not rejected: {outcome}"
        assert service.assert_idle() == internal, "the service counted an INTERNAL error"

    fuzz(typed_case(rpc, facts, scenario), 85, check)


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_random_bytes_as_request_bodies(rpc, network, facts, reference):
    service = network[rpc.owner]
    rng = np.random.default_rng(0)
    if rpc.path in STREAM_TEMPLATES:
        template = STREAM_TEMPLATES[rpc.path]
        valid = serialized([template.open(facts, rng), template.frame(facts, rng, 0)])
    elif rpc.path in UNARY_TEMPLATES:
        valid = serialized([UNARY_TEMPLATES[rpc.path](facts, rng)])
    else:
        valid = []
    count = (1, 4) if rpc.streaming else (1, 1)

    def check(bodies: list[bytes]) -> None:
        outcome = call(service.channel, rpc, bodies, raw=True)
        check_outcome(outcome, unparseable=not all(parses(rpc, body) for body in bodies))
        service.assert_idle()

    fuzz(st.lists(raw_bodies(valid), min_size=count[0], max_size=count[1]), 30, check)


def test_after_the_fuzzing_every_rpc_answers_as_before(network, facts, reference):
    """Runs last in this module: no session is open anywhere, and nothing the fuzzing left (state shared between
    sessions, caches) changes what a fresh session or call answers."""
    for service in network.values():
        service.assert_idle()
    assert reference_answers(network, facts) == reference
