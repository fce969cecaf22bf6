"""Duplex latency of one conversation as a live user feels it: the arithmetic bench.load applies to the times its
clients saw and the orchestrator's front doors apply to the times their frames went out (no MLX; clock injected).

A conversation's audio frame i (its (i+1)-th audio frame, the answer to input frame i) is due i x frame_s after
its first input audio: for a client, when it sent its first chunk; for the server, when that chunk arrived.

    latency_i   = t_i - (t_start + i * frame_s)      how far behind a live microphone frame i is
    gap_i       = t_i - t_(i-1)                      the inter-frame gap (i >= 1)
    jitter_i    = |gap_i - frame_s|                  = |latency_i - latency_(i-1)|: RFC 3550's |D(i-1, i)| with the
                                                     live send schedule as the sender's timestamps (i >= 1)
    late_i      = latency_i > budget_s               a deadline miss (budget 200 ms unless configured)
    first audio = latency_0
    trend       = mean latency of the last W frames - mean latency of the first W frames,
                  W = min(floor(window_s / frame_s), n // 2) of the n frames (5 s: 62 frames of 80 ms)

A conversation's jitter is the mean of its jitter_i (RFC 3550 smooths the same |D| with gain 1/16 instead). A
trend near 0 means latency held steady; one that grows with the run's length means frames fall further behind.

    tracker = LatencyTracker(0.08, budget_s=0.2)   # clock=time.monotonic unless given
    tracker.start()                                # first input audio (later calls keep the first)
    timing = tracker.frame()                       # FrameTiming of the audio frame going out now
    tracker.close()                                # the trend, reported to `metrics` once

With `metrics` (a services.common.metrics.Metrics of the orchestrator) every frame and the closing trend are also
observed there. The tracker holds at most 2 W latencies, however long the conversation.
"""

from __future__ import annotations

import argparse
import collections
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.profile import percentile
from services.common.metrics import DEFAULT_LATENCY_BUDGET_S as DEFAULT_BUDGET_S

TREND_WINDOW_S = 5.0


@dataclass(frozen=True)
class FrameTiming:
    """One audio frame's place against the live schedule (seconds); gap and jitter are None for frame 0."""

    index: int
    latency_s: float
    gap_s: float | None
    jitter_s: float | None
    late: bool


