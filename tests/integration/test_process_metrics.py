"""Prometheus metrics of real processes: the four services (`python -m services.NAME --metrics-port 0`) and
`orchestrator serve --services ... --metrics-port 0`, scraped over HTTP during and after a gRPC conversation and a
/v1/realtime session; servicer errors counted by status code; a busy metrics port; and the interceptor's counts on
an in-process server."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from websockets.sync.client import connect as ws_connect

from orchestrator.launcher import spawn_service, stop, wait_ready
from protos.voicechat.v1 import codec_pb2, codec_pb2_grpc, conversation_pb2_grpc, perception_pb2, perception_pb2_grpc
from protos.voicechat.v1 import conversation_pb2 as pb
from services.common.cli import parse_ready_line
from services.common.errors import LimitExceeded
from services.common.metrics import Metrics, parse_metrics_line, scrape
from services.common.server import full_service_name, start_server
from services.common.tensors import to_proto_np
from tests.conftest import load_golden

HOST = "127.0.0.1"
N = 1280
FRAMES = 6
# With a system prompt every frame has a speech step (without one, timeline position 0 is codec silence, no step).
PROMPT = "Be concise and answer in one sentence."
NETWORK = ("perception", "llm", "tts", "codec")
ROLES = (*NETWORK, "orchestrator")


def value(page: dict, name: str, service: str, **labels: str) -> float | None:
    return page.get((name, frozenset({"service": service, **labels}.items())))


class Processes:
    """The four services and `orchestrator serve` as child processes, each with its metrics URL."""

    def __init__(self, model):
        self.children = [spawn_service(name, model, ["--metrics-port", "0"]) for name in NETWORK]
        self.orchestrator: subprocess.Popen | None = None
        try:
            wait_ready(self.children, timeout_s=120)
            self.urls = {child.name: self._metrics_url(child) for child in self.children}
            services = ",".join(f"{child.name}={child.address}" for child in self.children)
            self.orchestrator = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.cli", "serve", "--model", str(model), "--services", services,
                 "--host", HOST, "--port", "0", "--realtime-port", "0", "--metrics-port", "0"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            lines = [self.orchestrator.stdout.readline() for _ in range(3)]
            assert lines[0].startswith("realtime on ws://"), lines[0] + self._stderr()
            ready = parse_ready_line(lines[1])
            assert ready is not None, lines[1] + self._stderr()
            self.realtime_url = lines[0].split()[-1]
            self.address = f"{HOST}:{ready[1]}"
            self.urls["orchestrator"] = parse_metrics_line(lines[2])
            assert self.urls["orchestrator"] == f"http://{HOST}:{_port(lines[2])}/metrics", lines[2]
            self.addresses = {child.name: child.address for child in self.children}
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _metrics_url(child) -> str:
        deadline = time.monotonic() + 10
        while not child.metrics_url:  # printed right after the ready line the launcher has already read
            assert time.monotonic() < deadline, f"{child.name} printed no metrics line: {child.tail()}"
            time.sleep(0.02)
        assert child.metrics_url.startswith(f"http://{HOST}:") and child.metrics_url.endswith("/metrics")
        return child.metrics_url

    def _stderr(self) -> str:
        self.orchestrator.kill()
        return self.orchestrator.communicate(timeout=30)[1]

    def pages(self) -> dict[str, dict]:
        return {role: scrape(url) for role, url in self.urls.items()}

    def active(self) -> dict[str, float]:
        return {role: value(page, "voicechat_active_sessions", role) for role, page in self.pages().items()}

    def wait_idle(self, timeout_s: float = 15.0) -> dict[str, float]:
        """The active-session gauges once every process has freed its sessions (closing runs after the end)."""
        deadline = time.monotonic() + timeout_s
        while any(self.active().values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.active()

    def close(self) -> None:
        if self.orchestrator is not None and self.orchestrator.poll() is None:
            self.orchestrator.send_signal(signal.SIGTERM)
            self.orchestrator.wait(30)
        stop(self.children)


def _port(line: str) -> int:
    return int(line.strip().rsplit(":", 1)[1].split("/")[0])


@pytest.fixture(scope="module")
def processes(tiny_checkpoint):
    processes = Processes(tiny_checkpoint)
    yield processes
    processes.close()


@pytest.fixture(scope="module")
def waveform():
    return load_golden("online")[0]["waveform"]


def configure(**kwargs):
    return pb.ConverseRequest(configure=pb.Configure(**kwargs))


def audio(samples):
    return pb.ConverseRequest(audio=pb.AudioIn(float32=to_proto_np(np.asarray(samples, np.float32))))


def frames_and_counts(page: dict, role: str) -> tuple[float, float, float]:
    return (value(page, "voicechat_frames_total", role), value(page, "voicechat_frame_seconds_count", role),
            value(page, "voicechat_frames_over_budget_total", role))


def test_a_conversation_is_counted_on_every_process(processes, waveform):
    before = processes.pages()
    for role in ROLES:  # fresh processes: nothing counted yet
        assert frames_and_counts(before[role], role) == (0, 0, 0), role
        assert value(before[role], "voicechat_active_sessions", role) == 0, role
    release = threading.Event()

    def requests():
        yield configure(seed=0, system_prompt=PROMPT)
        for i in range(FRAMES):
            yield audio(waveform[i * N : (i + 1) * N])
        release.wait(60)  # the conversation stays open while the test scrapes
        yield pb.ConverseRequest(flush=pb.Flush())

    with grpc.insecure_channel(processes.address) as channel:
        call = conversation_pb2_grpc.ConversationServiceStub(channel).Converse(requests(), timeout=120)
        kinds = []
        try:
            while kinds.count("audio") < FRAMES:  # every pushed frame's events are out
                kinds.append(next(call).WhichOneof("event"))
            assert kinds[0] == "ready" and "error" not in kinds
            during = processes.active()
        finally:
            release.set()
        kinds += [response.WhichOneof("event") for response in call]
    assert during == {role: 1 for role in ROLES}
    assert kinds[-1] == "done" and kinds.count("audio") == FRAMES

    assert processes.wait_idle() == {role: 0 for role in ROLES}
    after = processes.pages()
    for role in ROLES:
        frames, timed, over = frames_and_counts(after[role], role)
        assert frames == FRAMES and timed == frames, (role, frames, timed)
        assert 0 <= over <= frames
        assert value(after[role], "voicechat_frame_seconds_sum", role) > 0
        inf = value(after[role], "voicechat_frame_seconds_bucket", role, le="+Inf")
        assert inf == frames


def test_a_realtime_session_is_counted_on_every_process(processes, waveform):
    before = processes.pages()
    pcm = (np.clip(waveform[: 2 * N], -1, 1) * 32767).astype("<i2")
    with ws_connect(processes.realtime_url) as socket_:
        assert json.loads(socket_.recv(timeout=30))["type"] == "session.created"
        socket_.send(json.dumps({"type": "session.update", "session": {"seed": 0, "system_prompt": PROMPT}}))
        assert json.loads(socket_.recv(timeout=60))["type"] == "session.updated"
        during = processes.active()
        for i in range(2):
            chunk = base64.b64encode(pcm[i * N : (i + 1) * N].tobytes()).decode()
            socket_.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        socket_.send(json.dumps({"type": "input_audio_buffer.commit"}))
        kinds = []
        while not kinds or kinds[-1] not in ("response.done", "error"):
            kinds.append(json.loads(socket_.recv(timeout=60))["type"])
    assert kinds[-1] == "response.done" and kinds.count("response.audio.delta") == 2
    assert during == {role: 1 for role in ROLES}
    assert processes.wait_idle() == {role: 0 for role in ROLES}
    after = processes.pages()
    for role in ROLES:
        grew = [a - b for a, b in zip(frames_and_counts(after[role], role), frames_and_counts(before[role], role),
                                      strict=True)]
        assert grew[:2] == [2, 2], (role, grew)


def test_errors_are_counted_by_code(processes, waveform):
    before = processes.pages()
    frame = perception_pb2.PerceptionStreamRequest(frame=perception_pb2.PerceptionFrameInput(
        frame_index=0, samples=to_proto_np(np.zeros(N, np.float32))))
    with grpc.insecure_channel(processes.addresses["perception"]) as channel:
        with pytest.raises(grpc.RpcError) as caught:  # a frame before `open`
            list(perception_pb2_grpc.PerceptionServiceStub(channel).Stream(iter([frame]), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(processes.address) as channel:  # audio before Configure, then a vanished client
        got = list(conversation_pb2_grpc.ConversationServiceStub(channel).Converse(
            iter([audio(waveform[:N])]), timeout=30))
    assert [r.error.code for r in got] == [pb.ERROR_CODE_INVALID_REQUEST]
    with ws_connect(processes.realtime_url) as socket_:
        socket_.recv(timeout=30)
        socket_.send(json.dumps({"type": "input_audio_buffer.commit"}))  # before session.update
        assert json.loads(socket_.recv(timeout=30))["error"]["code"] == "invalid_request"
    after = processes.pages()

    def grew(role: str, code: str) -> float:
        return (value(after[role], "voicechat_errors_total", role, code=code) or 0) - (
            value(before[role], "voicechat_errors_total", role, code=code) or 0)

    assert grew("perception", "INVALID_ARGUMENT") == 1
    assert grew("orchestrator", "ERROR_CODE_INVALID_REQUEST") == 1
    assert grew("orchestrator", "invalid_request") == 1
    for role in ("llm", "tts", "codec"):
        assert not any(name == "voicechat_errors_total" for name, _ in after[role]), role


def test_a_busy_metrics_port_is_a_clear_startup_error(tiny_checkpoint, capsys):
    from orchestrator.cli import main

    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "services.codec", "--model", str(tiny_checkpoint),
                                 "--host", HOST, "--port", "0", "--metrics-port", str(port)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.strip() == (f"services.codec: error: cannot serve metrics on {HOST}:{port}: "
                                         "Address already in use (is the port in use?)")
        code = main(["serve", "--model", str(tiny_checkpoint), "--host", HOST, "--metrics-port", str(port)])
    assert code == 2  # refused before any service started, with the port-in-use exit code
    assert capsys.readouterr().err.strip() == (f"error: cannot serve metrics on {HOST}:{port}: Address already in use "
                                               "(is the port in use?)")


class RaisingCodec(codec_pb2_grpc.CodecServiceServicer):
    """Each unary method raises what the interceptor maps to one status code."""

    async def Encode(self, request, context):
        raise ValueError("bad waveform")

    async def Decode(self, request, context):
        raise LimitExceeded("too many frames")

    async def PromptCodes(self, request, context):
        raise RuntimeError("exploded")


def test_the_interceptor_counts_each_mapped_status_code():
    metrics = Metrics("codec")
    name = full_service_name(codec_pb2, "CodecService")

    async def main() -> dict[str, grpc.StatusCode]:
        running = await start_server([(codec_pb2_grpc.add_CodecServiceServicer_to_server, RaisingCodec())], [name],
                                     host=HOST, port=0, metrics=metrics)
        codes = {}
        try:
            async with grpc.aio.insecure_channel(f"{HOST}:{running.port}") as channel:
                stub = codec_pb2_grpc.CodecServiceStub(channel)
                calls = {"loading": lambda: stub.Encode(codec_pb2.CodecEncodeRequest()),
                         "encode": lambda: stub.Encode(codec_pb2.CodecEncodeRequest()),
                         "decode": lambda: stub.Decode(codec_pb2.CodecDecodeRequest()),
                         "prompt": lambda: stub.PromptCodes(codec_pb2.PromptCodesRequest())}
                for label, call in calls.items():
                    try:
                        await call()
                    except grpc.aio.AioRpcError as exc:
                        codes[label] = exc.code()
                    if label == "loading":
                        await running.set_serving(True)
        finally:
            await running.stop(0)
        return codes

    codes = asyncio.run(main())
    assert codes == {"loading": grpc.StatusCode.UNAVAILABLE, "encode": grpc.StatusCode.INVALID_ARGUMENT,
                     "decode": grpc.StatusCode.RESOURCE_EXHAUSTED, "prompt": grpc.StatusCode.INTERNAL}
    for code in codes.values():
        assert metrics.value("voicechat_errors_total", code=code.name) == 1, code
    assert metrics.value("voicechat_frames_total") == 0
