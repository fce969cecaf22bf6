"""bench.long_session's arithmetic: the per-frame figures of the minute before a mark, and a process's RSS."""

import os

import pytest

from bench.load import Outcome
from bench.long_session import FRAMES_PER_MINUTE, rss_bytes, window_figures


def test_the_figures_cover_the_minute_of_frames_before_the_mark():
    # frame i arrives 0.1 s after the first chunk plus i x 80 ms for the first minute, then every 100 ms (falling
    # 20 ms behind a frame)
    outcome = Outcome("grpc", first_sent=10.0)
    t = 10.1
    for i in range(2 * FRAMES_PER_MINUTE):
        outcome.arrivals.append(t)
        t += 0.08 if i < FRAMES_PER_MINUTE else 0.1
    first = window_figures(outcome, FRAMES_PER_MINUTE, budget_s=0.2)
    assert first["frames"] == FRAMES_PER_MINUTE and first["deadline_misses"] == 0
    assert first["interval_p50_ms"] == pytest.approx(80.0) and first["latency_max_ms"] == pytest.approx(100.0)
    second = window_figures(outcome, 2 * FRAMES_PER_MINUTE, budget_s=0.2)
    assert second["interval_p50_ms"] == pytest.approx(100.0)
    # the last frame is 749 frames x 20 ms behind the first minute's 100 ms
    assert second["latency_max_ms"] == pytest.approx(100.0 + 20.0 * (FRAMES_PER_MINUTE - 1))
    assert second["deadline_misses"] == sum(100.0 + 20.0 * k > 200.0 for k in range(FRAMES_PER_MINUTE))


def test_rss_reads_this_process():
    rss = rss_bytes(os.getpid())
    assert rss is not None and 10 * 2**20 < rss < 64 * 2**30
