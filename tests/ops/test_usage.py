"""What a new user meets first: the README's commands, the Makefile's targets, the package metadata, and the
services' --model default."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from services.common import cli

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
NETWORKS = ("perception", "llm", "tts", "codec")


def _readme_commands() -> list[list[str]]:
    """The README's shell commands (continued lines joined), split as a shell would."""
    joined = re.sub(r"\\\n\s*", " ", README)
    return [shlex.split(line.split("#")[0]) for line in joined.splitlines()
            if re.match(r"\s*(\S+\$ )?\.venv/bin/", line)]


def test_every_input_wav_the_readme_names_exists():
    inputs = []
    for words in _readme_commands():
        if words[0].endswith("orchestrator") and words[1] in ("offline", "stream"):
            inputs.append(words[2])
        elif any(w.endswith("realtime_file_client.py") for w in words):
            inputs.append(next(w for w in words if w.endswith(".wav")))
    assert len(inputs) >= 3
    assert [p for p in inputs if not (ROOT / p).is_file()] == []


def test_the_readme_says_how_to_overwrite_an_existing_output():
    offline_section = README.split("## The offline turn", 1)[1].split("\n## ", 1)[0]
    assert "--force" in offline_section
    assert "already exists" in offline_section


@pytest.mark.parametrize("name", NETWORKS)
def test_make_serve_runs_the_service(name):
    def dry_run(*variables: str) -> list[str]:
        done = subprocess.run(["make", "-n", f"serve-{name}", *variables], cwd=ROOT, capture_output=True,
                              text=True, check=True)
        return [line for line in done.stdout.splitlines() if f"-m services.{name}" in line]

    assert dry_run("MODEL=/ckpt", "PORT=50054") == [f".venv/bin/python -m services.{name} --model /ckpt --port 50054"]
    assert [line.split() for line in dry_run()] == [[".venv/bin/python", "-m", f"services.{name}", "--port", "0"]]


def test_the_license_is_an_spdx_string():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in project["build-system"]["requires"]  # the first to read a string license


def test_a_service_without_model_runs_the_demo_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(cli.MODEL_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = cli.parse_args(cli.build_parser("services.codec", "test"), ["--port", "0"])
    assert args.model == tmp_path / "voicechat" / "demo-tiny-seed0"
    assert (args.model / "config.json").is_file()
    assert "using the demo checkpoint" in capsys.readouterr().err
