"""bench.kernels: the device work read off a profiler trace, and what it costs a step (hand-computed cases)."""

from __future__ import annotations

import sys

import pytest

from bench import kernels
from bench.kernels import Kernel


def test_the_trace_gives_its_device_work_in_start_order():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 30.0, "dur": 4.0,
         "args": {"grid": [8, 2, 1], "block": [128, 1, 1]}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.0, "dur": 2.0},  # host side
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 10.0, "dur": 1.5, "args": {"bytes": 4096}},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5.0},  # not a complete event
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 20, "dur": 0.5},
    ]}
    assert kernels.trace_kernels(trace) == [Kernel("Memcpy HtoD", 10.0, 1.5, 4096), Kernel("Memset", 20.0, 0.5),
                                            Kernel("gemv", 30.0, 4.0, 2048)]
    assert kernels.trace_kernels({}) == []


def test_busy_time_counts_overlapping_kernels_once():
    # [0, 10) and [5, 12) overlap into [0, 12); [6, 8) lies inside; [20, 21) stands apart: 12 + 1
    runs = [Kernel("a", 5.0, 7.0), Kernel("b", 0.0, 10.0), Kernel("c", 20.0, 1.0), Kernel("d", 6.0, 2.0)]
    assert kernels.busy_us(runs) == 13.0
    assert kernels.busy_us([Kernel("a", 0.0, 3.0), Kernel("b", 3.0, 2.0)]) == 5.0  # back to back
    assert kernels.busy_us([]) == 0.0


def test_summary_is_per_step_and_ranks_kernels_by_their_time():
    runs = [Kernel("gemm", 0.0, 300.0, 512), Kernel("add", 300.0, 10.0), Kernel("add", 310.0, 30.0),
            Kernel("gemm", 1000.0, 100.0, 256), Kernel("norm", 1100.0, 70.0), Kernel("add", 1150.0, 20.0),
            Kernel("gemm", 1200.0, 0.0, 256)]
    report = kernels.summary(runs, steps=2, top=2)
    assert report["steps"] == 2 and report["kernels_per_step"] == 3.5
    assert report["kernel_ms"] == pytest.approx(0.265)  # 530 us over 2 steps
    assert report["busy_ms"] == pytest.approx(0.255)  # add's last run lies inside norm's: 340 + 170 us
    assert report["top"] == [
        {"name": "gemm", "runs_per_step": 1.5, "ms_per_step": pytest.approx(0.2), "mean_us": pytest.approx(400 / 3),
         "size": 256},  # the size most of its runs had
        {"name": "norm", "runs_per_step": 0.5, "ms_per_step": pytest.approx(0.035), "mean_us": 70.0, "size": 0}]
    with pytest.raises(ValueError, match="steps must be at least 1"):
        kernels.summary(runs, steps=0)


def test_the_table_names_the_totals_and_shortens_long_names():
    report = kernels.summary([Kernel("k" * 100, 0.0, 50.0, 4096), Kernel("add", 60.0, 10.0)], steps=1)
    lines = kernels.table(report)
    assert lines[0] == "2 kernels a step, 0.06 ms of kernels a step (0.06 ms with at least one running), over 1 steps"
    assert lines[3] == f"| `{'k' * 87}...` | 1.0 | 0.050 | 50.0 | 4096 |"
    assert lines[4] == "| `add` | 1.0 | 0.010 | 10.0 | 0 |"


def test_without_pytorch_the_recorder_says_what_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(kernels.KernelRecorderError, match="needs PyTorch's profiler"):
        kernels.KernelRecorder()
