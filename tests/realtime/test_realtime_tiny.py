"""The gateway over the tiny checkpoint's engines (in-process): a real `websockets` client driving
examples/question.wav gets the transcript, text, function text, codes, frame count and audio (within one PCM16
step) of an OnlineSession run directly on the same input and seed, whatever the append sizes; the file client
does the same as a separate process."""

from __future__ import annotations

import asyncio
import base64
import sys

import numpy as np
import pytest
import soundfile as sf

from orchestrator.audio import read_audio
from orchestrator.local import LocalEngines
from orchestrator.realtime import OnlineSessionFactory, RealtimeServer
from tests.conftest import QUESTION_WAV, ROOT
from tests.realtime.fakes import Client, pcm16_b64, wait_for

PROMPT = "Be concise and answer in one sentence."
EXTRA_SECONDS = 1.0
STEP = 1.0 / 32767  # one PCM16 step on the wire
KINDS = {"user_transcript_delta": "conversation.item.input_audio_transcription.delta",
         "assistant_text_delta": "response.text.delta", "function_delta": "response.function.delta",
         "audio": "response.audio.delta", "done": "response.done"}


@pytest.fixture(scope="module")
def factory(tiny_checkpoint):
    engines = LocalEngines(tiny_checkpoint)
    yield OnlineSessionFactory(engines.clients(), tiny_checkpoint)
    engines.close()


@pytest.fixture(scope="module")
def waveform():
    samples = read_audio(QUESTION_WAV, 16_000)
    return np.concatenate([samples, np.zeros(round(EXTRA_SECONDS * 16_000), np.float32)])


def direct(factory, waveform, seed, prompt):
    session = factory(system_prompt=prompt, seed=seed, max_streaming_seconds=600.0)
    events = []
    for start in range(0, len(waveform), 1280):
        events += session.push_audio(waveform[start:start + 1280], 16_000)
    return events + session.flush(True)


@pytest.fixture(scope="module")
def expected(factory, waveform):
    return {seed: direct(factory, waveform, seed, PROMPT) for seed in (0, 1)}


async def converse(server, waveform, chunk, seed, prompt=PROMPT):
    client = await Client.open(server.url)
    updated = await client.configure(system_prompt=prompt, seed=seed)
    for start in range(0, len(waveform), chunk):
        await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(waveform[start:start + chunk])})
    await client.send({"type": "input_audio_buffer.commit"})
    events = await client.rest(timeout=120)
    return updated, events, client.close_code


def check_same(events, reference):
    """The wire events against the session's, field by field; audio within one PCM16 step."""
    events = [e for e in events if e["type"] != "input_audio_buffer.committed"]
    assert [e["type"] for e in events] == [KINDS[e.kind] for e in reference]
    for got, want in zip(events, reference, strict=True):
        assert got["frame_index"] == want.frame_index
        if want.kind == "audio":
            assert got["audio_codes"] == want.audio_codes.tolist()
            pcm = np.frombuffer(base64.b64decode(got["delta"]), "<i2").astype(np.float64) / 32767
            assert pcm.shape == want.samples.shape
            assert np.abs(pcm - np.clip(want.samples, -1, 1)).max() <= STEP * 0.5 + 1e-7
        elif want.kind != "done":
            assert got["delta"] == want.delta
            assert got.get("text", got.get("transcript")) == want.text
            if want.kind != "user_transcript_delta":
                assert got["token_id"] == want.token_id


@pytest.mark.parametrize("chunk", [1280, 4001])
def test_question_over_the_socket_equals_the_session(factory, waveform, expected, chunk):
    async def main():
        async with RealtimeServer(factory) as server:
            result = await converse(server, waveform, chunk, seed=0)
            assert server.live_sessions == 0
            return result

    updated, events, code = asyncio.run(main())
    assert updated["session"]["model"] == factory.model_id and updated["session"]["frame_samples"] == 1280
    assert [e["type"] for e in events].count("input_audio_buffer.committed") == 1
    check_same(events, expected[0])
    frames = [e for e in events if e["type"] == "response.audio.delta"]
    assert len(frames) == int(np.ceil(len(waveform) / 1280)) and events[-1]["type"] == "response.done"
    assert code == 1000


def test_the_seed_reaches_the_session(factory, waveform, expected):
    async def main():
        async with RealtimeServer(factory) as server:
            return await converse(server, waveform, 2560, seed=1)

    _, events, _ = asyncio.run(main())
    check_same(events, expected[1])
    codes = [e.audio_codes.tolist() for e in expected[0] if e.kind == "audio"]
    assert codes != [e.audio_codes.tolist() for e in expected[1] if e.kind == "audio"]


def test_a_dropped_real_session_frees_the_slot_and_the_next_one_is_normal(factory, waveform, expected):
    async def main():
        async with RealtimeServer(factory) as server:
            client = await Client.open(server.url)
            await client.configure(system_prompt=PROMPT)
            await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(waveform[:6400])})
            await client.until("response.audio.delta")
            client.ws.transport.abort()
            await wait_for(lambda: server.live_sessions == 0, timeout=30)
            return await converse(server, waveform, 1280, seed=0)

    _, events, code = asyncio.run(main())
    check_same(events, expected[0])
    assert code == 1000


