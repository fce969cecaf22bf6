"""Duplex latency arithmetic (orchestrator/latency.py) on hand-computed cases, with a fake clock, and its Prometheus
series on the orchestrator's Metrics."""

from __future__ import annotations

import argparse

import pytest

from orchestrator.latency import LatencyTracker, add_budget_flag, replay, summarize
from services.common.metrics import Metrics

FRAME_S = 0.08
START = 10.0
# frames out 100, 200, 260 and 500 ms after the first input audio; due at 0, 80, 160 and 240 ms
OUT = [10.10, 10.20, 10.26, 10.50]


class FakeClock:
    def __init__(self, times: list[float]):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_each_frame_against_the_live_schedule():
    tracker = LatencyTracker(FRAME_S, budget_s=0.2, clock=FakeClock([START, *OUT]))
    assert tracker.frame() is None and tracker.frames == 0  # nothing is due before the first input audio
    tracker.start()
    tracker.start(99.0)  # a later chunk: the first one's time stays
    timings = [tracker.frame() for _ in OUT]
    assert [t.index for t in timings] == [0, 1, 2, 3]
    assert [t.latency_s for t in timings] == pytest.approx([0.10, 0.12, 0.10, 0.26])
    assert timings[0].gap_s is None and timings[0].jitter_s is None
    assert [t.gap_s for t in timings[1:]] == pytest.approx([0.10, 0.06, 0.24])
    assert [t.jitter_s for t in timings[1:]] == pytest.approx([0.02, 0.02, 0.16])  # |gap - 80 ms|
    assert [t.late for t in timings] == [False, False, False, True]  # only 260 ms is past 200
    # four frames: W = 2, (100 + 260) / 2 - (100 + 120) / 2 = 70 ms
    assert tracker.trend_s == pytest.approx(0.07)


def test_the_trend_compares_the_first_and_last_five_seconds_in_bounded_memory():
    # latency grows 10 ms a frame for 200 frames (16 s): W = 62 frames (4.96 s), trend = 10 ms x (200 - 62)
    tracker = LatencyTracker(FRAME_S)
    tracker.start(0.0)
    for i in range(200):
        tracker.frame(i * FRAME_S + 0.1 + 0.01 * i)
    assert tracker.trend_s == pytest.approx(1.38)
    assert len(tracker._head) == len(tracker._tail) == 62
    one = LatencyTracker(FRAME_S)
    one.start(0.0)
    assert one.trend_s is None and one.close() is None  # fewer than two frames: no trend
    one.frame(0.3)
    assert one.trend_s is None
    one.frame(0.3)  # 300 then 220 ms: W = 1
    assert one.trend_s == pytest.approx(-0.08)


def test_a_conversation_summary_in_ms():
    first = replay(START, OUT, FRAME_S)
    steady = replay(0.0, [0.05, 0.13], FRAME_S, budget_s=0.2)  # 50 and 50 ms, gap 80 ms: no jitter, no trend
    silent = replay(None, [], FRAME_S)  # never sent audio
    s = summarize([first, steady, silent])
    # latencies 100, 120, 100, 260, 50, 50: sorted 50 50 100 100 120 260
    assert s["latency_p50_ms"] == pytest.approx(100.0)
    assert s["latency_p95_ms"] == pytest.approx(120 + 0.75 * 140)  # rank 4.75
    assert s["latency_max_ms"] == pytest.approx(260.0)
    assert s["jitter_ms"] == pytest.approx((20 + 20 + 160 + 0) / 4)
    assert s["deadline_misses"] == 1
    assert s["first_audio_p50_ms"] == pytest.approx(75.0) and s["first_audio_p95_ms"] == pytest.approx(97.5)
    assert s["trend_ms"] == pytest.approx((70 + 0) / 2) and s["trend_max_ms"] == pytest.approx(70.0)
    settled = summarize([first], settle_frames=1)  # the jitter of frame 1 (gap 100 ms) left out
    assert settled["jitter_ms"] == pytest.approx((20 + 160) / 2) and settled["deadline_misses"] == 1
    assert summarize([silent]) == {key: (0 if key == "deadline_misses" else None) for key in s}
    assert summarize([replay(START, OUT, FRAME_S, budget_s=0.11)])["deadline_misses"] == 2  # 120 and 260 ms


def test_the_orchestrators_histograms_see_every_frame_and_one_trend_per_conversation():
    metrics = Metrics("orchestrator", latency_budget_s=0.11)
    tracker = LatencyTracker(FRAME_S, metrics.latency_budget_s, metrics=metrics)
    tracker.start(START)
    for t in OUT:
        tracker.frame(t)
    assert tracker.close() == pytest.approx(0.07) and tracker.close() == pytest.approx(0.07)  # observed once

    def value(name: str, **labels: str) -> float | None:
        return metrics.value(name, **labels)

    assert value("voicechat_frame_latency_seconds_count") == 4
    assert value("voicechat_frame_latency_seconds_sum") == pytest.approx(0.58)
    assert value("voicechat_frame_latency_seconds_bucket", le="0.15") == 3
    assert value("voicechat_frame_latency_seconds_bucket", le="0.25") == 3
    assert value("voicechat_frame_gap_seconds_count") == 3
    assert value("voicechat_frame_gap_seconds_sum") == pytest.approx(0.40)
    assert value("voicechat_frame_jitter_seconds_count") == 3
    assert value("voicechat_frame_jitter_seconds_sum") == pytest.approx(0.20)
    assert value("voicechat_first_audio_seconds_count") == 1
    assert value("voicechat_first_audio_seconds_sum") == pytest.approx(0.10)
    assert value("voicechat_deadline_misses_total") == 2
    assert value("voicechat_latency_trend_seconds_count") == 1
    assert value("voicechat_latency_trend_seconds_sum") is None  # negative buckets: no _sum (Prometheus's rule)
    assert value("voicechat_latency_trend_seconds_bucket", le="0.1") == 1
    assert value("voicechat_latency_trend_seconds_bucket", le="0.05") == 0
    with pytest.raises(ValueError, match="orchestrator"):
        Metrics("llm").frame_latency(0.1, None, None, False)
    with pytest.raises(ValueError, match="latency_budget_s"):
        Metrics("orchestrator", latency_budget_s=0)


def test_the_budget_flag_takes_ms_and_refuses_what_is_not_a_positive_number(capsys):
    parser = argparse.ArgumentParser()
    add_budget_flag(parser)
    assert parser.parse_args([]).latency_budget_s == 0.2
    assert parser.parse_args(["--latency-budget-ms", "150"]).latency_budget_s == pytest.approx(0.15)
    for bad in ("0", "-5", "abc", "inf", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--latency-budget-ms", bad])
        assert "is not a latency budget in ms" in capsys.readouterr().err
    with pytest.raises(ValueError, match="positive"):
        LatencyTracker(FRAME_S, budget_s=-1)
