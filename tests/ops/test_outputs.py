"""Outputs that cannot be written: refused before any work, and a write that still fails loses no answer."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from orchestrator import cli
from tests.conftest import QUESTION_WAV

SYS = Path("/sys")


def _readonly_folder() -> Path:
    """A folder no process may create files in, root included (sysfs)."""
    if not SYS.is_dir() or os.access(SYS, os.W_OK) and _creatable(SYS):
        pytest.skip("needs a folder that refuses new files even to this user")
    return SYS


def _creatable(folder: Path) -> bool:
    try:
        (folder / ".probe").touch()
    except OSError:
        return False
    (folder / ".probe").unlink()
    return True


@pytest.mark.parametrize("command", ["offline", "stream"])
def test_an_unwritable_output_folder_is_refused_before_any_work(command, tiny_checkpoint, monkeypatch, capsys):
    def no_work(*args, **kwargs):
        raise AssertionError("the turn started although its output cannot be written")

    monkeypatch.setattr(cli, "connect", no_work)
    monkeypatch.setattr(cli, "connect_streams", no_work)
    output = _readonly_folder() / "response.wav"
    code = cli.main([command, str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--in-process",
                     "--output-audio", str(output)])
    assert code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {output}: cannot write there (Permission denied); give an output path in a writable folder"]


def test_an_existing_output_names_force(tiny_checkpoint, tmp_path, capsys):
    mine = tmp_path / "mine.wav"
    mine.write_bytes(b"the user's own file")
    assert cli.main(["offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--in-process",
                     "--output-audio", str(mine)]) == 1
    assert capsys.readouterr().err.strip() == (f"error: {mine}: already exists; pass --force to overwrite it, or "
                                               "another output path")
    assert mine.read_bytes() == b"the user's own file"


def _failing_write(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system")


def test_a_write_that_fails_after_the_turn_prints_the_answer_and_one_line(tiny_checkpoint, tmp_path, monkeypatch,
                                                                          capsys):
    out = tmp_path / "answer.wav"
    argv = ["offline", str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--in-process", "--output-audio", str(out),
            "--extra-decoding-seconds", "0"]
    assert cli.main(argv + ["--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    out.unlink()
    monkeypatch.setattr(cli, "write_wav", _failing_write)  # the disk turned read-only during the turn
    error = [f"error: {out}: could not be written (Read-only file system); the transcript and text are printed above"]
    assert cli.main(argv) == 1
    printed = capsys.readouterr()
    assert printed.err.strip().splitlines() == error
    assert printed.out.startswith(f"[user] {expected['transcript']}\n{expected['text']}\n")
    assert cli.main(argv + ["--json"]) == 1
    printed = capsys.readouterr()
    assert printed.err.strip().splitlines() == error
    assert json.loads(printed.out) == {**expected, "output_audio": None, "seconds": json.loads(printed.out)["seconds"]}
    assert not out.exists()
