"""--mps: the services an orchestrator starts share the GPU through an MPS daemon of their own. The daemon here
is a stand-in script named like the real one, which logs how it was called."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.launcher import LaunchError, launched
from orchestrator.mps import CONTROL, LOG_ENV, PIPE_ENV, MpsError, mps_daemon

FAKE = """#!/bin/sh
# a stand-in for nvidia-cuda-mps-control: logs each call (arguments, pipe directory, what came on stdin)
if [ "$1" = "-d" ]; then
  [ -n "$FAIL" ] && { echo "$FAIL" >&2; exit 1; }
  echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$LOG"
else
  echo "command $CUDA_MPS_PIPE_DIRECTORY $(cat)" >> "$LOG"
fi
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch) -> Path:
    """A stand-in nvidia-cuda-mps-control first on PATH; returns the file it logs to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / CONTROL
    program.write_text(FAKE)
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LOG", str(log))
    monkeypatch.delenv("FAIL", raising=False)
    return log


def test_the_daemon_gets_its_own_directories_and_is_told_to_quit_after(fake_control):
    with mps_daemon() as env:
        pipe, log_dir = Path(env[PIPE_ENV]), Path(env[LOG_ENV])
        assert pipe.is_dir() and log_dir.is_dir() and pipe.parent == log_dir.parent
        assert fake_control.read_text().splitlines() == [f"start {pipe} {log_dir}"]
    assert fake_control.read_text().splitlines()[1:] == [f"command {pipe} quit"]
    assert not pipe.parent.exists()


def test_a_daemon_that_fails_to_start_says_why_and_leaves_nothing(fake_control, monkeypatch, tmp_path):
    monkeypatch.setenv("FAIL", "An instance of this daemon is already running")
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("voicechat-mps-*"))
    with pytest.raises(MpsError, match="exit code 1: An instance of this daemon is already running"):
        with mps_daemon():
            pass
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("voicechat-mps-*")) == before


def test_without_the_program_the_error_names_it_and_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MpsError, match=f"{CONTROL} is not on PATH.*run without --mps"):
        with mps_daemon():
            pass


def test_launched_services_run_with_the_daemons_pipe_directory(fake_control, tiny_checkpoint):
    with launched(tiny_checkpoint, names=("codec",), mps=True) as children:
        environ = Path(f"/proc/{children['codec'][0].process.pid}/environ").read_bytes().split(b"\0")
        pipe = fake_control.read_text().split()[1]
        assert f"{PIPE_ENV}={pipe}".encode() in environ
    assert fake_control.read_text().splitlines()[-1] == f"command {pipe} quit"  # after the service stopped


def test_launch_without_the_program_fails_before_any_service_starts(monkeypatch, tmp_path, tiny_checkpoint):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="not on PATH"):
        with launched(tiny_checkpoint, mps=True):
            pass


def test_the_cli_reports_a_missing_daemon_in_one_line_and_refuses_mps_with_running_services(
        monkeypatch, tmp_path, tiny_checkpoint, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # the default output (response.wav) lands here, whatever the caller's folder holds
    out = tmp_path / "out.wav"
    wav = Path(__file__).resolve().parents[2] / "examples" / "question.wav"
    assert main(["offline", str(wav), "--model", str(tiny_checkpoint), "--mps", "--output-audio", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --mps: nvidia-cuda-mps-control is not on PATH")
    assert not out.exists()
    assert main(["offline", str(wav), "--model", str(tiny_checkpoint), "--mps",
                 "--services", "perception=a:1,llm=a:2,tts=a:3,codec=a:4"]) == 1
    assert "--mps is for services this command starts" in capsys.readouterr().err
