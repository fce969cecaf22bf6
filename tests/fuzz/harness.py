"""What the fuzz tests share: every RPC enumerated from the proto descriptors, one call of any of them with a
deadline (typed or raw bytes), the liveness check, and a valid request (or stream) per RPC that the strategies
mutate.

An RPC without a template in UNARY_TEMPLATES or STREAM_TEMPLATES is still fuzzed, with random messages of its
request type only.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import TypeVar

import grpc
import numpy as np
from google.protobuf import text_format
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.realtime import RealtimeLimits
from protos.voicechat.v1 import (
    codec_pb2,
    conversation_pb2,
    language_pb2,
    perception_pb2,
    speech_pb2,
)
from services.common.tensors import to_proto_np
from tests.fuzz.strategies import message_class

# Reproducible and fast enough for CI: a fixed derandomized search with no example database; the example counts
# are set per test and scaled by $VOICECHAT_FUZZ_SCALE (e.g. 10 for a longer search by hand). No shrinking: the
# examples share live processes, and after a failure (a hang that keeps an engine thread busy, say) shrinking
# would replay against a damaged service and report a "minimal" example that did nothing wrong. The first
# failing example is reported as it was.
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False, report_multiple_bugs=False,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow])
FUZZ_SCALE = float(os.environ.get("VOICECHAT_FUZZ_SCALE", "1"))
T = TypeVar("T")
DEADLINE_S = 10.0  # every fuzzed call; running into it is a hang
HEALTH_DEADLINE_S = 5.0
# The network service (its `python -m services.NAME`) that serves each proto module's services.
NETWORK_PROTOS: dict[str, ModuleType] = {"perception": perception_pb2, "llm": language_pb2, "tts": speech_pb2,
                                         "codec": codec_pb2}
# Limits the fuzzed services run with, so that every request they accept is cheap: a valid but huge size is
# then RESOURCE_EXHAUSTED at once instead of a long (and legitimate) computation.
SERVICE_FLAGS: dict[str, tuple[str, ...]] = {
    "perception": (), "llm": ("--max-prompt-tokens", "32"), "tts": ("--max-prefix-steps", "32"),
    "codec": ("--max-frames", "64"),
}

# The orchestrator's limits in the fuzz: short sessions, and small realtime messages (so that oversized ones are
# cheap to send); the realtime timeouts are the defaults.
CONVERSATION_MAX_SECONDS = 2.0
REALTIME_LIMITS = RealtimeLimits(max_message_bytes=64 * 1024, max_session_seconds=2.0)
REFERENCE_SEED = 1234
REFERENCE_FRAMES = 3

# Statuses a call may end with.
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.OUT_OF_RANGE}
# ... and for a body that does not parse: grpc.aio answers UNKNOWN when a unary request fails to parse (before
# any handler runs), with protobuf's parse error in the details; a stream's request iterator raises the parse
# error into the servicer, which the shared interceptor answers INVALID_ARGUMENT. For a message that parses,
# UNKNOWN is a bug, and INTERNAL always is.
UNPARSEABLE = {grpc.StatusCode.UNKNOWN}
PARSE_ERROR = "Error parsing message"


def fuzz(strategy: st.SearchStrategy[T], count: int, check: Callable[[T], None]) -> None:
    """Run `check` on `count` examples of `strategy` (times VOICECHAT_FUZZ_SCALE).

    A failure is reported as it first happened: Hypothesis replays a failing example before it reports it, and
    against a process the failure left damaged (a slot never freed, a busy engine thread) the replay can fail
    differently, which would hide the cause."""
    first: list[str] = []

    @settings(FUZZ, max_examples=max(1, round(count * FUZZ_SCALE)))
    @given(strategy)
    def run(example: T) -> None:
        try:
            check(example)
        except Exception as exc:
            if not first:
                first.append(f"{type(exc).__name__}: {exc}\non the example {example!r}")
            raise

    try:
        run()
    except Exception as exc:
        if first:
            raise AssertionError(f"the first failing example:\n{first[0]}") from exc
        raise


@dataclass(frozen=True)
class Rpc:
    """One method of one service, as its descriptors describe it."""

    owner: str  # the process serving it: a NETWORK_PROTOS key, or "orchestrator"
    service: ServiceDescriptor
    method: MethodDescriptor

    @property
    def path(self) -> str:
        return f"/{self.service.full_name}/{self.method.name}"

    @property
    def request(self) -> type[Message]:
        return message_class(self.method.input_type)

    @property
    def response(self) -> type[Message]:
        return message_class(self.method.output_type)

    @property
    def streaming(self) -> bool:
        return self.method.client_streaming

    def __str__(self) -> str:
        return self.path


def rpcs_of(owner: str, module: ModuleType) -> list[Rpc]:
    return [Rpc(owner, service, method) for service in module.DESCRIPTOR.services_by_name.values()
            for method in service.methods]


def network_rpcs() -> list[Rpc]:
    """Every RPC of the four network services."""
    return [rpc for owner, module in NETWORK_PROTOS.items() for rpc in rpcs_of(owner, module)]


def conversation_rpcs() -> list[Rpc]:
    return rpcs_of("orchestrator", conversation_pb2)


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list
    seconds: float

    def __str__(self) -> str:
        return f"{self.code.name} ({self.details!r}) after {len(self.responses)} responses in {self.seconds:.2f} s"


def call(channel: grpc.Channel, rpc: Rpc, requests: list, *, raw: bool = False,
         timeout: float = DEADLINE_S) -> Outcome:
    """Send `requests` (messages, or bytes when raw) on one call of `rpc`; a unary RPC takes the first one."""
    serialize = None if raw else rpc.request.SerializeToString
    deserialize = None if raw else rpc.response.FromString
    method = rpc.method
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (method.client_streaming, method.server_streaming)]
    multicallable = kind(rpc.path, request_serializer=serialize, response_deserializer=deserialize)
    argument = iter(requests) if method.client_streaming else requests[0]
    start = time.monotonic()
    responses: list = []
    try:
        if method.server_streaming:
            for response in multicallable(argument, timeout=timeout):
                responses.append(response)
        else:
            responses.append(multicallable(argument, timeout=timeout))
    except grpc.RpcError as err:
        return Outcome(err.code(), err.details() or "", responses, time.monotonic() - start)
    return Outcome(grpc.StatusCode.OK, "", responses, time.monotonic() - start)


def parses(rpc: Rpc, body: bytes) -> bool:
    try:
        rpc.request.FromString(body)
    except DecodeError:
        return False
    return True


def check_outcome(outcome: Outcome, *, unparseable: bool = False) -> None:
    """No hang, and a status from the allowed set (UNPARSEABLE only when a body did not parse), with details."""
    assert outcome.code != grpc.StatusCode.DEADLINE_EXCEEDED, f"the call hung: {outcome}"
    allowed = ALLOWED | (UNPARSEABLE if unparseable else set())
    assert outcome.code in allowed, f"unexpected status: {outcome}"
    if outcome.code in UNPARSEABLE:
        assert PARSE_ERROR in outcome.details, f"{outcome.code.name} for another reason than parsing: {outcome}"
    if outcome.code != grpc.StatusCode.OK:
        assert outcome.details.strip(), f"a {outcome.code.name} without a message"


def serving_status(channel: grpc.Channel, service: str = "") -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=HEALTH_DEADLINE_S).status


@dataclass
class ServiceHandle:
    """A running service process, a channel to it and its /metrics URL."""

    name: str
    address: str
    process: subprocess.Popen
    channel: grpc.Channel
    metrics_url: str

    def assert_alive(self) -> None:
        """The process runs and its health says SERVING."""
        assert self.process.poll() is None, f"the {self.name} service exited with code {self.process.returncode}"
        assert serving_status(self.channel) == health_pb2.HealthCheckResponse.SERVING, f"{self.name} not SERVING"

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """The process's /metrics page as {(sample name, labels): value}."""
        with urllib.request.urlopen(self.metrics_url, timeout=HEALTH_DEADLINE_S) as response:
            text = response.read().decode()
        return {(sample.name, frozenset(sample.labels.items())): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    def counts(self) -> tuple[int, int]:
        """(open streaming sessions, INTERNAL statuses answered so far): the servicer's live_sessions as
        voicechat_active_sessions shows it, and voicechat_errors_total{code="INTERNAL"}."""
        page = self.metrics()
        sessions = page[("voicechat_active_sessions", frozenset({("service", self.name)}))]
        internal = page.get(("voicechat_errors_total", frozenset({("service", self.name), ("code", "INTERNAL")})), 0)
        return int(sessions), int(internal)

    def assert_idle(self, timeout_s: float = 10.0) -> int:
        """Alive, and every session closed (a stream's session is freed just after its call ends); returns the
        INTERNAL count."""
        self.assert_alive()
        deadline = time.monotonic() + timeout_s
        while (counts := self.counts())[0]:
            assert time.monotonic() < deadline, f"{counts[0]} sessions of the {self.name} service still open"
            time.sleep(0.01)
        return counts[1]


# ---------------------------------------------------------------------------------------------- templates


@dataclass(frozen=True)
class Facts:
    """What a valid request needs to know about the served checkpoint."""

    input_rate: int
    frame_samples: int
    hidden: int
    text_vocab: int
    quantizers: int
    codebook: int
    output_rate: int
    output_frame_samples: int
    prompt_codes: Message  # the codec's PromptCodes for the speech prompt, as a Tensor


def floats(rng: np.random.Generator, *shape: int, scale: float = 0.3) -> Message:
    return to_proto_np((rng.standard_normal(shape) * scale).astype(np.float32))


def codes(rng: np.random.Generator, facts: Facts, *shape: int) -> Message:
    return to_proto_np(rng.integers(0, facts.codebook, shape, dtype=np.int32))


@dataclass(frozen=True)
class StreamTemplate:
    """A valid session: `open`, then `frame(i)` for i = 0, 1, ...; one response to each."""

    open: Callable[[Facts, np.random.Generator], Message]
    frame: Callable[[Facts, np.random.Generator, int], Message]
    free_first_index: bool = False  # the first frame may carry any non-negative index


P, L, S, C, V = perception_pb2, language_pb2, speech_pb2, codec_pb2, conversation_pb2
UNARY_TEMPLATES: dict[str, Callable[[Facts, np.random.Generator], Message]] = {
    "/voicechat.v1.PerceptionService/Encode": lambda f, rng: P.EncodeRequest(
        waveform=floats(rng, int(rng.integers(f.frame_samples, 3 * f.frame_samples))), sample_rate_hz=f.input_rate),
    "/voicechat.v1.SpeechService/Describe": lambda f, rng: S.SpeechDescribeRequest(),
    "/voicechat.v1.CodecService/Encode": lambda f, rng: C.CodecEncodeRequest(
        waveform=floats(rng, int(rng.integers(1, 3)) * f.output_frame_samples),
        sample_rate_hz=int(rng.choice([0, f.output_rate]))),
    "/voicechat.v1.CodecService/Decode": lambda f, rng: C.CodecDecodeRequest(
        codes=codes(rng, f, int(rng.integers(1, 3)), f.quantizers)),
    "/voicechat.v1.CodecService/PromptCodes": lambda f, rng: C.PromptCodesRequest(frames=int(rng.integers(2, 8))),
}
STREAM_TEMPLATES: dict[str, StreamTemplate] = {
    "/voicechat.v1.PerceptionService/Stream": StreamTemplate(
        lambda f, rng: P.PerceptionStreamRequest(open=P.PerceptionOpen(sample_rate_hz=f.input_rate,
                                                                        session_label="fuzz")),
        lambda f, rng, i: P.PerceptionStreamRequest(frame=P.PerceptionFrameInput(
            frame_index=i, samples=floats(rng, f.frame_samples)))),
    "/voicechat.v1.LanguageService/Stream": StreamTemplate(
        lambda f, rng: L.LanguageStreamRequest(open=L.LanguageOpen(
            system_prompt=str(rng.choice(["", "Be brief."])), prefix_precision=int(rng.integers(0, 3)))),
        lambda f, rng, i: L.LanguageStreamRequest(step=L.LanguageStep(
            frame_index=i, audio_embedding=floats(rng, f.hidden), return_logits=bool(rng.integers(0, 2))))),
    "/voicechat.v1.SpeechService/Stream": StreamTemplate(
        lambda f, rng: S.SpeechStreamRequest(open=S.SpeechOpen(
            seed=int(rng.integers(0, 2**63)), prompt_codes=f.prompt_codes, prefix_steps=int(rng.integers(0, 3)))),
        lambda f, rng, i: S.SpeechStreamRequest(step=S.SpeechStep(
            frame_index=i, text_token_id=int(rng.integers(0, f.text_vocab)))),
        free_first_index=True),
    "/voicechat.v1.CodecService/DecodeStream": StreamTemplate(
        lambda f, rng: C.CodecDecodeStreamRequest(open=C.CodecDecodeOpen()),
        lambda f, rng, i: C.CodecDecodeStreamRequest(frame=C.CodecDecodeFrameInput(
            frame_index=i, codes=codes(rng, f, f.quantizers)))),
}


def brief(message: Message, limit: int = 300) -> str:
    """One line of text format, cut at `limit` characters (tensor payloads get long)."""
    text = text_format.MessageToString(message, as_one_line=True)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


OK, ANY, INVALID = "ok", "any", "invalid"  # what a case's call must end with


@dataclass
class Case:
    """Requests for one call and what it must end with: OK with `responses` answers, INVALID_ARGUMENT, or any
    allowed status."""

    requests: list
    verdict: str = ANY
    responses: int = 0

    def __repr__(self) -> str:
        listed = ", ".join(f"{{{brief(m)}}}" for m in self.requests)
        return f"Case({self.verdict}, {self.responses} responses if ok: [{listed}])"

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # how Hypothesis prints a failing example
        printer.text(repr(self))


def payload_kind(message: Message) -> str | None:
    """The chosen member of a stream request's (only) oneof."""
    oneofs = message.DESCRIPTOR.oneofs
    return message.WhichOneof(oneofs[0].name) if oneofs else None


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.01)


def serialized(messages: Iterable[Message]) -> list[bytes]:
    return [m.SerializeToString() for m in messages]


def reference_answers(network: dict[str, ServiceHandle], facts: Facts) -> dict[str, list[bytes]]:
    """Every templated RPC on fixed valid input (a stream: open and REFERENCE_FRAMES frames): its responses."""
    answers = {}
    for rpc in network_rpcs():
        rng = np.random.default_rng(REFERENCE_SEED)
        if rpc.path in STREAM_TEMPLATES:
            template = STREAM_TEMPLATES[rpc.path]
            requests = [template.open(facts, rng), *(template.frame(facts, rng, i) for i in range(REFERENCE_FRAMES))]
        elif rpc.path in UNARY_TEMPLATES:
            requests = [UNARY_TEMPLATES[rpc.path](facts, rng)]
        else:
            continue
        outcome = call(network[rpc.owner].channel, rpc, requests, timeout=60)
        assert outcome.code == grpc.StatusCode.OK, f"{rpc} on valid input: {outcome}"
        answers[rpc.path] = serialized(outcome.responses)
    return answers
