"""The conversation service with plain gRPC clients: the four network services and the conversation service run
as real grpc.aio servers on port 0 in a background event loop of this process (so the tests can read every
service's live-session count), the conversation service talking to the others over gRPC."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest

from orchestrator.clients import ServiceError
from orchestrator.conversation import MAX_QUEUED_FRAMES, SERVICE_NAME, ConversationServicer, registrations
from orchestrator.stream_clients import grpc_stream_clients
from protos.voicechat.v1 import conversation_pb2 as pb
from protos.voicechat.v1 import conversation_pb2_grpc, speech_pb2_grpc
from services.codec.service import build_spec as codec_spec
from services.common.engine_thread import EngineThread
from services.common.server import start_server
from services.common.tensors import from_proto_np, to_proto_np
from services.llm.service import build_spec as llm_spec
from services.perception.service import SERVICE_NAME as PERCEPTION_NAME
from services.perception.service import PerceptionServicer
from services.perception.service import registrations as perception_registrations
from services.tts.service import SERVICE_NAME as TTS_NAME
from services.tts.service import SpeechServicer
from tests.conftest import load_golden

HOST = "127.0.0.1"
N = 1280


class Stack:
    """Five servers on one event loop in a background thread."""

    def __init__(self, model):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.threads = [EngineThread("perception"), EngineThread("tts")]
        self.servicers, self.running, self.closers = {}, [], [t.close for t in self.threads]
        self.run(self._start(model))

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(120)

    async def _serve(self, name, regs, names, load):
        running = await start_server(regs, names, host=HOST, port=0)
        await running.become_ready(load)
        self.running.append(running)
        self.servicers[name] = regs[0][1]
        return f"{HOST}:{running.port}"

    async def _start(self, model):
        perception = PerceptionServicer(self.threads[0])
        tts = SpeechServicer(self.threads[1])
        addresses = {
            "perception": await self._serve("perception", perception_registrations(perception), [PERCEPTION_NAME],
                                            lambda: perception.load(model)),
            "tts": await self._serve("tts", [(speech_pb2_grpc.add_SpeechServiceServicer_to_server, tts)], [TTS_NAME],
                                     lambda: tts.load(model)),
        }
        for name, build in (("llm", llm_spec), ("codec", codec_spec)):
            spec = build(model)
            self.closers.append(spec.close)
            addresses[name] = await self._serve(name, spec.registrations, spec.service_names, spec.load)
        self.clients = grpc_stream_clients(addresses)
        self.conversation = ConversationServicer(self.clients, model, max_sessions=4, max_streaming_seconds=30.0)
        self.address = await self._serve("conversation", registrations(self.conversation), [SERVICE_NAME], None)

    def live(self) -> dict[str, int]:
        return {name: servicer.live_sessions for name, servicer in self.servicers.items()}

    def wait_idle(self, timeout_s=10.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while any(self.live().values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.live()

    def close(self):
        async def stop():
            for running in self.running:
                await running.stop(0)

        self.run(stop())
        self.clients.close()
        for close in self.closers:
            close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    stack = Stack(tiny_checkpoint)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def golden():
    return load_golden("online")


def configure(**kwargs):
    return pb.ConverseRequest(configure=pb.Configure(**kwargs))


def audio(samples, rate=0):
    return pb.ConverseRequest(audio=pb.AudioIn(float32=to_proto_np(np.asarray(samples, np.float32)),
                                               sample_rate_hz=rate))


def flush():
    return pb.ConverseRequest(flush=pb.Flush())


def chunks(waveform, size=N):
    return [audio(waveform[i : i + size]) for i in range(0, len(waveform), size)]


def describe(response):
    kind = response.WhichOneof("event")
    m = getattr(response, kind)
    if kind == "transcript":
        return (kind, m.frame_index, m.delta, m.transcript)
    if kind in ("text", "function"):
        return (kind, m.frame_index, m.token_id, m.delta, m.text)
    if kind == "audio":
        return (kind, m.frame_index, tuple(m.audio_codes), from_proto_np(m.samples).tobytes())
    if kind in ("done", "cancelled"):
        return (kind, m.frame_index)
    if kind == "error":
        return (kind, pb.ErrorCode.Name(m.code), m.message)
    return (kind,)


def converse(address, requests, timeout=120):
    with grpc.insecure_channel(address) as channel:
        stub = conversation_pb2_grpc.ConversationServiceStub(channel)
        return [describe(r) for r in stub.Converse(iter(requests), timeout=timeout)]


def test_a_conversation_equals_the_reference_session(stack, golden):
    arrays, meta = golden
    got = converse(stack.address, [configure(seed=0), *chunks(arrays["waveform"]), flush()])
    assert got[0] == ("ready",) and got[-1] == ("done", meta["frames"])
    kinds = {"transcript": "user_transcript_delta", "text": "assistant_text_delta", "function": "function_delta"}
    events = [{"kind": kinds[e[0]], "frame_index": e[1], "token_id": None if e[0] == "transcript" else e[2],
               "delta": e[-2], "text": e[-1]} for e in got if e[0] in kinds]
    assert events == [e for e in meta["events"] if e["kind"] != "done"]
    sound = [e for e in got if e[0] == "audio"]
    assert np.array_equal(np.array([e[2] for e in sound]), arrays["audio_codes"])
    samples = np.concatenate([np.frombuffer(e[3], np.float32) for e in sound])
    assert np.abs(samples - arrays["audio"]).max() <= 1e-4
    assert stack.wait_idle() == {name: 0 for name in stack.live()}


def test_pcm16_chunks_of_any_size_and_half_close_flushes(stack, golden):
    wave = golden[0]["waveform"][: N * 6]
    pcm = (np.clip(wave, -1, 1) * 32767).astype("<i2")
    as_float = pcm.astype(np.float32) / 32768.0
    by_float = converse(stack.address, [configure(seed=1), *chunks(as_float, 700), flush()])
    by_pcm = converse(stack.address, [configure(seed=1),
                                      *[pb.ConverseRequest(audio=pb.AudioIn(pcm16=pcm[i : i + 333].tobytes()))
                                        for i in range(0, len(pcm), 333)]])  # no Flush: the half-close flushes
    assert by_pcm == by_float and by_pcm[-1] == ("done", 6)


def test_four_concurrent_conversations_each_equal_a_solo_run(stack, golden):
    wave = golden[0]["waveform"]
    inputs = [(wave[N * 8 * k : N * 8 * k + N * 20], k) for k in range(4)]  # different audio and seeds
    solo = [converse(stack.address, [configure(seed=seed), *chunks(w, 1000), flush()]) for w, seed in inputs]

    async def one(w, seed):
        async with grpc.aio.insecure_channel(stack.address) as channel:
            stub = conversation_pb2_grpc.ConversationServiceStub(channel)
            return [describe(r) async for r in stub.Converse(iter([configure(seed=seed), *chunks(w, 1000), flush()]))]

    async def together():
        return await asyncio.gather(*(one(w, seed) for w, seed in inputs))

    results = asyncio.run(together())
    assert results == solo
    assert len({tuple(r) for r in results}) == 4
    assert stack.wait_idle() == {name: 0 for name in stack.live()}


def test_a_client_that_leaves_its_answers_untaken_holds_back_its_own_audio(stack, golden):
    """All the audio sent ahead and no answer taken for a while: the frames waiting in the server stay at the
    bound (not the 65 the audio makes), and once taken the answers equal those of a client that read as it went."""
    requests = [configure(seed=0), *chunks(golden[0]["waveform"]), flush()]
    reading = converse(stack.address, requests)
    stack.conversation.max_queued_frames = 3
    try:
        # no BDP probing: the client's receive window stays at its initial 64 KB, about 9 frames of tiny's answers
        with grpc.insecure_channel(stack.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
            responses = conversation_pb2_grpc.ConversationServiceStub(channel).Converse(iter(requests), timeout=120)
            got = [describe(next(responses))]  # ready: the conversation is open
            queued = []
            for _ in range(100):  # 2 s without taking an answer
                queued.append(stack.conversation.queued_frames)
                time.sleep(0.02)
            gauge = stack.conversation.metrics.registry.get_sample_value("voicechat_queued_frames",
                                                                          {"service": "orchestrator"})
            got += [describe(r) for r in responses]
    finally:
        stack.conversation.max_queued_frames = MAX_QUEUED_FRAMES
    assert max(queued) == queued[-1] == gauge == 3  # one chunk is one frame here: the bound exactly, and held
    assert got == reading and got[-1] == ("done", golden[1]["frames"])
    assert stack.conversation.queued_frames == 0


def test_bad_input_gets_an_error_event_and_the_conversation_goes_on(stack, golden):
    wave = golden[0]["waveform"][: N * 4]
    clean = converse(stack.address, [configure(seed=2), *chunks(wave), flush()])
    got = converse(stack.address, [
        configure(seed=2),
        audio(wave[:N], rate=8000),
        audio(np.array([0.0, np.nan], np.float32)),
        pb.ConverseRequest(audio=pb.AudioIn(pcm16=b"\x00\x01\x02")),
        *chunks(wave),
        flush(),
        audio(wave[:N]),
    ])
    errors = [e for e in got if e[0] == "error"]
    assert [e[1] for e in errors] == ["ERROR_CODE_INVALID_REQUEST"] * 4
    assert "8000" in errors[0][2] and "non-finite" in errors[1][2] and "even" in errors[2][2]
    assert "after Flush" in errors[3][2]
    assert [e for e in got if e[0] != "error"] == clean and got[-1] == ("done", 4)  # Done stays last


def test_configure_errors_and_the_streaming_limit(stack, golden):
    wave = golden[0]["waveform"][: N * 5]
    got = converse(stack.address, [audio(wave[:N]), configure(sample_rate_hz=8000),
                                   configure(max_streaming_seconds=0.2), *chunks(wave), flush()])
    assert [e[:2] for e in got[:2]] == [("error", "ERROR_CODE_INVALID_REQUEST"),
                                        ("error", "ERROR_CODE_SESSION_INITIALIZATION_FAILED")]
    assert got[2] == ("ready",)
    assert got[-1][:2] == ("error", "ERROR_CODE_LIMIT_EXCEEDED") and "max_streaming_seconds" in got[-1][2]
    assert [e[1] for e in got if e[0] == "audio"] == [0, 1]  # int(0.2 / 0.08) frames ran
    assert stack.wait_idle() == {name: 0 for name in stack.live()}


def test_cancel_ends_with_cancelled(stack, golden):
    wave = golden[0]["waveform"][: N * 3 + 100]
    got = converse(stack.address, [configure(), *chunks(wave), pb.ConverseRequest(cancel=pb.Cancel())])
    assert got[-1][0] == "cancelled" and got[-1][1] == len([e for e in got if e[0] == "audio"])


def test_a_client_that_vanishes_frees_every_session_and_busy_beyond_the_limit(stack, golden):
    wave = golden[0]["waveform"]
    release = threading.Event()

    def held(k):
        yield configure(seed=k)
        yield from chunks(wave[: N * 3])
        release.wait(30)  # the client keeps the stream open, then vanishes

    channels = [grpc.insecure_channel(stack.address) for _ in range(4)]
    calls = [conversation_pb2_grpc.ConversationServiceStub(c).Converse(held(k)) for k, c in enumerate(channels)]
    try:
        for call in calls:  # each conversation is running: ready, then the events of its first frame
            assert next(call).WhichOneof("event") == "ready"
            assert any(next(call).WhichOneof("event") == "audio" for _ in range(6))
        live = stack.live()
        assert live["conversation"] == 4 and all(live[name] == 4 for name in ("perception", "llm", "tts", "codec"))
        assert converse(stack.address, [configure()])[0][:2] == ("error", "ERROR_CODE_SERVER_BUSY")
        for call in calls:
            call.cancel()
        assert stack.wait_idle() == {name: 0 for name in stack.live()}
        assert converse(stack.address, [configure(), *chunks(wave[:N]), flush()])[-1] == ("done", 1)
    finally:
        release.set()
        for channel in channels:
            channel.close()


@pytest.mark.parametrize("flags", [[], ["--in-process"]])
def test_orchestrator_serve_end_to_end(tiny_checkpoint, golden, flags):
    import signal
    import subprocess
    import sys

    from services.common.cli import parse_ready_line

    process = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--model", str(tiny_checkpoint),
                                "--host", HOST, "--port", "0", "--max-sessions", "2", "--realtime-port", "0",
                                *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        realtime_line = process.stdout.readline()
        assert realtime_line.startswith("realtime on ws://"), realtime_line + process.stderr.read()
        ready = parse_ready_line(process.stdout.readline())
        assert ready is not None, process.stderr.read()
        assert realtime_hello(realtime_line.split()[-1]) == ("session.created", "session.pong")
        wave = golden[0]["waveform"][: N * 3]
        got = converse(f"{HOST}:{ready[1]}", [configure(), *chunks(wave), flush()])
        assert got[0] == ("ready",) and got[-1] == ("done", 3)
        assert [e[1] for e in got if e[0] == "audio"] == [0, 1, 2]
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(30)
    assert code == 0, process.stderr.read()


def realtime_hello(url: str) -> tuple[str, str]:
    """The gateway `orchestrator serve` runs beside the gRPC service answers on its own port."""
    import json

    from websockets.sync.client import connect

    with connect(url) as socket:
        created = json.loads(socket.recv(timeout=10))["type"]
        socket.send(json.dumps({"type": "session.ping"}))
        return created, json.loads(socket.recv(timeout=10))["type"]


def test_a_prompt_the_language_service_refuses_and_a_nan_limit_can_be_configured_again(stack, golden):
    wave = golden[0]["waveform"][:N]
    got = converse(stack.address, [configure(system_prompt="hello there " * 2000),
                                   configure(max_streaming_seconds=float("nan")), configure(), *chunks(wave), flush()])
    assert got[0][:2] == ("error", "ERROR_CODE_SESSION_INITIALIZATION_FAILED") and "the llm service" in got[0][2]
    assert got[1][:2] == ("error", "ERROR_CODE_SESSION_INITIALIZATION_FAILED")
    assert "Configure.max_streaming_seconds nan" in got[1][2]
    assert got[2] == ("ready",) and got[-1] == ("done", 1)
    assert stack.wait_idle() == {name: 0 for name in stack.live()}


def test_a_windowed_conversation_rebuilds_the_reference_texts(stack, golden, tiny_checkpoint):
    """A servicer with text_window=20 beside the stack's: the text messages past the window carry their start,
    and the texts rebuilt from them are the reference's; bench.load's client rebuilds the transcript the same way
    (tests/parity/test_online_parity.py bounds the events' size)."""
    import asyncio as aio

    from bench.load import Conversation, grpc_conversation

    arrays, meta = golden
    windowed = ConversationServicer(stack.clients, tiny_checkpoint, max_sessions=2, max_streaming_seconds=30.0,
                                    text_window=20)
    address = stack.run(stack._serve("windowed", registrations(windowed), [SERVICE_NAME], None))
    with grpc.insecure_channel(address) as channel:
        stub = conversation_pb2_grpc.ConversationServiceStub(channel)
        responses = list(stub.Converse(iter([configure(seed=0), *chunks(arrays["waveform"]), flush()]), timeout=120))
    held, starts = {"transcript": "", "text": "", "function": ""}, 0
    for response in responses:
        kind = response.WhichOneof("event")
        if kind not in held:
            continue
        m = getattr(response, kind)
        text, start = (m.transcript, m.transcript_start) if kind == "transcript" else (m.text, m.text_start)
        assert start <= len(held[kind])
        held[kind] = held[kind][:start] + text
        starts += start > 0
    assert (held["transcript"], held["text"], held["function"]) == (meta["transcript"], meta["text"],
                                                                    meta["function_text"])
    assert starts >= 40  # of about 110 text messages
    talk = Conversation(arrays["waveform"], seed=0)
    outcome = aio.run(grpc_conversation(address, talk, pace="burst"))
    assert outcome.done and outcome.transcript == meta["transcript"], outcome.errors


def test_prime_opens_one_conversation_in_every_service_and_closes_it(stack, tiny_checkpoint, monkeypatch, caplog):
    """`prime` (run before the ready line) opens a conversation with the defaults through every service and
    closes it, leaving every service as idle as before. A service that refuses is logged, not raised: the first
    conversation meets it as it would have."""
    servicer = ConversationServicer(stack.clients, tiny_checkpoint, max_sessions=1)
    opened = []
    for name in ("perception", "language", "speech", "codec"):
        client = getattr(stack.clients, name)
        method = "open_stream" if name == "codec" else "open"
        original = getattr(client, method)
        monkeypatch.setattr(client, method, lambda *a, _o=original, _n=name: opened.append(_n) or _o(*a))
    servicer.prime()
    assert sorted(opened) == ["codec", "language", "perception", "speech"]
    assert stack.wait_idle() == {name: 0 for name in stack.live()}

    def refuse(*_):
        raise ServiceError("the language service is restarting")

    monkeypatch.setattr(stack.clients.language, "open", refuse)
    with caplog.at_level("WARNING"):
        servicer.prime()
    assert "opening a first conversation at start failed: the language service is restarting" in caplog.text
    assert stack.wait_idle() == {name: 0 for name in stack.live()}
