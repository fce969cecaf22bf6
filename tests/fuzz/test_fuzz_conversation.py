"""Fuzz the orchestrator's ConversationService (every RPC of conversation.proto) over the four network services
running as real processes.

Converse reports problems in-band, as Error events; so besides the status rules of the other services, every
response must be a known event, every Error must carry a code and a message, a stream whose first message is not
Configure must be answered INVALID_REQUEST, and a valid conversation must end with Done and the right frame count.
After each example the conversation's slot is free again (its live-session count is back to 0), every service
process has closed the conversation's session (its open-session count, from its /metrics, is back to 0), and the
orchestrator's server and the four processes still serve. At the end a fresh conversation produces exactly the
events the first one did, and no service ever answered the orchestrator INTERNAL.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from orchestrator.conversation import SERVICE_NAME
from protos.voicechat.v1 import conversation_pb2 as pb
from services.common.tensors import to_proto_np
from tests.fuzz.harness import (
    ANY,
    INVALID,
    OK,
    Case,
    call,
    check_outcome,
    conversation_rpcs,
    fuzz,
    parses,
    reference_answers,
    serialized,
    serving_status,
    wait_until,
)
from tests.fuzz.strategies import mutated, random_message, raw_bodies

CONVERSE = next(rpc for rpc in conversation_rpcs() if rpc.method.name == "Converse")
EVENTS = {field.name for field in pb.ConverseResponse.DESCRIPTOR.oneofs_by_name["event"].fields}
FRAME_EVENTS = {"transcript", "text", "function", "audio"}
MAX_CHUNK = 2560  # samples per valid audio message: every valid conversation stays far below the 2 s limit


def configure(rng: np.random.Generator) -> pb.ConverseRequest:
    return pb.ConverseRequest(configure=pb.Configure(
        system_prompt=str(rng.choice(["", "Be brief."])), seed=int(rng.integers(0, 2**32)),
        max_streaming_seconds=float(rng.choice([0.0, 1.5])), sample_rate_hz=int(rng.choice([0, 16000]))))


def audio(rng: np.random.Generator) -> tuple[pb.ConverseRequest, int]:
    """A valid AudioIn of 1 to MAX_CHUNK samples, as float32 or PCM16; and its sample count."""
    n = int(rng.integers(1, MAX_CHUNK + 1))
    rate = int(rng.choice([0, 16000]))
    if rng.integers(0, 2):
        samples = to_proto_np((rng.standard_normal(n) * 0.2).astype(np.float32))
        return pb.ConverseRequest(audio=pb.AudioIn(float32=samples, sample_rate_hz=rate)), n
    pcm = rng.integers(-(2**15), 2**15, n, dtype=np.int16).astype("<i2").tobytes()
    return pb.ConverseRequest(audio=pb.AudioIn(pcm16=pcm, sample_rate_hz=rate)), n


def flush(rng: np.random.Generator) -> tuple[pb.ConverseRequest, bool]:
    """A Flush, with pad_partial unset (true), true or false; and whether it pads."""
    pad = rng.choice([None, True, False])
    message = pb.Flush() if pad is None else pb.Flush(pad_partial=bool(pad))
    return pb.ConverseRequest(flush=message), pad is None or bool(pad)


# What a conversation case breaks: its audio (after a valid Configure), its Configure (before valid audio), or the
# order of the messages (no Configure, a second one, empty messages, anything after Flush or Cancel).
SCENARIOS = {"audio": ["audio", "audio", "mutated audio", "mutated audio", "flush", "cancel"],
             "configure": ["audio", "audio", "flush"],
             "order": ["audio", "flush", "cancel", "configure", "empty", "random"]}


@st.composite
def converse_case(draw, scenario: str) -> Case:
    """A conversation broken as `scenario` says. `responses` of an OK case is the frame count its Done must
    report (-1: it ends with Cancelled)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    first = "configure" if scenario == "audio" else draw(st.sampled_from(
        ["mutated configure", "mutated configure", "random configure", "long prompt"] if scenario == "configure"
        else ["configure", "configure", "audio first", "empty", "random"]))
    verdict = OK
    if first == "configure":
        request = configure(rng)
    elif first == "mutated configure":
        request = draw(mutated(configure(rng)))
        verdict = ANY
    elif first == "long prompt":  # past the language service's limit: its open fails after perception's
        request = pb.ConverseRequest(configure=pb.Configure(system_prompt="Be brief. " * 40))
        verdict = ANY
    elif first == "random configure":
        request = pb.ConverseRequest(configure=draw(random_message(pb.Configure.DESCRIPTOR)))
        verdict = ANY
    elif first == "audio first":
        request = audio(rng)[0]
    elif first == "empty":
        request = pb.ConverseRequest()
    else:
        request = draw(random_message(pb.ConverseRequest.DESCRIPTOR))
        verdict = ANY
    if request.WhichOneof("message") != "configure":
        verdict = INVALID
    requests = [request]
    samples, pad, ended = 0, True, None
    for op in draw(st.lists(st.sampled_from(SCENARIOS[scenario]), max_size=4)):
        if ended and verdict == OK:
            verdict = INVALID  # anything after Flush or Cancel
        if op == "audio":
            message, n = audio(rng)
            requests.append(message)
            samples += 0 if ended else n
        elif op == "mutated audio":
            requests.append(draw(mutated(audio(rng)[0])))
            verdict = ANY if verdict == OK else verdict
        elif op == "flush":
            message, padded = flush(rng)
            requests.append(message)
            pad, ended = (padded, "done") if ended is None else (pad, ended)
        elif op == "cancel":
            requests.append(pb.ConverseRequest(cancel=pb.Cancel()))
            ended = ended or "cancelled"
        elif op in ("configure", "empty"):
            requests.append(configure(rng) if op == "configure" else pb.ConverseRequest())
            verdict = INVALID if verdict == OK else verdict
        else:
            requests.append(draw(random_message(pb.ConverseRequest.DESCRIPTOR)))
            verdict = ANY if verdict == OK else verdict
    frames = math.ceil(samples / 1280) if pad else samples // 1280
    return Case(requests, verdict, frames if ended != "cancelled" else -1)


