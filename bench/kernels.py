"""The GPU kernels a stretch of work ran, each timed on the device: what an engine's step costs the GPU.

`KernelRecorder` records every kernel (and device copy or fill) the process runs between `start()` and
`stop()`, through CUPTI as PyTorch's profiler exposes it: whatever library launched a kernel, MLX included,
CUPTI sees it. PyTorch is not a dependency of the project; a GPU host that has it (the lent H200's image does)
can record, others get `KernelRecorderError` saying so. `summary` turns the records into what a step costs the
GPU: kernels a step, the time they ran (their sum, and the time at least one ran, which is less where kernels
overlap), and the kernels that took the most.

`bench.service NAME --no-grpc --kernels N` records its measured steps and prints the N costliest kernels;
`bench.contention --kernels` puts each engine's device time a step beside its wall time, alone and beside the
other engines.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's categories of device work


class KernelRecorderError(RuntimeError):
    """The kernels cannot be recorded here."""


@dataclass(frozen=True)
class Kernel:
    """One run of one kernel (or device copy or fill) on the device, its times in microseconds; `size` is the
    threads it launched (grid times block), or for a copy or fill its bytes (0 where the trace gives neither)."""

    name: str
    start_us: float
    duration_us: float
    size: int = 0


def _size(args: dict) -> int:
    """Threads launched (grid x block) or bytes moved, from a trace event's args."""
    if "grid" in args and "block" in args:
        return math.prod(args["grid"]) * math.prod(args["block"])
    return int(args.get("bytes", 0))


def trace_kernels(trace: dict) -> list[Kernel]:
    """The device work of a Chrome trace as PyTorch's profiler exports it: its complete events ("ph": "X") of
    the categories in DEVICE_CATEGORIES, in the order they started."""
    kernels = [Kernel(event["name"], float(event["ts"]), float(event["dur"]), _size(event.get("args", {})))
               for event in trace.get("traceEvents", [])
               if event.get("ph") == "X" and event.get("cat") in DEVICE_CATEGORIES]
    return sorted(kernels, key=lambda kernel: kernel.start_us)


def busy_us(kernels: list[Kernel]) -> float:
    """The time at least one of `kernels` was running: the length of the union of their intervals."""
    total, end = 0.0, float("-inf")
    for kernel in sorted(kernels, key=lambda k: k.start_us):
        finish = kernel.start_us + kernel.duration_us
        if kernel.start_us >= end:
            total += kernel.duration_us
            end = finish
        elif finish > end:
            total += finish - end
            end = finish
    return total


def summary(kernels: list[Kernel], steps: int, top: int = 10) -> dict:
    """What `steps` steps' kernels cost the device, a step: their count, their summed time (`kernel_ms`), the
    time at least one ran (`busy_ms`), and the `top` kernel names by summed time, each with its runs a step,
    its time a step, its mean run (microseconds) and the size its runs had most often (threads, or a copy's
    bytes: what says which array a kernel worked on)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    by_name: dict[str, list[float]] = defaultdict(list)
    sizes: dict[str, Counter[int]] = defaultdict(Counter)
    for kernel in kernels:
        by_name[kernel.name].append(kernel.duration_us)
        sizes[kernel.name][kernel.size] += 1
    ranked = sorted(by_name.items(), key=lambda item: (-sum(item[1]), item[0]))
    return {
        "steps": steps,
        "kernels_per_step": len(kernels) / steps,
        "kernel_ms": sum(kernel.duration_us for kernel in kernels) / steps / 1000.0,
        "busy_ms": busy_us(kernels) / steps / 1000.0,
        "top": [{"name": name, "runs_per_step": len(runs) / steps, "ms_per_step": sum(runs) / steps / 1000.0,
                 "mean_us": sum(runs) / len(runs), "size": sizes[name].most_common(1)[0][0]}
                for name, runs in ranked[:top]],
    }


class KernelRecorder:
    """Records the device work of this process between `start()` and `stop()`; `stop()` returns it."""

    def __init__(self) -> None:
        try:
            import torch
            import torch.profiler
        except ImportError:
            raise KernelRecorderError("recording kernels needs PyTorch's profiler (CUPTI): install torch with "
                                      "CUDA in this Python, or leave out --kernels") from None
        if not torch.cuda.is_available():
            raise KernelRecorderError("recording kernels needs a CUDA GPU that PyTorch sees; this PyTorch sees none")
        self._profiler_module = torch.profiler
        self._profiler = None

    def start(self) -> None:
        if self._profiler is not None:
            raise KernelRecorderError("the recorder is already started")
        profiler = self._profiler_module
        self._profiler = profiler.profile(activities=[profiler.ProfilerActivity.CUDA])
        self._profiler.__enter__()

    def stop(self) -> list[Kernel]:
        if self._profiler is None:
            raise KernelRecorderError("the recorder was not started")
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "trace.json"
            profiler.export_chrome_trace(str(path))
            return trace_kernels(json.loads(path.read_text()))


def table(report: dict) -> list[str]:
    """Markdown lines of a `summary`: the totals, then its top kernels."""
    lines = [f"{report['kernels_per_step']:.0f} kernels a step, {report['kernel_ms']:.2f} ms of kernels a step "
             f"({report['busy_ms']:.2f} ms with at least one running), over {report['steps']} steps",
             "| kernel | runs a step | ms a step | mean us | size (threads or bytes) |",
             "| --- | --- | --- | --- | --- |"]
    for row in report["top"]:
        name = row["name"] if len(row["name"]) <= 90 else row["name"][:87] + "..."
        lines.append(f"| `{name}` | {row['runs_per_step']:.1f} | {row['ms_per_step']:.3f} | {row['mean_us']:.1f} | "
                     f"{row['size']} |")
    return lines
