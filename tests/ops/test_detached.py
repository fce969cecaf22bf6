"""bench/detached.sh: a job started in one device call runs on, detached, and later calls wait for it."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "detached.sh"


def _run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_a_detached_job_outlives_its_start_and_a_wait_reports_its_end(tmp_path):
    env = {**os.environ, "DETACHED_DIR": str(tmp_path)}
    started = _run(env, "start", "job", "bash", "-c", "sleep 2; echo measured; exit 4")
    assert started.returncode == 0 and "started job" in started.stdout
    again = _run(env, "start", "job", "true")
    assert again.returncode == 2 and "already running" in again.stderr  # one job of a name at a time
    early = _run(env, "wait", "job", "0")
    assert early.returncode == 3 and "still running" in early.stdout
    done = _run(env, "wait", "job", "30")
    assert done.returncode == 0 and "measured" in done.stdout and "exit code 4" in done.stdout
    assert (tmp_path / "job.rc").read_text().strip() == "4" and "measured" in (tmp_path / "job.log").read_text()
    assert _run(env, "wait", "other").returncode == 2
    assert _run(env, "start", "job").returncode == 2  # no command
