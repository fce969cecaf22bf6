"""The browser client in a real browser: Debian's Chromium, headless, with a fake microphone playing
examples/question.wav, talks to the gateway (API key and allowed origins on) over the tiny checkpoint.

The fake device runs in real time and the browser's audio processing (echo cancellation, noise suppression, gain)
changes the samples, so the page records the PCM16 it actually sent (?record=1); examples/realtime_file_client.py
then sends those same samples with the same seed, and the page must show the same transcript, answer and function
text and have played exactly the answer's audio, frame for frame. A wrong key and a foreign origin show as plain
errors; and over https (a scripted wss:// server) the page shows tool calls, error events and the server's latency.

Needs /usr/bin/chromium (apt-get install chromium) and the Python driver (pip install '.[browser]'); without either
the test skips and says which. VOICECHAT_SCREENSHOT=PATH saves the finished page as a PNG (docs/browser-client.png).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from http import HTTPStatus
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from websockets.asyncio.server import serve

from orchestrator import web
from orchestrator.audio import read_audio
from orchestrator.local import LocalEngines
from orchestrator.realtime import OnlineSessionFactory, RealtimeServer
from tests.conftest import QUESTION_WAV, ROOT

CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
KEY = "browser-test-key"
PROMPT = "Be concise and answer in one sentence."
SEED = 1
FRAME_OUT = 1764
MIC_SECONDS = 3.0  # the question and some silence after it
ENDED = "#state[data-state=finished], #state[data-state=error]"

sync_api = pytest.importorskip("playwright.sync_api",
                               reason="the browser test drives Chromium with playwright: pip install '.[browser]'")
if not CHROMIUM.exists():
    pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium (or set CHROMIUM=PATH)",
                allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopThread:
    """An event loop in a background thread, for servers beside a synchronous browser driver."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@contextlib.contextmanager
def served(factory, **kwargs):
    """A RealtimeServer on a LoopThread."""
    loop, server = LoopThread(), RealtimeServer(factory, **kwargs)
    try:
        yield loop.run(server.start())
    finally:
        loop.run(server.stop())
        loop.close()


@pytest.fixture(scope="module")
def factory(tiny_checkpoint):
    engines = LocalEngines(tiny_checkpoint)
    yield OnlineSessionFactory(engines.clients(), tiny_checkpoint)
    engines.close()


@pytest.fixture
def microphone(tmp_path) -> Path:
    """The fake microphone's file: the question then silence, played once (%noloop)."""
    samples = read_audio(QUESTION_WAV, 16_000)
    samples = np.concatenate([samples, np.zeros(round(MIC_SECONDS * 16_000) - len(samples), np.float32)])
    path = tmp_path / "mic.wav"
    sf.write(path, samples, 16_000, subtype="PCM_16")
    return path


@contextlib.contextmanager
def browser_page(microphone: Path, *flags: str):
    """A new page in headless Chromium whose microphone plays `microphone` once."""
    with sync_api.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=str(CHROMIUM), args=[
            *CHROMIUM_FLAGS, f"--use-file-for-fake-audio-capture={microphone}%noloop", *flags])
        try:
            context = browser.new_context(viewport={"width": 900, "height": 300})  # the page's CSP in force
            yield context.new_page()
        finally:
            browser.close()


def start(page, url: str, key: str, seed: int = SEED) -> None:
    page.goto(url)
    page.fill("#prompt", PROMPT)
    page.fill("#seed", str(seed))
    page.fill("#key", key)
    page.click("#start")


def run_page(url: str, microphone: Path, frames: int) -> dict:
    """Open the page, fill the settings, talk for `frames` appends, stop, and read what the page shows."""
    with browser_page(microphone) as page:
        start(page, url, KEY)
        deadline = time.monotonic() + 120
        while int(page.get_attribute("#stats", "data-sent-chunks")) < frames and time.monotonic() < deadline:
            if page.get_attribute("#state", "data-state") == "error":
                break
            page.wait_for_timeout(50)
        page.click("#stop")
        page.wait_for_selector(ENDED, timeout=120_000)
        shown = {name: page.text_content(f"#{name}") for name in ("state", "transcript", "answer", "function",
                                                                  "errors")}
        shown["stats"] = page.eval_on_selector("#stats", "e => ({...e.dataset})")
        shown["sent"] = np.frombuffer(base64.b64decode(page.evaluate("window.voicechat.sentAudio()")), "<i2")
        if os.environ.get("VOICECHAT_SCREENSHOT"):
            page.screenshot(path=os.environ["VOICECHAT_SCREENSHOT"], full_page=True)
        return shown


def file_client(url: str, samples: np.ndarray, tmp_path: Path) -> tuple[str, np.ndarray]:
    """examples/realtime_file_client.py on `samples` (PCM16 at 16 kHz): its stdout and the answer's PCM16."""
    source, out = tmp_path / "sent.wav", tmp_path / "answer.wav"
    sf.write(source, samples, 16_000, subtype="PCM_16")
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "realtime_file_client.py"), url, str(source),
                             str(out), "--system-prompt", PROMPT, "--seed", str(SEED), "--extra-seconds", "0",
                             "--api-key", KEY], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout, sf.read(out, dtype="int16")[0]