class LatencyTracker:
    """One conversation's audio frames as they go out (or arrive), in order."""

    def __init__(self, frame_s: float, budget_s: float = DEFAULT_BUDGET_S, *, window_s: float = TREND_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic, metrics=None) -> None:
        if not frame_s > 0 or not budget_s > 0 or not window_s > 0:
            raise ValueError(f"frame_s, budget_s and window_s must be positive, got {frame_s}, {budget_s}, {window_s}")
        self.frame_s = frame_s
        self.budget_s = budget_s
        self.clock = clock
        self.metrics = metrics
        self.started: float | None = None  # the first input audio's time
        self.frames = 0
        self._last: float | None = None  # the previous frame's time
        self._window = max(int(window_s / frame_s + 1e-9), 1)  # W's upper bound, in frames
        self._head: list[float] = []  # the first `_window` latencies
        self._tail: collections.deque[float] = collections.deque(maxlen=self._window)  # the last ones
        self._closed = False

    def start(self, now: float | None = None) -> None:
        """The conversation's first input audio, now (or at `now`); later calls change nothing."""
        if self.started is None:
            self.started = self.clock() if now is None else now

    def frame(self, now: float | None = None) -> FrameTiming | None:
        """The next audio frame, out now (or at `now`); None (nothing counted) before any input audio."""
        if self.started is None:
            return None
        now = self.clock() if now is None else now
        index = self.frames
        latency = now - (self.started + index * self.frame_s)
        gap = None if self._last is None else now - self._last
        timing = FrameTiming(index, latency, gap, None if gap is None else abs(gap - self.frame_s),
                             latency > self.budget_s)
        self.frames += 1
        self._last = now
        if len(self._head) < self._window:
            self._head.append(latency)
        self._tail.append(latency)
        if self.metrics is not None:
            self.metrics.frame_latency(timing.latency_s, timing.gap_s, timing.jitter_s, timing.late)
        return timing

    @property
    def trend_s(self) -> float | None:
        """Mean latency of the last W frames minus that of the first W; None below two frames."""
        width = min(self._window, self.frames // 2)
        if width == 0:
            return None
        return _mean(list(self._tail)[-width:]) - _mean(self._head[:width])

    def close(self) -> float | None:
        """The conversation is over: its trend, observed in `metrics` the first time (when there is one)."""
        trend = self.trend_s
        if not self._closed and trend is not None and self.metrics is not None:
            self.metrics.latency_trend(trend)
        self._closed = True
        return trend


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def replay(started: float | None, arrivals: Sequence[float], frame_s: float,
           budget_s: float = DEFAULT_BUDGET_S) -> tuple[LatencyTracker, list[FrameTiming]]:
    """A conversation already recorded (its first chunk's time and each audio frame's): its tracker and timings."""
    tracker = LatencyTracker(frame_s, budget_s)
    if started is None:
        return tracker, []
    tracker.start(started)
    return tracker, [tracker.frame(t) for t in arrivals]


def summarize(conversations: Sequence[tuple[LatencyTracker, list[FrameTiming]]], settle_frames: int = 0) -> dict:
    """Several conversations' figures in ms (None where there is nothing to measure):

        latency_p50_ms / latency_p95_ms / latency_max_ms   over every frame of every conversation
        jitter_ms                                          the mean jitter_i, each conversation's first
                                                           `settle_frames` frames left out (as from its intervals)
        deadline_misses                                    frames later than the budget
        first_audio_p50_ms / first_audio_p95_ms            over the conversations
        trend_ms / trend_max_ms                            the conversations' mean and largest trend
    """
    latencies = [t.latency_s * 1e3 for _, timings in conversations for t in timings]
    jitters = [t.jitter_s * 1e3 for _, timings in conversations for t in timings[settle_frames + 1 :]]
    firsts = [timings[0].latency_s * 1e3 for _, timings in conversations if timings]
    trends = [tracker.trend_s * 1e3 for tracker, _ in conversations if tracker.trend_s is not None]

    def pick(values: list[float], fn: Callable[[list[float]], float]) -> float | None:
        return fn(values) if values else None

    return {
        "latency_p50_ms": pick(latencies, lambda v: percentile(v, 0.5)),
        "latency_p95_ms": pick(latencies, lambda v: percentile(v, 0.95)),
        "latency_max_ms": pick(latencies, max),
        "jitter_ms": pick(jitters, _mean),
        "deadline_misses": sum(t.late for _, timings in conversations for t in timings),
        "first_audio_p50_ms": pick(firsts, lambda v: percentile(v, 0.5)),
        "first_audio_p95_ms": pick(firsts, lambda v: percentile(v, 0.95)),
        "trend_ms": pick(trends, _mean),
        "trend_max_ms": pick(trends, max),
    }


def budget_ms(text: str) -> float:
    """An argparse type: a latency budget in ms (> 0), returned in seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a latency budget in ms (a positive number, e.g. 200)")
    return value / 1e3


def add_budget_flag(parser: argparse.ArgumentParser, flag: str = "--latency-budget-ms") -> None:
    """`flag` MS (default 200): a frame later than this against the live schedule is a deadline miss; the parsed
    value (dest latency_budget_s) is in seconds."""
    parser.add_argument(flag, dest="latency_budget_s", type=budget_ms, default=DEFAULT_BUDGET_S,
                        metavar="MS", help=f"an audio frame later than MS behind a live microphone is a deadline "
                                           f"miss (default {DEFAULT_BUDGET_S * 1e3:g})")
