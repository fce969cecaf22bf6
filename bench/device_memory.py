"""Where one process's device memory goes: the device's count of it beside MLX's counters and the CUDA pool's,
phase by phase.

    python -m bench.device_memory [--size-mb 1024] [--shapes 40] [--json]

Runs, in this process: a block of --size-mb held, then freed, then the pool trimmed; many blocks of mixed sizes
held and freed; the same through MLX's buffer cache, then the cache cleared; then matmuls, 1-D convolutions
(full and depthwise) and 2-D convolutions at --shapes batch sizes each (a service that compiles every batch size
up to N at load runs each of its operations at N shapes), the cache cleared and the pool trimmed after each. After
each phase one row: MLX's active and cached MiB, the pool's reserved and used MiB
(`services.common.device_pool`), the device's free MiB, and this process's device memory as nvidia-smi reports
it. What the process holds on the device beyond MLX's arrays, cache and the pool's reserve is not MLX's: CUDA's
context, libraries' workspaces and plans, loaded kernels.

On a host without CUDA the pool and the device columns read `-` (MLX's counters still move: a check of the
phases themselves).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

from services.common.device_pool import DevicePool

MIB = 1 << 20


def process_device_mb(pid: int | None = None) -> float | None:
    """This process's device memory in MiB as nvidia-smi reports it; None without nvidia-smi or a row for it."""
    if shutil.which("nvidia-smi") is None:
        return None
    pid = os.getpid() if pid is None else pid
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return float(fields[1])
    return None


class Readings:
    """One row per phase: MLX's counters, the pool's, the device's free memory and the process's device memory."""

    def __init__(self, pool: DevicePool | None, device_mb: Callable[[], float | None] = process_device_mb) -> None:
        self.pool = pool
        self.device_mb = device_mb
        self.rows: list[dict[str, object]] = []

    def read(self, phase: str) -> dict[str, object]:
        import mlx.core as mx

        mx.synchronize()
        free = mx.device_info().get("free_memory")
        row = {"phase": phase, "active_mb": mx.get_active_memory() / MIB, "cache_mb": mx.get_cache_memory() / MIB,
               "pool_reserved_mb": None if self.pool is None else self.pool.reserved() / MIB,
               "pool_used_mb": None if self.pool is None else self.pool.used() / MIB,
               "device_free_mb": free / MIB if isinstance(free, int) else None, "process_mb": self.device_mb()}
        self.rows.append(row)
        return row

    def settle(self, phase: str) -> dict[str, object]:
        """The cache cleared and the pool trimmed, then a reading."""
        import mlx.core as mx

        mx.synchronize()
        mx.clear_cache()
        if self.pool is not None:
            self.pool.trim()
        return self.read(phase)


def run_phases(readings: Readings, size_mb: float, shapes: int) -> list[dict[str, object]]:
    """The phases of the module's docstring, a reading after each."""
    import mlx.core as mx

    previous = mx.set_cache_limit(0)  # every freed buffer back to the driver, until the cache's own phase
    try:
        readings.read("start")
        block = mx.zeros((int(size_mb * MIB) // 4,), dtype=mx.float32)
        mx.eval(block)
        readings.read("block held")
        del block
        readings.read("block freed")
        readings.settle("trimmed")
        blocks = [mx.zeros((int(size_mb * MIB) // 4 // 64 * (i % 7 + 1),), dtype=mx.float32) for i in range(64)]
        mx.eval(blocks)
        readings.read("64 blocks held")
        del blocks
        readings.settle("64 blocks freed")
        mx.set_cache_limit(1 << 50)
        blocks = [mx.zeros((int(size_mb * MIB) // 4 // 64 * (i % 7 + 1),), dtype=mx.float32) for i in range(64)]
        mx.eval(blocks)
        del blocks
        readings.read("64 blocks cached")
        readings.settle("cache cleared")
        mx.set_cache_limit(0)
        weight = mx.random.normal((1024, 1024))
        for n in range(1, shapes + 1):
            mx.eval(mx.random.normal((n, 1024)) @ weight)
        del weight
        readings.settle(f"matmuls at {shapes} shapes")
        kernel = mx.random.normal((256, 9, 80))
        for n in range(1, shapes + 1):
            mx.eval(mx.conv1d(mx.random.normal((n, 64, 80)), kernel))
        readings.settle(f"conv1d at {shapes} shapes")
        depthwise = mx.random.normal((256, 9, 1))
        for n in range(1, shapes + 1):
            mx.eval(mx.conv1d(mx.random.normal((n, 16, 256)), depthwise, padding=4, groups=256))
        readings.settle(f"depthwise at {shapes} shapes")
        kernel2 = mx.random.normal((64, 3, 3, 1))
        for n in range(1, shapes + 1):
            mx.eval(mx.conv2d(mx.random.normal((n, 32, 80, 1)), kernel2, stride=2))
        del kernel, depthwise, kernel2
        readings.settle(f"conv2d at {shapes} shapes")
        return readings.rows
    finally:
        mx.set_cache_limit(previous)


def print_rows(rows: list[dict[str, object]]) -> None:
    keys = ("active_mb", "cache_mb", "pool_reserved_mb", "pool_used_mb", "device_free_mb", "process_mb")
    print("| phase | " + " | ".join(key.replace("_mb", " MiB").replace("_", " ") for key in keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for row in rows:
        cells = ["-" if row[key] is None else f"{row[key]:.1f}" for key in keys]
        print(f"| {row['phase']} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.device_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024.0, help="the block of the first phases (default 1024)")
    parser.add_argument("--shapes", type=int, default=40, help="batch sizes of each operation (default 40)")
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    args = parser.parse_args(argv)
    if args.size_mb < 1 or args.shapes < 1:
        parser.error("--size-mb and --shapes must be at least 1")
    rows = run_phases(Readings(DevicePool.open()), args.size_mb, args.shapes)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        print_rows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