def check_events(case: Case, responses: list) -> None:
    kinds = [r.WhichOneof("event") for r in responses]
    assert all(kind in EVENTS for kind in kinds), f"a response without a known event: {kinds}"
    for response in responses:
        if response.WhichOneof("event") == "error":
            assert response.error.code != pb.ERROR_CODE_UNSPECIFIED and response.error.message.strip(), response
    indices = [getattr(r, k).frame_index for r, k in zip(responses, kinds, strict=True) if k in FRAME_EVENTS]
    assert indices == sorted(indices), f"frame events out of order: {indices}"
    errors = [r.error.code for r in responses if r.WhichOneof("event") == "error"]
    first = case.requests[0].WhichOneof("message") if case.requests else None
    if first != "configure":
        assert kinds and kinds[0] == "error" and responses[0].error.code == pb.ERROR_CODE_INVALID_REQUEST, kinds
    if case.verdict == OK:
        assert kinds[0] == "ready" and not errors, f"a valid conversation got {kinds}"
        if case.responses >= 0:
            assert kinds[-1] == "done" and responses[-1].done.frame_index == case.responses, responses[-1]
            assert kinds.count("audio") == case.responses
        else:
            assert kinds[-1] == "cancelled"
    elif case.verdict == INVALID:
        assert pb.ERROR_CODE_INVALID_REQUEST in errors, f"invalid messages were not reported: {kinds} {errors}"


def check_stack(orchestrator, network) -> None:
    """The conversation freed its slot and closed its session on every service; every server still serves."""
    wait_until(lambda: orchestrator.conversation.live_sessions == 0, 10, "the conversation slot's release")
    assert orchestrator.thread.is_alive()
    assert serving_status(orchestrator.channel, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    for service in network.values():
        service.assert_idle()


def test_the_fuzzed_rpcs_are_the_protos():
    assert [rpc.path for rpc in conversation_rpcs()] == ["/voicechat.v1.ConversationService/Converse"]


@pytest.fixture(scope="module")
def first_conversation(orchestrator, reference) -> list[bytes]:
    """A fixed valid conversation's responses on the fresh stack, before any fuzzing (and the network services'
    reference answers taken before it)."""
    return reference_conversation(orchestrator)


def reference_conversation(orchestrator) -> list[bytes]:
    rng = np.random.default_rng(7)
    requests = [pb.ConverseRequest(configure=pb.Configure(system_prompt="Be brief.", seed=3)),
                *(audio(rng)[0] for _ in range(3)), flush(rng)[0]]
    outcome = call(orchestrator.channel, CONVERSE, requests, timeout=60)
    assert outcome.code == grpc.StatusCode.OK, outcome
    assert outcome.responses[0].WhichOneof("event") == "ready", outcome.responses[0]
    outcome.responses[0].ready.ClearField("session_id")  # numbered per conversation
    return serialized(outcome.responses)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_well_typed_but_malformed_conversations(scenario, orchestrator, network, first_conversation):
    def check(case: Case) -> None:
        outcome = call(orchestrator.channel, CONVERSE, case.requests)
        check_outcome(outcome)
        assert outcome.code == grpc.StatusCode.OK, f"Converse reports problems in-band: {outcome}"
        check_events(case, outcome.responses)
        check_stack(orchestrator, network)

    fuzz(converse_case(scenario), 40, check)


def test_random_bytes_as_conversation_messages(orchestrator, network, first_conversation):
    rng = np.random.default_rng(0)
    valid = serialized([configure(rng), audio(rng)[0], flush(rng)[0]])

    def check(bodies: list[bytes]) -> None:
        outcome = call(orchestrator.channel, CONVERSE, bodies, raw=True)
        check_outcome(outcome, unparseable=not all(parses(CONVERSE, body) for body in bodies))
        check_stack(orchestrator, network)

    fuzz(st.lists(raw_bodies(valid), min_size=1, max_size=4), 25, check)


def test_after_the_fuzzing_a_conversation_answers_as_the_first(orchestrator, network, facts, reference,
                                                              first_conversation):
    """Runs last in this module: no slot is held, a fresh conversation's events equal the first one's, the network
    services answer as they did before the fuzzing, and none of them ever answered the orchestrator INTERNAL."""
    assert orchestrator.conversation.live_sessions == 0
    assert reference_conversation(orchestrator) == first_conversation
    assert reference_answers(network, facts) == reference
    check_stack(orchestrator, network)
    assert {name: service.counts() for name, service in network.items()} == dict.fromkeys(network, (0, 0))
