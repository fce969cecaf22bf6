"""bench.long_session's arithmetic: the per-frame figures of the minute before a mark, and a process's RSS."""

import json
import os
from dataclasses import asdict

import pytest

from bench.load import Outcome
from bench.long_session import FRAMES_PER_MINUTE, Memory, Sample, rss_bytes, sample_row, thread_count, window_figures


def test_the_figures_cover_the_minute_of_frames_before_the_mark():
    # frame i arrives 0.1 s after the first chunk plus i x 80 ms for the first minute, then every 100 ms (falling
    # 20 ms behind a frame)
    outcome = Outcome("grpc", first_sent=10.0)
    t = 10.1
    for i in range(2 * FRAMES_PER_MINUTE):
        outcome.arrivals.append(t)
        t += 0.08 if i < FRAMES_PER_MINUTE else 0.1
    first = window_figures(outcome, FRAMES_PER_MINUTE, budget_s=0.2, pace="live")
    assert first["frames"] == FRAMES_PER_MINUTE and first["deadline_misses"] == 0
    assert first["interval_p50_ms"] == pytest.approx(80.0) and first["latency_max_ms"] == pytest.approx(100.0)
    second = window_figures(outcome, 2 * FRAMES_PER_MINUTE, budget_s=0.2, pace="live")
    assert second["interval_p50_ms"] == pytest.approx(100.0)
    # the last frame is 749 frames x 20 ms behind the first minute's 100 ms
    assert second["latency_max_ms"] == pytest.approx(100.0 + 20.0 * (FRAMES_PER_MINUTE - 1))
    assert second["deadline_misses"] == sum(100.0 + 20.0 * k > 200.0 for k in range(FRAMES_PER_MINUTE))


def _three_frames(*arrivals: float) -> Outcome:
    outcome = Outcome("grpc", first_sent=10.0)
    outcome.arrivals.extend(arrivals)
    return outcome


def _row(figures: dict) -> list[str]:
    """The interval and latency cells of a table row: int p50, int p95, lat p50, lat p95, lat max."""
    sample = Sample(1.0, figures["frames"], 1.0, {"orchestrator": Memory(2**20)}, figures)
    return sample_row(sample).split()[3:8]


def test_live_pace_reports_latency_against_the_live_schedule():
    # frame i due at 10.0 + i x 80 ms: latencies 50, 120, 240 ms; intervals 150, 200 ms; one past the 200 ms budget
    figures = window_figures(_three_frames(10.05, 10.2, 10.4), 3, budget_s=0.2, pace="live")
    assert figures.pop("received_kb_per_frame") is None  # frames added without their bytes
    assert figures == pytest.approx({"frames": 3, "interval_p50_ms": 175.0, "interval_p95_ms": 197.5,
                                     "latency_p50_ms": 120.0, "latency_p95_ms": 228.0, "latency_max_ms": 240.0,
                                     "deadline_misses": 1})
    assert _row(figures) == ["175.0", "197.5", "120.0", "228.0", "240.0"]


def test_burst_pace_reports_intervals_but_no_latency():
    # sent far ahead of a live microphone: the latencies would be 50, -20, -80 ms, meaningless, so not shown
    figures = window_figures(_three_frames(10.05, 10.06, 10.08), 3, budget_s=0.2, pace="burst")
    assert figures["frames"] == 3
    assert figures["interval_p50_ms"] == pytest.approx(15.0) and figures["interval_p95_ms"] == pytest.approx(19.5)
    assert all(figures[k] is None for k in ("latency_p50_ms", "latency_p95_ms", "latency_max_ms",
                                            "deadline_misses"))
    assert _row(figures) == ["15.0", "19.5", "-", "-", "-"]
    sample = Sample(1.0, 3, 1.0, {"orchestrator": Memory(2**20)}, figures)
    assert json.loads(json.dumps(asdict(sample)))["figures"]["latency_p50_ms"] is None


def test_rss_reads_this_process():
    rss = rss_bytes(os.getpid())
    assert rss is not None and 10 * 2**20 < rss < 64 * 2**30


def test_received_bytes_a_frame_cover_the_minute_before_the_mark():
    # every frame's messages are 1000 bytes in the first minute, then 1000 + 10 x k bytes for its k-th frame after
    outcome, total = Outcome("grpc", first_sent=10.0), 0
    for i in range(2 * FRAMES_PER_MINUTE):
        total += 1000 + (10 * (i - FRAMES_PER_MINUTE) if i >= FRAMES_PER_MINUTE else 0)
        outcome.received_bytes = total
        outcome.add_audio([0], b"", 10.1 + 0.08 * i)
    first = window_figures(outcome, FRAMES_PER_MINUTE, budget_s=0.2, pace="burst")
    assert first["received_kb_per_frame"] == pytest.approx(1.0)
    second = window_figures(outcome, 2 * FRAMES_PER_MINUTE, budget_s=0.2, pace="burst")
    # mean of 1000 + 10 k over k = 0 .. 749: 1000 + 5 x 749 bytes
    assert second["received_kb_per_frame"] == pytest.approx((1000 + 5 * (FRAMES_PER_MINUTE - 1)) / 1e3)
    sample = Sample(2.0, second["frames"], 1.0, {"orchestrator": Memory(2**20)}, second)
    assert sample_row(sample).split()[8] == f"{(1000 + 5 * (FRAMES_PER_MINUTE - 1)) / 1e3:.1f}"


def test_thread_count_reads_this_process_and_the_row_shows_it():
    import threading

    release = threading.Event()
    extra = [threading.Thread(target=release.wait) for _ in range(3)]
    for thread in extra:
        thread.start()
    try:  # the main thread and these three at least (other tests' library threads may come and go meanwhile)
        assert thread_count(os.getpid()) >= 4
    finally:
        release.set()
        for thread in extra:
            thread.join()
    sample = Sample(1.0, 3, 1.0, {"orchestrator": Memory(2**20, threads=7)}, {"frames": 3})
    assert sample_row(sample).endswith("orchestrator 1 (7 threads)")