def test_the_page_shows_and_plays_what_the_file_client_gets_for_the_same_samples(factory, microphone, tmp_path):
    port = free_port()
    origin = f"http://127.0.0.1:{port}"
    frames = round(MIC_SECONDS * 16_000 / 1280)
    with served(factory, port=port, api_key=KEY, allowed_origins=[origin]) as server:
        shown = run_page(f"{origin}/?record=1", microphone, frames)
        assert shown["state"] == "finished", shown["errors"]
        assert shown["errors"] == ""
        sent = shown["sent"]
        stats = {name: int(value) for name, value in shown["stats"].items() if value != ""}
        assert len(sent) == stats["sentChunks"] * 1280 and stats["sentChunks"] >= frames
        assert np.abs(sent).max() > 1000  # the microphone's speech went out, not silence

        stdout, answer = file_client(server.url, sent, tmp_path)

    assert stdout.startswith(shown["answer"] + "\n")
    assert f"\n[user] {shown['transcript']}\n" in stdout
    assert (f"\n[function] {shown['function']}\n" in stdout) == bool(shown["function"])
    # one answer frame per input frame, every one of them played, and none twice
    assert len(answer) == stats["sentChunks"] * FRAME_OUT
    assert stats["framesReceived"] == stats["sentChunks"]
    assert stats["samplesPlayed"] == len(answer)
    assert stats["bufferMs"] == 0


def test_a_wrong_key_a_foreign_origin_and_a_bad_setting_are_shown_plainly(factory, microphone):
    port = free_port()
    with served(factory, port=port, api_key=KEY, allowed_origins=[f"http://127.0.0.1:{port}"]) as server:
        with browser_page(microphone) as page:
            shown = []
            for url, key, seed in ((f"http://127.0.0.1:{port}/", "wrong", 0), (f"http://localhost:{port}/", KEY, 0),
                                   (f"http://127.0.0.1:{port}/", KEY, -1)):
                start(page, url, key, seed)
                page.wait_for_selector("#state[data-state=error]")
                shown.append(page.text_content("#errors"))
        assert server.live_sessions == 0
    assert shown == [
        "the server refused a session token: HTTP 401 missing or wrong API key: send `Authorization: Bearer <key>`",
        f"the server refused a session token: HTTP 403 origin http://localhost:{port} is not allowed on this server",
        "session_initialization_failed: session.seed must be a non-negative integer, got -1"]


# ------------------------------------------------------------------ events the tiny model does not make, over TLS

TOOL_CALL = {"type": "response.function_call_arguments.done", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'}
SCRIPT = [  # what the scripted server answers the first append with
    {"type": "conversation.item.input_audio_transcription.delta", "frame_index": 0, "delta": "hi", "transcript": "hi"},
    {"type": "response.text.delta", "frame_index": 0, "token_id": 1, "delta": "Sunny", "text": "Sunny"},
    {"type": "response.function.delta", "frame_index": 0, "token_id": 2, "delta": "<call>", "text": "<call>"},
    TOOL_CALL,
    {"type": "response.audio.delta", "frame_index": 0, "latency_ms": 42, "format": "pcm16", "sample_rate": 22050,
     "channels": 1, "delta": base64.b64encode(np.full(FRAME_OUT, 1000, "<i2").tobytes()).decode()},
    {"type": "error", "error": {"code": "inference_error", "message": "the tts service stopped responding"}},
]


async def scripted_server(certificate: Path, key: Path):
    """A wss:// server on a free port that serves the page and answers its first append with SCRIPT and its
    commit with response.done."""
    def process_request(connection, request):
        if request.path == "/v1/realtime/sessions":
            return web.json_response(connection, HTTPStatus.OK, {"client_secret": {"value": "ek_x", "expires_at": 0}})
        name = web.page_name(request.path.split("?")[0], "")
        return web.file_response(connection, name) if name else None

    async def conversation(ws):
        await ws.send(json.dumps({"type": "session.created", "session": {}}))
        assert json.loads(await ws.recv())["type"] == "session.update"
        await ws.send(json.dumps({"type": "session.updated", "session": {}}))
        scripted = False
        async for frame in ws:
            kind = json.loads(frame)["type"]
            if kind == "input_audio_buffer.append" and not scripted:
                scripted = True
                for event in SCRIPT:
                    await ws.send(json.dumps(event))
            elif kind == "input_audio_buffer.commit":
                await ws.send(json.dumps({"type": "response.done", "frame_index": 1}))
                await ws.close()

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificate, key)
    return await serve(conversation, "127.0.0.1", 0, ssl=context, process_request=process_request,
                       select_subprotocol=lambda connection, offered: "realtime")


@pytest.fixture
def certificate(tmp_path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make the TLS test's certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_over_https_the_page_uses_wss_and_shows_tool_calls_errors_and_the_servers_latency(microphone, certificate):
    loop = LoopThread()
    server = loop.run(scripted_server(*certificate))
    try:
        port = server.sockets[0].getsockname()[1]
        with browser_page(microphone, "--ignore-certificate-errors") as page:
            start(page, f"https://127.0.0.1:{port}/", "")
            page.wait_for_selector("#errors:not([hidden])")
            page.click("#stop")
            page.wait_for_selector(ENDED)
            shown = {name: page.text_content(f"#{name}") for name in ("state", "transcript", "answer", "function",
                                                                      "tools", "errors")}
            stats = page.eval_on_selector("#stats", "e => ({...e.dataset})")
    finally:
        server.close()
        loop.run(server.wait_closed())
        loop.close()
    assert shown == {"state": "finished", "transcript": "hi", "answer": "Sunny", "function": "<call>",
                     "tools": 'get_weather({"city": "Paris"})',
                     "errors": "inference_error: the tts service stopped responding"}
    assert (stats["latencyMs"], stats["framesReceived"], stats["samplesPlayed"]) == ("42", "1", str(FRAME_OUT))
