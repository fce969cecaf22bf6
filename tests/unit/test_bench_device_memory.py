"""bench.device_memory: one process's device memory phase by phase (the phases checked on MLX's counters here;
the pool and the device columns need CUDA)."""

import subprocess

import mlx.core as mx

from bench import device_memory
from bench.device_memory import Readings, print_rows, process_device_mb, run_phases


def test_the_phases_move_mlx_counters_as_they_say_and_leave_the_cache_limit_as_it_was(capsys):
    previous = mx.set_cache_limit(123 << 20)
    try:
        rows = run_phases(Readings(None, device_mb=lambda: None), size_mb=8, shapes=3)
        assert mx.set_cache_limit(previous) == 123 << 20
    finally:
        mx.set_cache_limit(previous)
    by_phase = {row["phase"]: row for row in rows}
    assert list(by_phase)[:4] == ["start", "block held", "block freed", "trimmed"]
    start = by_phase["start"]["active_mb"]
    assert by_phase["block held"]["active_mb"] - start == 8.0
    assert by_phase["block freed"]["active_mb"] == start and by_phase["block freed"]["cache_mb"] == 0  # limit 0
    held = by_phase["64 blocks held"]["active_mb"] - start
    assert held == sum(8 * (1 << 20) // 4 // 64 * (i % 7 + 1) * 4 for i in range(64)) / (1 << 20)
    assert by_phase["64 blocks cached"]["cache_mb"] >= held and by_phase["cache cleared"]["cache_mb"] == 0
    assert {"matmuls at 3 shapes", "conv1d at 3 shapes", "depthwise at 3 shapes", "conv2d at 3 shapes"} <= set(by_phase)
    assert abs(by_phase["conv2d at 3 shapes"]["active_mb"] - start) < 0.01  # every operand gone (MLX's random key
    # stays: 16 bytes)
    assert all(row["pool_reserved_mb"] is None and row["process_mb"] is None for row in rows)
    print_rows(rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| phase | active MiB | cache MiB | pool reserved MiB |") and len(lines) == 2 + len(rows)
    assert lines[3] == f"| block held | {start + 8:.1f} | 0.0 | - | - | - | - |"


def test_the_process_row_of_nvidia_smi(monkeypatch):
    monkeypatch.setattr(device_memory.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    out = "918, 66\n4242, 12264\n"
    monkeypatch.setattr(device_memory.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=out, stderr=""))
    assert process_device_mb(4242) == 12264.0
    assert process_device_mb(7) is None
    monkeypatch.setattr(device_memory.shutil, "which", lambda name: None)
    assert process_device_mb(4242) is None
