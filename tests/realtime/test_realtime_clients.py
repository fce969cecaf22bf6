"""The microphone client's audio path with a fake device stream (no PortAudio): block-wise resampling equal to
the whole-signal resampler, the playback ring buffer, event handling, a whole conversation against the gateway,
and --list-devices without a device; the file client's wire encoding and its refusal messages."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import sys
import threading
import time

import numpy as np
import pytest
from websockets.asyncio.client import connect

from orchestrator.audio import filter_reach, resample
from orchestrator.realtime import RealtimeServer
from tests.conftest import ROOT
from tests.realtime.fakes import FakeFactory, wait_for


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


mic = _load("realtime_microphone")
file_client = _load("realtime_file_client")


# ------------------------------------------------------------------------------------------- resampling


@pytest.mark.parametrize("source, target", [(48_000, 16_000), (44_100, 16_000), (22_050, 48_000), (16_000, 16_000),
                                            (8_000, 16_000)])
def test_block_resampling_equals_the_whole_signal(source, target):
    rng = np.random.default_rng(0)
    signal = rng.uniform(-0.5, 0.5, source // 2).astype(np.float32)  # half a second
    whole = resample(signal, source, target)
    resampler = mic.StreamResampler(source, target)
    out, start = [], 0
    for size in rng.integers(1, source // 25, 200):
        out.append(resampler.process(signal[start : start + size]))
        start += size
        if start >= len(signal):
            break
    out.append(resampler.process(signal[start:]))
    out.append(resampler.flush())
    got = np.concatenate(out)
    assert got.shape == whole.shape
    assert np.abs(got - whole).max() < 1e-5
    assert len(resampler.buffer) < source // 25 + 200  # history stays bounded


def test_capture_downmixes_resamples_and_frames_80_ms():
    capture = mic.Capture(48_000)
    left = np.sin(np.arange(48_000) * 0.01).astype(np.float32)
    stereo = np.stack([left, -0.5 * left], axis=1)
    frames = []
    for start in range(0, 48_000, 960):  # 20 ms device blocks
        frames += capture.push(stereo[start : start + 960])
    assert {len(f) for f in frames} == {1280}
    expected = resample(0.25 * left, 48_000, 16_000)
    got = np.concatenate(frames)
    assert len(got) == 12 * 1280  # 15984 samples are complete before the end; 12 whole frames
    assert np.abs(got - expected[: len(got)]).max() < 1e-5


def test_append_messages_round_trip_pcm16():
    samples = np.array([0.5, -1.0, 1.0, 3.0], np.float32)
    message = __import__("json").loads(mic.append_message(samples))
    assert message["type"] == "input_audio_buffer.append" and message["sample_rate"] == 16_000
    assert np.frombuffer(base64.b64decode(message["audio"]), "<i2").tolist() == [16384, -32768, 32767, 32767]


# ------------------------------------------------------------------------------------------ ring buffer


def test_ring_buffer_wraps_underruns_with_silence_and_drops_the_oldest():
    ring = mic.RingBuffer(8)
    ring.write(np.arange(1, 6, dtype=np.float32))
    assert ring.read(3).tolist() == [1, 2, 3]
    ring.write(np.arange(6, 11, dtype=np.float32))  # wraps around the end
    assert ring.read(7).tolist() == [4, 5, 6, 7, 8, 9, 10]
    assert ring.read(3).tolist() == [0, 0, 0] and ring.underruns == 1
    ring.write(np.arange(1, 13, dtype=np.float32))  # more than fits: the oldest go
    assert ring.dropped == 4 and ring.read(8).tolist() == list(range(5, 13))


def test_ring_buffer_between_threads_keeps_order():
    ring = mic.RingBuffer(1000)
    data = np.arange(1, 20_001, dtype=np.float32)
    got = []

    def reader():
        deadline = time.monotonic() + 10
        while sum(len(g) for g in got) < len(data) and time.monotonic() < deadline:
            block = ring.read(97)
            got.append(block[block > 0])  # underruns read as zeros

    thread = threading.Thread(target=reader)
    thread.start()
    for start in range(0, len(data), 300):
        while ring.size > 600:
            time.sleep(0.0005)
        ring.write(data[start : start + 300])
    thread.join(timeout=15)
    assert np.array_equal(np.concatenate(got), data) and ring.dropped == 0


# --------------------------------------------------------------------------------------- event handling


def test_display_prints_both_sides_and_queues_audio_for_the_speaker():
    ring, out = mic.RingBuffer(100_000), io.StringIO()
    display = mic.Display(ring, 44_100, out, io.StringIO())
    pcm = (np.sin(np.arange(1764) * 0.05) * 16000).astype("<i2")
    events = [
        {"type": "conversation.item.input_audio_transcription.delta", "frame_index": 3, "delta": "What",
         "transcript": "What"},
        {"type": "conversation.item.input_audio_transcription.delta", "frame_index": 5, "delta": " is",
         "transcript": "t is", "transcript_start": 3},  # past a --text-window: the text from character 3 on
        {"type": "response.text.delta", "frame_index": 8, "token_id": 5, "delta": "Paris", "text": "Paris"},
        {"type": "response.function.delta", "frame_index": 8, "token_id": 6, "delta": "f()", "text": "f()"},
        {"type": "response.text.delta", "frame_index": 9, "token_id": 7, "delta": ".", "text": "is.",
         "text_start": 3},
    ]
    for frame in range(10):
        events.insert(0, {"type": "response.audio.delta", "frame_index": frame, "format": "pcm16", "channels": 1,
                          "sample_rate": 22_050, "delta": base64.b64encode(pcm.tobytes()).decode(),
                          "audio_codes": [0] * 31})
    assert not any(display.handle(e) for e in events)
    assert display.handle({"type": "response.done", "frame_index": 10})
    assert out.getvalue() == "[user] What is\n[assistant] Paris\n[function] f()\n[assistant] .\n"
    assert (display.transcript, display.text) == ("What is", "Paris.")
    expected = resample(np.tile(pcm.astype(np.float32) / 32767, 10), 22_050, 44_100)
    queued = ring.read(ring.size)
    held_back = filter_reach(2, 1)  # the resampler holds back its filter's reach: 22.05 -> 44.1 kHz is up 2, down 1
    assert 0 <= len(expected) - len(queued) <= held_back
    assert np.abs(queued - expected[: len(queued)]).max() < 1e-5


def test_display_errors_and_busy():
    err = io.StringIO()
    display = mic.Display(mic.RingBuffer(10), 16_000, io.StringIO(), err)
    assert not display.handle({"type": "error", "error": {"code": "inference_error", "message": "bad"}})
    assert display.handle({"type": "error", "error": {"code": "server_busy", "message": "busy"}})
    assert "inference_error: bad" in err.getvalue() and len(display.errors) == 2


# ------------------------------------------------------------------------------------ a fake sounddevice


class FakeSoundDevice:
    """Devices, an input stream that plays `signal` into the callback from a thread, and an output stream that
    pulls 10 ms blocks and keeps them. `finished` is called once the input has been delivered."""

    def __init__(self, signal=None, rate=48_000, devices=None, finished=None):
        self.signal, self.rate, self.finished = signal, rate, finished
        self.devices = devices if devices is not None else [
            {"name": "Fake Mic", "max_input_channels": 2, "max_output_channels": 0, "default_samplerate": rate},
            {"name": "Fake Speaker", "max_input_channels": 0, "max_output_channels": 2,
             "default_samplerate": 44_100.0}]
        self.played: list[np.ndarray] = []
        self.opened: list[dict] = []

    def query_devices(self, device=None, kind=None):
        if kind is None:
            return self.devices
        return self.devices[0] if kind == "input" else self.devices[1]

    def InputStream(self, **kwargs):  # noqa: N802 - sounddevice's name
        self.opened.append({"input": kwargs})
        return _Stream(self._feed, kwargs)

    def OutputStream(self, **kwargs):  # noqa: N802
        self.opened.append({"output": kwargs})
        return _Stream(self._pull, kwargs)

    def _feed(self, stream):
        block = stream.kwargs["blocksize"]
        for start in range(0, len(self.signal), block):
            if stream.stopped.is_set():
                return
            stream.kwargs["callback"](self.signal[start : start + block], block, None, None)
            time.sleep(0.001)
        self.finished()

    def _pull(self, stream):
        while not stream.stopped.is_set():
            out = np.zeros((441, 1), np.float32)
            stream.kwargs["callback"](out, 441, None, None)
            self.played.append(out[:, 0].copy())
            time.sleep(0.001)


class _Stream:
    def __init__(self, run, kwargs):
        self.run, self.kwargs = run, kwargs
        self.stopped = threading.Event()

    def __enter__(self):
        self.thread = threading.Thread(target=self.run, args=(self,), daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join(timeout=5)

    def close(self):
        self.stopped.set()


def test_a_conversation_with_a_fake_microphone_and_speaker():
    rate, seconds = 48_000, 0.5
    t = np.arange(int(rate * seconds))
    left = (0.3 * np.sin(t * 0.02)).astype(np.float32)
    stereo = np.stack([left, left * 0.5], axis=1)
    factory = FakeFactory()

    async def main():
        async with RealtimeServer(factory) as server:
            loop = asyncio.get_running_loop()
            stop = asyncio.Event()
            sd = FakeSoundDevice(stereo, rate, finished=lambda: loop.call_soon_threadsafe(stop.set))
            out, err = io.StringIO(), io.StringIO()
            display = await mic.converse(server.url, sd, stop, system_prompt="Hi", seed=4, out=out, err=err)
            return display, sd, out.getvalue(), server.live_sessions

    display, sd, printed, live = asyncio.run(main())
    session = factory.sessions[0]
    assert session.options["system_prompt"] == "Hi" and session.options["seed"] == 4
    assert display.done is not None and display.done["type"] == "response.done" and not display.errors
    assert live == 0
    # what reached the server: 80 ms appends of the downmixed, resampled microphone
    sent = np.concatenate(session.pushes)
    expected = resample(0.75 * left, rate, 16_000)
    assert len(sent) % 1280 == 0 and len(sent) >= 1280 * 4
    assert np.abs(sent - expected[: len(sent)]).max() < 2 / 32768
    assert sd.opened[0]["input"]["samplerate"] == rate and sd.opened[0]["input"]["channels"] == 2
    assert sd.opened[1]["output"]["samplerate"] == 44_100
    # what the speaker played: the audio events, resampled to its rate, in order
    frames = []
    for samples in session.frames:  # what FakeSession made of each frame, through the wire's PCM16
        audio = np.full(1764, np.clip(samples[0] * 2.0, -1, 1), np.float32)
        audio[:4] = (-1.0, -1.0, 0.5, 1.0)
        frames.append(np.round(audio * 32767) / 32767)
    expected = resample(np.concatenate(frames).astype(np.float32), 22_050, 44_100)
    played = np.concatenate(sd.played)
    played, expected = played[played != 0], expected[expected != 0]  # the speaker hears silence between bursts
    assert len(played) > 0.95 * len(expected)
    assert np.abs(played - expected[: len(played)]).max() < 1e-5
    assert printed.startswith("[user] w")
    assert "[assistant] a" in printed


def test_the_microphone_client_reports_a_device_that_will_not_open(capsys):
    class Broken(FakeSoundDevice):
        def InputStream(self, **kwargs):  # noqa: N802
            raise RuntimeError("Error opening InputStream: Internal PortAudio error [PaErrorCode -9986]")

    factory = FakeFactory()

    async def main():
        async with RealtimeServer(factory) as server:
            code = await asyncio.to_thread(mic.main, [server.url], sd=Broken())
            await wait_for(lambda: server.live_sessions == 0)
            return code, server.live_sessions

    code, live = asyncio.run(main())
    err = capsys.readouterr().err
    assert code == 1 and "could not open the microphone 'Fake Mic'" in err and "Microphone access" in err
    assert live == 0 and factory.sessions[0].closed


# ---------------------------------------------------------------------------------------- --list-devices


def test_list_devices_without_sounddevice_says_how_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sounddevice", None)  # as on a core install
    assert mic.main(["--list-devices"]) == 2
    assert "pip install '.[mic]'" in capsys.readouterr().err


def test_list_devices_without_a_device(capsys):
    assert mic.main(["--list-devices"], sd=FakeSoundDevice(devices=[])) == 1
    assert "no audio devices found" in capsys.readouterr().err


def test_list_devices_lists_them(capsys):
    assert mic.main(["--list-devices"], sd=FakeSoundDevice()) == 0
    out = capsys.readouterr().out
    assert "0  Fake Mic  (in 2, out 0, 48000 Hz)" in out and "Fake Speaker" in out


def test_list_devices_as_a_process_on_this_machine():
    import subprocess

    done = subprocess.run([sys.executable, str(ROOT / "examples" / "realtime_microphone.py"), "--list-devices"],
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    if importlib.util.find_spec("sounddevice") is None:
        assert done.returncode == 2 and "pip install '.[mic]'" in done.stderr
    else:
        assert done.returncode in (0, 1, 2) and (done.stdout or done.stderr)
    assert "Traceback" not in done.stderr


def test_the_microphone_client_needs_a_url():
    with pytest.raises(SystemExit) as exc:
        mic.main([], sd=FakeSoundDevice())
    assert exc.value.code == 2


# ---------------------------------------------------------------------------------------- the file client


def test_file_client_wire_encoding_round_trips_pcm16():
    ints = np.array([-32768, -1, 0, 1, 32767], np.int16)
    assert np.array_equal(np.frombuffer(file_client.to_wire(ints / 32768), "<i2"), ints)
    messages = file_client.appends(np.zeros(3000, np.float32), 1280)
    assert [len(base64.b64decode(m["audio"])) for m in messages] == [2560, 2560, 880]


def test_file_client_refusals_are_one_line(tmp_path, capsys):
    async def main():
        async with RealtimeServer(FakeFactory(), api_key="k") as server:
            return await asyncio.to_thread(file_client.main, [server.url, str(ROOT / "examples" / "question.wav"),
                                                              str(tmp_path / "o.wav"), "--extra-seconds", "0"])

    assert asyncio.run(main()) == 1
    assert "HTTP 401" in capsys.readouterr().err and not (tmp_path / "o.wav").exists()
    assert file_client.main(["ws://127.0.0.1:9/v1/realtime", str(tmp_path / "missing.wav"),
                             str(tmp_path / "o.wav")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_file_client_when_the_server_is_busy_writes_nothing(tmp_path, capsys):
    async def main():
        async with RealtimeServer(FakeFactory()) as server:
            holder = await connect(server.url)
            await holder.recv()
            code = await asyncio.to_thread(file_client.main, [server.url, str(ROOT / "examples" / "question.wav"),
                                                              str(tmp_path / "o.wav"), "--extra-seconds", "0"])
            await holder.close()
            return code

    assert asyncio.run(main()) == 1
    err = capsys.readouterr().err
    assert "server_busy" in err and "nothing written" in err and not (tmp_path / "o.wav").exists()


# ------------------------------------------------------------------------------------------ server flags


def test_the_flags_configure_the_server():
    import argparse

    from orchestrator.realtime import add_realtime_flags, server_from_args

    parser = argparse.ArgumentParser()
    add_realtime_flags(parser)
    defaults = server_from_args(parser.parse_args([]), FakeFactory())
    assert (defaults.port, defaults.max_sessions, defaults.api_key, defaults.allowed_origins, defaults.path) == (
        8080, 1, None, None, "/v1/realtime")
    assert defaults.limits.max_message_bytes == 1 << 20 and defaults.limits.max_session_seconds == 600
    assert (defaults.limits.update_timeout_s, defaults.limits.idle_timeout_s) == (30, 120)
    server = server_from_args(parser.parse_args([
        "--realtime-port", "0", "--api-key", "k", "--allowed-origins", "https://a.example, https://b.example",
        "--api-prefix", "/api", "--realtime-max-sessions", "3", "--max-message-bytes", "4096",
        "--max-session-seconds", "60", "--session-update-timeout", "5", "--idle-timeout", "9"]), FakeFactory())
    assert server.allowed_origins == {"https://a.example", "https://b.example"} and server.path == "/api/v1/realtime"
    assert (server.port, server.max_sessions, server.limits.max_message_bytes) == (0, 3, 4096)
    for bad in (["--realtime-port", "70000"], ["--realtime-max-sessions", "0"], ["--idle-timeout", "0"]):
        with pytest.raises(ValueError):
            server_from_args(parser.parse_args(bad), FakeFactory())


def test_the_standalone_server_takes_the_connection_flags_of_orchestrator_serve(capsys, monkeypatch):
    """`python -m orchestrator.realtime` starts its services with --service-flags and --mps as `serve` does, and
    refuses them with running services in one line, before it starts anything."""
    from orchestrator import realtime
    from orchestrator.connect import connection_from_args

    started = []
    monkeypatch.setattr("orchestrator.stream_clients.connect_streams", lambda *a, **k: started.append(k))
    args = realtime.build_parser().parse_args(["--service-flags", "all=--precompile-batches 4",
                                               "--service-flags", "llm=--float32-weights", "--mps"])
    connection = connection_from_args(args)
    assert connection["mps"] and connection["services"] is None
    assert connection["flags"]["llm"] == ["--precompile-batches", "4", "--float32-weights"]
    assert connection["flags"]["codec"] == ["--precompile-batches", "4"]
    running = "perception=a:1,llm=a:2,tts=a:3,codec=a:4"
    assert realtime.main(["--services", running, "--mps", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --mps is for services this command starts; it cannot go with --services or --in-process"]
    assert started == []
