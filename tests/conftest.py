"""Shared fixtures: the tiny random checkpoints the parity goldens were made from, built once per run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

# The services keep float32 matmuls out of TF32 on CUDA when they are imported (services/common/loading.py), but
# MLX reads the setting once, at its first matmul, and a test may multiply before importing any service.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

from tools.make_checkpoint import write_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "parity" / "golden"
QUESTION_WAV = ROOT / "examples" / "question.wav"
CHECKPOINT_SEED = 0


def _build(tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp(name), "tiny", CHECKPOINT_SEED, **kwargs)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The dense (bf16) tiny checkpoint."""
    return _build(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def tiny4_checkpoint(tmp_path_factory) -> Path:
    """The tiny checkpoint with its language model at 4 bits."""
    return _build(tmp_path_factory, "tiny4", bits=4)


@pytest.fixture(scope="session")
def tinymix_checkpoint(tmp_path_factory) -> Path:
    """The tiny checkpoint with the 4/5/6/8-bit per-module map over all networks."""
    return _build(tmp_path_factory, "tinymix", mixed_bits=True)


@pytest.fixture
def compile_traces(monkeypatch) -> list[str]:
    """The name of every function `mx.compile` traces from now on (compiled functions made after this fixture
    count each trace, not each call): a test that expects no tracing asserts the list stays empty."""
    import mlx.core as mx

    traces: list[str] = []
    compile_ = mx.compile

    def counting(fn, *args, **kwargs):
        def traced(*a, **k):
            traces.append(getattr(fn, "__qualname__", repr(fn)))
            return fn(*a, **k)
        return compile_(traced, *args, **kwargs)

    monkeypatch.setattr(mx, "compile", counting)
    return traces


def load_golden(name: str) -> tuple[np.lib.npyio.NpzFile, dict]:
    """A golden's arrays and its `meta` JSON; a missing file is an error (the goldens are in git)."""
    data = np.load(GOLDEN / f"{name}.npz")
    return data, json.loads(str(data["meta"]))


@contextlib.contextmanager
def service_process(name: str, model: Path, *extra: str):
    """`python -m services.<name>` on a free port, as the launcher starts it; yields (address, process).

    The caller may stop it itself (SIGTERM) to check the exit code; whatever is left is stopped on exit."""
    from orchestrator.launcher import spawn_service, stop, wait_ready

    child = spawn_service(name, model, list(extra))
    try:
        wait_ready([child], timeout_s=60)
        yield child.address, child.process
    finally:
        stop([child])


def terminate(process) -> int:
    """SIGTERM, then the exit code (a clean shutdown is 0)."""
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=30)


@pytest.fixture
def fused(monkeypatch) -> list[int]:
    """The previous function token each language step fuses into the model's input, in step order (tool calls)."""
    from services.llm import engine as llm_engine

    seen: list[int] = []
    run = llm_engine.LanguageSession._run

    def spy(self, audio, want_heads):
        if want_heads:
            seen.append(self.prev_function)
        return run(self, audio, want_heads)

    monkeypatch.setattr(llm_engine.LanguageSession, "_run", spy)
    return seen
