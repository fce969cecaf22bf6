"""CUDA MPS for the services an orchestrator starts: their kernels share the GPU instead of taking turns.

Without MPS a GPU runs one process's kernels at a time, switching between the four services' CUDA contexts;
each network's frame is many small kernels, so every stage waits on the others' turns. Under an MPS daemon the
four processes' kernels run side by side. On one H200 (docs/performance.md) that took one conversation's frame
interval from 33 to 23 ms; at 16 live conversations, where the GPU is busy anyway, it added 5% (176 -> 184.5
frames per second).

    with mps_daemon() as env:     # nvidia-cuda-mps-control -d, on a pipe directory of its own
        spawn the services with env added to theirs
    # the daemon is told to quit, after the services have stopped

The daemon is private to this orchestrator (its own pipe and log directories), so it neither needs nor
touches a host-wide MPS setup, and it changes no GPU setting.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"


class MpsError(RuntimeError):
    """The MPS daemon could not be started."""


@contextlib.contextmanager
def mps_daemon(control: str = CONTROL, timeout_s: float = 30.0) -> Iterator[dict[str, str]]:
    """Start an MPS control daemon on fresh pipe and log directories; yield the environment its clients need;
    on exit tell it to quit and remove the directories."""
    program = shutil.which(control)
    if program is None:
        raise MpsError(f"--mps: {control} is not on PATH. MPS comes with the NVIDIA driver on Linux hosts with an "
                       "NVIDIA GPU (in a container: the NVIDIA Container Toolkit with the compute and utility "
                       "capabilities); run without --mps")
    root = Path(tempfile.mkdtemp(prefix="voicechat-mps-"))
    env = {PIPE_ENV: str(root / "pipe"), LOG_ENV: str(root / "log")}
    for folder in env.values():
        os.mkdir(folder)
    daemon_env = {**os.environ, **env}
    try:
        started = subprocess.run([program, "-d"], env=daemon_env, capture_output=True, text=True,
                                 timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise MpsError(f"--mps: {control} -d did not start: {exc}") from None
    if started.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        said = (started.stderr or started.stdout).strip() or "no output"
        raise MpsError(f"--mps: {control} -d failed with exit code {started.returncode}: {said}")
    try:
        yield env
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run([program], input="quit\n", env=daemon_env, capture_output=True, text=True,
                           timeout=timeout_s)
        shutil.rmtree(root, ignore_errors=True)