def test_the_file_client_against_a_served_checkpoint(factory, waveform, expected, tmp_path):
    out = tmp_path / "response_ws.wav"

    async def main():
        async with RealtimeServer(factory) as server:
            process = await asyncio.create_subprocess_exec(
                sys.executable, str(ROOT / "examples" / "realtime_file_client.py"), server.url, str(QUESTION_WAV),
                str(out), "--system-prompt", PROMPT, "--seed", "0", "--extra-seconds", str(EXTRA_SECONDS),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT))
            stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
            return process.returncode, stdout.decode(), stderr.decode()

    code, stdout, stderr = asyncio.run(main())
    assert code == 0, stderr
    reference = expected[0]
    text = next((e.text for e in reversed(reference) if e.kind == "assistant_text_delta"), "")
    transcript = next((e.text for e in reversed(reference) if e.kind == "user_transcript_delta"), "")
    assert stdout.startswith(text + "\n") and f"\n[user] {transcript}\n" in stdout
    function = next((e.text for e in reversed(reference) if e.kind == "function_delta"), "")
    assert (f"[function] {function}\n" in stdout) == bool(function)
    data, rate = sf.read(out, dtype="int16")
    info = sf.info(out)
    assert (rate, info.channels, info.subtype) == (22050, 1, "PCM_16")
    audio = np.concatenate([e.samples for e in reference if e.kind == "audio"])
    assert data.shape == audio.shape
    assert np.abs(data / 32767 - np.clip(audio, -1, 1)).max() <= STEP * 0.5 + 1e-7
    assert "wrote" in stderr


def test_pipelined_sessions_send_the_same_events_in_the_same_order(factory, waveform, expected, tiny_checkpoint):
    pipelined = OnlineSessionFactory(factory.clients, tiny_checkpoint, pipelined=True)

    async def main():
        async with RealtimeServer(pipelined) as server:
            return await converse(server, waveform, 1280, seed=0)

    _, events, code = asyncio.run(main())
    check_same(events, expected[0])
    assert code == 1000


def test_a_windowed_session_sends_bounded_texts_that_the_file_client_rebuilds(factory, waveform, expected,
                                                                               tiny_checkpoint, tmp_path):
    windowed = OnlineSessionFactory(factory.clients, tiny_checkpoint, text_window=20)
    out = tmp_path / "response_ws.wav"

    async def main():
        async with RealtimeServer(windowed) as server:
            _, events, _ = await converse(server, waveform, 1280, seed=0)
            process = await asyncio.create_subprocess_exec(
                sys.executable, str(ROOT / "examples" / "realtime_file_client.py"), server.url, str(QUESTION_WAV),
                str(out), "--system-prompt", PROMPT, "--seed", "0", "--extra-seconds", str(EXTRA_SECONDS),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT))
            stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
            return events, process.returncode, stdout.decode(), stderr.decode()

    events, code, stdout, stderr = asyncio.run(main())
    keys = {"conversation.item.input_audio_transcription.delta": ("transcript", "transcript_start"),
            "response.text.delta": ("text", "text_start"), "response.function.delta": ("text", "text_start")}
    wire = [e for e in events if e["type"] in keys]
    reference = [e for e in expected[0] if e.kind in ("user_transcript_delta", "assistant_text_delta",
                                                      "function_delta")]
    held, windowed_events = dict.fromkeys(keys, ""), 0
    for got, want in zip(wire, reference, strict=True):
        text, start = keys[got["type"]]
        assert start not in got or got[start] > 0  # the key only past the window
        held[got["type"]] = held[got["type"]][:got.get(start, 0)] + got[text]
        assert held[got["type"]] == want.text
        windowed_events += start in got
    assert windowed_events >= 10 and max(len(e.get("text", e.get("transcript"))) for e in wire) < 200
    assert code == 0, stderr
    text = next(e.text for e in reversed(reference) if e.kind == "assistant_text_delta")
    transcript = next(e.text for e in reversed(reference) if e.kind == "user_transcript_delta")
    assert len(transcript) > 20 and stdout.startswith(text + "\n") and f"\n[user] {transcript}\n" in stdout
    function = next((e.text for e in reversed(reference) if e.kind == "function_delta"), "")
    assert (f"[function] {function}\n" in stdout) == bool(function)


def test_a_pipelined_session_takes_audio_sent_at_once_no_faster_than_it_runs(factory, waveform, expected,
                                                                            tiny_checkpoint, monkeypatch):
    """The whole question in one append: the gateway pushes its frames one by one, each time waiting while more
    than MAX_FRAMES_AHEAD (3 here) are still in the stages, and the events are the reference's."""
    monkeypatch.setattr("orchestrator.session.MAX_FRAMES_AHEAD", 3)
    pipelined = OnlineSessionFactory(factory.clients, tiny_checkpoint, pipelined=True)
    ahead: list[int] = []

    def watched(**options):
        session = pipelined(**options)
        push = session.push_audio

        def push_audio(samples, sample_rate=16_000):
            events = push(samples, sample_rate)
            ahead.append(session.frames_pushed - session.frame_index)  # frames in the stages after this push
            return events

        session.push_audio = push_audio
        return session

    for name in ("model_id", "frame_samples", "input_sample_rate", "output_sample_rate"):
        setattr(watched, name, getattr(pipelined, name))

    async def main():
        async with RealtimeServer(watched) as server:
            return await converse(server, waveform, len(waveform), seed=0)

    _, events, code = asyncio.run(main())
    check_same(events, expected[0])
    assert code == 1000
    assert len(ahead) >= len(waveform) // 1280 and max(ahead) <= 4
