"""bench.contention and the holders it runs beside a measurement (`bench.service --hold`), on the tiny checkpoint:
the shape of the output and the processes' lifecycle, no timing asserts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import contention, service
from services.common.config import VoiceChatConfig


def test_each_engine_is_measured_alone_and_beside_the_others(tiny_checkpoint, capsys):
    assert contention.main(["--model", str(tiny_checkpoint), "--engines", "codec", "--beside", "perception,codec",
                            "--sessions", "2", "--frames", "2", "--warmup", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sessions"] == 2 and report["mps"] is False and report["cuda"] is False
    [row] = report["engines"]
    assert row["engine"] == "codec" and row["beside"] == ["perception"]  # never beside itself
    for side in ("alone", "beside_others"):
        times = row[side]
        assert list(times) == ["step_p50_ms", "step_p95_ms", "python_ms", "launch_ms", "wait_ms", "thread_cpu_ms"]
        assert 0 < times["step_p50_ms"] <= times["step_p95_ms"] and times["launch_ms"] > 0


def test_the_table_has_a_row_per_engine(tiny_checkpoint, capsys):
    assert contention.main(["--model", str(tiny_checkpoint), "--engines", "codec,perception", "--beside", "codec",
                            "--sessions", "1", "--frames", "2", "--warmup", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("1 sessions a step, 2 steps after 0 warm-up")
    assert [line.split(" | ")[:2] for line in lines[3:]] == [["| codec", "-"], ["| perception", "codec"]]
    assert all(len(line.split(" | ")) == 10 for line in lines[3:])


def test_kernels_are_asked_of_every_measured_run(tiny_checkpoint, capsys, monkeypatch):
    """--kernels reaches each measured run (`bench.service --kernels`); where that Python cannot record (no
    PyTorch with CUDA, as here), the run's error names what it needs."""
    commands = []
    run = contention.subprocess.run
    monkeypatch.setattr(contention.subprocess, "run", lambda command, **kw: commands.append(command) or
                        run(command, **kw))
    assert contention.main(["--model", str(tiny_checkpoint), "--engines", "codec", "--beside", "codec",
                            "--sessions", "1", "--frames", "2", "--warmup", "0", "--kernels"]) == 1
    assert commands[0][-2:] == ["--kernels", str(contention.TOP_KERNELS)]
    assert capsys.readouterr().err.startswith("error: codec: the measured run failed with exit code 1: error: "
                                              "recording kernels needs")


def test_the_configuration_is_the_many_conversation_one():
    flags, env = contention.configuration(cuda=False, mps=False)
    shared = ["--cache-limit-mb", "shared", "--device-headroom-mb", "shared"]  # every process, as `serve` gives
    assert flags == {"perception": ["--float32-weights", *shared],
                     "llm": ["--weights-dtype", "bfloat16", "--float32-weights", *shared],
                     "tts": ["--float32-weights", *shared], "codec": shared}
    assert env == {"perception": {}, "llm": {}, "tts": {}, "codec": {}}
    flags, env = contention.configuration(cuda=True, mps=True)
    assert flags["llm"][-1] == "--split-matmuls" and flags["perception"] == ["--float32-weights", *shared]
    assert env == {"perception": {"MLX_USE_CUDA_GRAPHS": "0"},
                   "llm": {"CUDA_MPS_CLIENT_PRIORITY": "1"},
                   "tts": {"MLX_USE_CUDA_GRAPHS": "0", "CUDA_MPS_CLIENT_PRIORITY": "1"},
                   "codec": {"CUDA_MPS_CLIENT_PRIORITY": "1"}}


def test_a_holder_that_cannot_start_is_named_with_its_error(tmp_path, capsys):
    flags, env = contention.configuration(cuda=False, mps=False)
    with pytest.raises(contention.ContentionError, match=r"^tts: the holder did not start stepping \(exit code 1\)"):
        with contention.holding(["tts"], tmp_path / "missing", 1, 2, 1, flags, env):
            pytest.fail("the block must not run without its holders")
    assert contention.main(["--model", str(tmp_path / "missing"), "--engines", "codec", "--sessions", "1"]) == 1
    assert capsys.readouterr().err.startswith("error: codec: the measured run failed with exit code 1")


def test_hold_replaces_its_sessions_every_frames_steps_until_told_to_stop(tiny_checkpoint, capsys):
    driver = service.EngineDriver("codec", tiny_checkpoint, VoiceChatConfig.load(tiny_checkpoint))
    opened, stepped = [], []
    driver_open, driver_step = driver.open, driver.step
    driver.open = lambda: opened.append(driver_open()) or opened[-1]
    driver.step = lambda sessions: stepped.append([id(s) for s in sessions]) or driver_step(sessions)
    assert service.hold(driver, 2, frames=3, warmup=2, done=lambda: len(stepped) >= 7) == 7
    # 7 steps of 2 sessions: the first pair for steps 1-3, the second for 4-6, the third for step 7
    assert len(opened) == 6 and [len(step) for step in stepped] == [2] * 7
    assert [stepped[i] for i in (0, 3, 6)] == [[id(s) for s in opened[j : j + 2]] for j in (0, 2, 4)]
    assert stepped[0] == stepped[1] == stepped[2]
    assert capsys.readouterr().out == f"{service.HOLDING} 2 sessions stepping\n"  # once, after the warm-up


def test_hold_closes_the_sessions_it_replaces(tiny_checkpoint):
    """The language engine keeps each session (and its pool of stacked states) until it is closed: a holder
    replacing its sessions must close them, or it would grow without bound."""
    driver = service.EngineDriver("llm", tiny_checkpoint, VoiceChatConfig.load(tiny_checkpoint))
    opened = []
    driver_open = driver.open
    driver.open = lambda: opened.append(driver_open()) or opened[-1]
    # two steps of a first pair, two of a second, then one of a third, whose opening made six
    assert service.hold(driver, 2, frames=2, warmup=1, done=lambda: len(opened) >= 6) == 5
    assert len(opened) == 6 and all(session.closed for session in opened)
    assert driver.engine._sessions == {} and driver._done == {}


def test_a_holder_process_steps_until_sigterm_and_exits_cleanly(tiny_checkpoint):
    proc = subprocess.Popen([sys.executable, "-m", "bench.service", "codec", "--model", str(tiny_checkpoint),
                             "--sessions", "2", "--frames", "2", "--warmup", "1", "--no-grpc", "--hold"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    assert proc.stdout.readline() == f"{service.HOLDING} 2 sessions stepping\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    steps = int(out.split()[1])
    assert out.startswith("held: ") and out.endswith(" steps of 2 sessions\n") and steps >= 1


def test_hold_takes_one_session_count_in_process_only(tiny_checkpoint):
    for bad in (["--hold"], ["--hold", "--no-grpc", "--sessions", "1,2"], ["--hold", "--no-grpc", "--host-split"],
                ["--hold", "--no-grpc", "--sessions", "3", "--partial", "1"]):
        with pytest.raises(SystemExit):
            service.main(["codec", "--model", str(tiny_checkpoint), *bad])
