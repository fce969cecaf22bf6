"""`orchestrator stream` end to end on the tiny checkpoint: the reference's online session over gRPC (services as
child processes), in-process and sequential runs byte-identical to it, the profile summary, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from orchestrator import cli
from tests.conftest import QUESTION_WAV, load_golden

PROMPT = "Be concise and answer in one sentence."


@pytest.fixture(scope="module")
def grpc_run(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("stream")
    wav, dump = out / "r.wav", out / "r.npz"
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "stream", str(QUESTION_WAV), "--model",
                           str(tiny_checkpoint), "--profile", "--output-audio", str(wav), "--dump", str(dump)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return wav, dump, done.stdout


def check_against_golden(dump, name):
    golden, expected = load_golden(name)
    got = np.load(dump)
    meta = json.loads(str(got["meta"]))
    for key in ("text_tokens", "function_tokens", "audio_codes"):
        assert np.array_equal(got[key], golden[key]), key
    prefix = meta["prompt_frames"]
    assert prefix == expected["prompt_frames"]
    for key, golden_key in (("encoder", "stream_encoder"), ("audio", "audio")):
        assert got[key].shape == golden[golden_key].shape, key
        assert np.abs(got[key] - golden[golden_key]).max() <= 1e-4, key
    assert np.abs(got["audio_embeds"][prefix:] - golden["stream_audio_embeds"]).max() <= 1e-4
    assert meta["events"] == expected["events"]
    for key in ("text", "function_text", "transcript"):
        assert meta[key] == expected[key], key
    text_frames = [e["frame_index"] for e in expected["events"] if e["kind"] == "assistant_text_delta"]
    assert got["frame_index_text"].tolist() == text_frames


def test_stream_over_grpc_equals_the_reference(grpc_run):
    wav, dump, stdout = grpc_run
    check_against_golden(dump, "online")
    _, expected = load_golden("online")
    printed = "".join(e["delta"] for e in expected["events"] if e["kind"] == "assistant_text_delta")
    assert stdout.startswith(printed + "\n")  # the deltas as the frames produced them
    assert f"\n[user] {expected['transcript']}\n" in stdout
    info = sf.info(wav)
    assert (info.samplerate, info.channels, info.subtype) == (22050, 1, "PCM_16")
    assert info.frames == expected["frames"] * 1764


def test_profile_summary_is_printed(grpc_run):
    summary = json.loads(grpc_run[2].splitlines()[-1])
    _, expected = load_golden("online")
    assert summary["frames"] == expected["frames"] - 5 and summary["dropped_cold_frames"] == 5
    assert summary["mode"] == "pipelined"
    for stage in ("perception", "language", "tts", "codec", "total", "interval"):
        assert summary["stages"][stage]["mean_ms"] > 0, stage
        assert summary["stages"][stage]["p50_ms"] <= summary["stages"][stage]["max_ms"]
    assert summary["realtime_factor"] == pytest.approx(summary["stages"]["interval"]["mean_ms"] / 80.0)
    assert summary["processing_frames_per_second"] == pytest.approx(1000.0 / summary["stages"]["interval"]["mean_ms"])


def test_in_process_sequential_chunked_run_is_byte_identical(grpc_run, tiny_checkpoint, tmp_path):
    wav, dump = tmp_path / "r.wav", tmp_path / "r.npz"
    assert cli.main(["stream", str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--in-process", "--sequential",
                     "--chunk-ms", "250", "--output-audio", str(wav), "--dump", str(dump)]) == 0
    assert dump.read_bytes() == grpc_run[1].read_bytes()
    assert wav.read_bytes() == grpc_run[0].read_bytes()


def test_system_prompt_in_process(tiny_checkpoint, tmp_path):
    dump = tmp_path / "p.npz"
    assert cli.main(["stream", str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--in-process", "-p", PROMPT,
                     "--chunk-ms", "10", "--output-audio", str(tmp_path / "p.wav"), "--dump", str(dump)]) == 0
    check_against_golden(dump, "online_prompt")


@pytest.mark.parametrize("flags, needle", [
    (["--chunk-ms", "0"], "--chunk-ms"),
    (["--seed", "-1"], "--seed"),
    (["--max-streaming-seconds", "-2"], "--max-streaming-seconds"),
])
def test_bad_flags_fail_in_one_line(tiny_checkpoint, tmp_path, capsys, flags, needle):
    assert cli.main(["stream", str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--in-process",
                     "--output-audio", str(tmp_path / "x.wav"), *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]
    assert not (tmp_path / "x.wav").exists()


def test_a_stream_past_its_limit_is_one_clear_error(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "x.wav"
    assert cli.main(["stream", str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--in-process",
                     "--max-streaming-seconds", "0.4", "--output-audio", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "max_streaming_seconds" in err[-1]
    assert not out.exists()


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_service_killed_mid_stream_is_named_and_nothing_hangs(tiny_checkpoint, pipelined):
    import os
    import signal
    import time

    from orchestrator.clients import ServiceError
    from orchestrator.launcher import launched
    from orchestrator.session import OnlineSession
    from orchestrator.stream_clients import grpc_stream_clients
    from orchestrator.text import TextDecoder
    from services.common.config import VoiceChatConfig

    golden, _ = load_golden("online")
    wave = golden["waveform"]
    config = VoiceChatConfig.load(tiny_checkpoint)
    with launched(tiny_checkpoint) as children:
        clients = grpc_stream_clients({name: child.address for name, (child,) in children.items()})
        try:
            session = OnlineSession(clients, config, TextDecoder(tiny_checkpoint, config), pipelined=pipelined)
            session.push_audio(wave[: 1280 * 3])
            session.drain()
            os.kill(children["tts"][0].process.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(ServiceError, match="tts"):
                session.push_audio(wave[1280 * 3 :])
                session.flush()
            assert time.monotonic() - killed_at < 10
            assert session.closed
        finally:
            clients.close()


@pytest.mark.parametrize("command", ["stream", "offline", "serve"])
def test_running_services_need_the_model_named(monkeypatch, tmp_path, capsys, command):
    monkeypatch.delenv("VOICECHAT_MODEL", raising=False)
    cache, work = tmp_path / "cache", tmp_path / "work"
    cache.mkdir(), work.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))  # a demo fallback would have to build here
    monkeypatch.chdir(work)  # the default output (response.wav) lands here, whatever the caller's folder holds
    services = "perception=127.0.0.1:1,llm=127.0.0.1:1,tts=127.0.0.1:1,codec=127.0.0.1:1"
    argv = [command, "--services", services] + ([] if command == "serve" else [str(QUESTION_WAV)])
    assert cli.main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--services needs --model DIR" in err[0]
    assert not any(cache.iterdir()) and not any(work.iterdir())  # no demo checkpoint was made, nothing written


def test_service_flags_reach_the_services_the_command_starts(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "x.wav"
    assert cli.main(["offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--output-audio", str(out),
                     "--service-flags", "codec=--max-batch 0"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "codec service exited" in err[0] and "--max-batch 0: must be at least 1" in err[0]
    assert not out.exists()
    assert cli.main(["offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--output-audio", str(out),
                     "--service-flags", "all=--precompile-batches 2", "--service-flags", "llm=--max-batch 4"]) == 0
    assert out.exists()


def test_service_flags_cannot_go_with_running_or_in_process_services(tiny_checkpoint, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default output (response.wav) lands here, whatever the caller's folder holds
    for where in (["--in-process"], ["--services", "perception=h:1,llm=h:2,tts=h:3,codec=h:4"]):
        assert cli.main(["offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint), *where,
                         "--service-flags", "llm=--max-batch 4"]) != 0
        assert "--service-flags is for services this command starts" in capsys.readouterr().err
        assert cli.main(["offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint), *where,
                         "--service-env", "llm=MLX_USE_CUDA_GRAPHS=0"]) != 0
        assert "--service-env is for services this command starts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--service-env", "llm=X"])
    assert "expected NAME=VAR=VALUE" in capsys.readouterr().err
