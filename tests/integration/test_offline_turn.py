"""`orchestrator offline` end to end on the tiny checkpoint: parity with the reference, gRPC against in-process,
seeds, and every failure a user can cause, each one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from orchestrator import cli
from orchestrator.launcher import pid_alive
from tests.conftest import GOLDEN, QUESTION_WAV

PROMPT = "Be concise and answer in one sentence."


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def dumps(tiny_checkpoint, tmp_path_factory):
    """Each golden turn run once over gRPC (services as child processes) and once in-process."""
    out = tmp_path_factory.mktemp("dumps")
    results = {}
    for name, extra in (("offline", []), ("offline_prompt", ["-p", PROMPT])):
        for mode in ("grpc", "inproc"):
            flags = ["--in-process"] if mode == "inproc" else []
            wav, dump = out / f"{name}-{mode}.wav", out / f"{name}-{mode}.npz"
            code = cli.main(["offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint), *extra, *flags,
                             "--output-audio", str(wav), "--dump", str(dump)]) if mode == "inproc" else None
            if mode == "grpc":
                done = run_cli("offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint), *extra,
                               "--output-audio", str(wav), "--dump", str(dump))
                assert done.returncode == 0, done.stderr
                code = 0
            assert code == 0
            results[(name, mode)] = (wav, dump)
    return results


@pytest.mark.parametrize("name", ["offline", "offline_prompt"])
def test_turn_equals_the_reference(dumps, name):
    golden = np.load(GOLDEN / f"{name}.npz")
    expected = json.loads(str(golden["meta"]))
    wav, dump = dumps[(name, "grpc")]
    got = np.load(dump)
    meta = json.loads(str(got["meta"]))
    for key in ("text_tokens", "function_tokens", "audio_codes", "prompt_codes"):
        assert np.array_equal(got[key], golden[key]), key
    for key, tolerance in (("mel", 1e-4), ("encoder", 1e-4), ("audio_embeds", 1e-4), ("audio", 1e-4)):
        assert got[key].shape == golden[key].shape, key
        assert np.abs(got[key] - golden[key]).max() <= tolerance, key
    for key in ("transcript", "text", "function_text", "prompt_frames"):
        assert meta[key] == expected[key], key
    info = sf.info(wav)
    frames = golden["text_tokens"].shape[0]
    assert (info.samplerate, info.channels, info.subtype, info.frames) == (22050, 1, "PCM_16", frames * 1764)


@pytest.mark.parametrize("name", ["offline", "offline_prompt"])
def test_grpc_and_in_process_dumps_are_byte_identical(dumps, name):
    (_, grpc_dump), (_, local_dump) = dumps[(name, "grpc")], dumps[(name, "inproc")]
    assert grpc_dump.read_bytes() == local_dump.read_bytes()
    assert dumps[(name, "grpc")][0].read_bytes() == dumps[(name, "inproc")][0].read_bytes()


def test_prints_the_transcript_text_and_function_lines(tiny_checkpoint, tmp_path, capsys):
    golden = json.loads(str(np.load(GOLDEN / "offline.npz")["meta"]))
    assert cli.main(["offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--in-process",
                     "--output-audio", str(tmp_path / "r.wav")]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines[0] == f"[user] {golden['transcript']}"
    assert lines[1] == golden["text"]
    assert lines[2] == f"[function] {golden['function_text']}"


def test_seeds(tiny_checkpoint, tmp_path):
    golden7 = np.load(GOLDEN / "offline_seed7.npz")
    runs = {}
    for label, seed in (("a", 0), ("b", 0), ("c", 7)):
        dump = tmp_path / f"{label}.npz"
        assert cli.main(["offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--in-process",
                         "--seed", str(seed), "--output-audio", str(tmp_path / f"{label}.wav"),
                         "--dump", str(dump)]) == 0
        runs[label] = np.load(dump)
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "b.wav").read_bytes()
    assert not np.array_equal(runs["a"]["audio_codes"], runs["c"]["audio_codes"])
    assert np.array_equal(runs["a"]["text_tokens"], runs["c"]["text_tokens"])
    assert np.array_equal(runs["c"]["audio_codes"], golden7["audio_codes"])


def one_line_failure(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_inputs_fail_in_one_line(tiny_checkpoint, tmp_path):
    model = ["--model", str(tiny_checkpoint), "--in-process"]
    out = ["--output-audio", str(tmp_path / "never.wav")]
    one_line_failure(run_cli("offline", str(tmp_path / "missing.wav"), *model, *out), "no such file")
    (tmp_path / "notes.wav").write_text("these are not samples")
    one_line_failure(run_cli("offline", str(tmp_path / "notes.wav"), *model, *out), "not a readable audio file")
    sf.write(tmp_path / "empty.wav", np.zeros(0, np.int16), 16_000, subtype="PCM_16")
    one_line_failure(run_cli("offline", str(tmp_path / "empty.wav"), *model, *out), "no audio samples")
    (tmp_path / "folder").mkdir()
    one_line_failure(run_cli("offline", str(QUESTION_WAV), "--model", str(tmp_path / "folder"), *out),
                     "config.json", "--model")
    occupied = tmp_path / "mine.wav"
    occupied.write_bytes(b"the user's own file")
    one_line_failure(run_cli("offline", str(QUESTION_WAV), *model, "--output-audio", str(occupied)),
                     "already exists")
    assert occupied.read_bytes() == b"the user's own file"
    assert not (tmp_path / "never.wav").exists()


def wait_for_services(pid: int, timeout_s: float = 60) -> dict[int, str]:
    """The four service processes the orchestrator `pid` started, once they all exist."""
    deadline = time.monotonic() + timeout_s
    services: dict[int, str] = {}
    while time.monotonic() < deadline and len(services) < 4:
        services = {child: cmd for child, cmd in children_of(pid).items() if "services." in cmd}
        time.sleep(0.1)
    assert len(services) == 4, services
    return services


def children_of(pid: int) -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry.name)] = cmdline
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the service processes through /proc (Linux)")
def test_a_service_killed_mid_turn_is_named_and_leaves_nothing_behind(tiny_checkpoint, tmp_path):
    wav = tmp_path / "answer.wav"
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint),
         "--extra-decoding-seconds", "60", "--output-audio", str(wav)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        services = wait_for_services(proc.pid)
        time.sleep(3.0)  # loaded and into the turn
        victim = next(pid for pid, cmd in services.items() if "services.tts" in cmd)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
        assert time.monotonic() - killed_at < 10
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "tts" in stderr and stderr.startswith("error: "), stderr
    assert not wav.exists() and not list(tmp_path.glob("*.part"))
    time.sleep(0.5)
    assert [pid for pid in services if running(pid)] == []


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    if not pid_alive(pid):
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the service processes through /proc (Linux)")
def test_services_die_with_a_killed_orchestrator(tiny_checkpoint, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint),
         "--extra-decoding-seconds", "60", "--output-audio", str(tmp_path / "answer.wav")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        services = wait_for_services(proc.pid)
    finally:
        proc.kill()  # no chance to stop its children itself
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(running(pid) for pid in services):
        time.sleep(0.1)
    assert [pid for pid in services if running(pid)] == []
