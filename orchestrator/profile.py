"""Per-frame stage timings of an online session and their summary.

Each stage's time is the wall time of its client call, which returns numpy arrays its producer has already
evaluated, so the numbers are real measurements. `total` is the frame's latency (its first stage started to its
last stage done); `interval` is the time from when the frame's completion could begin (its audio pushed and the
previous frame completed, whichever is later) to its completion: the throughput of the pipelined mode (stages
overlap, so intervals are shorter than totals), and the total in the sequential one. Waiting for audio (a live
microphone, `--realtime`) is never counted.

    profile.summary(drop_first=5)["realtime_factor"]   # mean interval / 80 ms; above 1.0 is slower than real time
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

STAGES = ("perception", "rnnt", "language", "tts", "codec")


class Clock(Protocol):
    def now(self) -> float: ...  # seconds, monotonic

    def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


@dataclass(frozen=True)
class FrameTiming:
    frame_index: int
    perception_ms: float
    rnnt_ms: float  # 0 when the RNNT runs inside the perception call (the perception service does both)
    language_ms: float
    tts_ms: float
    codec_ms: float
    total_ms: float
    interval_ms: float


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks: percentile([1, 2, 3, 4], 0.5) == 2.5."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (position - lower) * (ordered[upper] - ordered[lower])


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean_ms": sum(values) / len(values) if values else 0.0,
        "p50_ms": percentile(values, 0.5),
        "p95_ms": percentile(values, 0.95),
        "max_ms": max(values, default=0.0),
    }


@dataclass
class Profile:
    frame_duration_ms: float
    pipelined: bool = False
    frames: list[FrameTiming] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, timing: FrameTiming) -> None:
        with self._lock:
            self.frames.append(timing)

    def summary(self, *, drop_first: int = 0) -> dict:
        """Stage statistics after dropping `drop_first` cold frames; JSON-serializable."""
        with self._lock:
            frames = list(self.frames[drop_first:])
            dropped = min(drop_first, len(self.frames))
        stages = {name: _stats([getattr(f, f"{name}_ms") for f in frames])
                  for name in (*STAGES, "total", "interval")}
        mean_interval = stages["interval"]["mean_ms"]
        return {
            "mode": "pipelined" if self.pipelined else "sequential",
            "frames": len(frames),
            "dropped_cold_frames": dropped,
            "frame_duration_ms": self.frame_duration_ms,
            "processing_frames_per_second": 1000.0 / mean_interval if mean_interval else 0.0,
            "realtime_factor": mean_interval / self.frame_duration_ms if self.frame_duration_ms else 0.0,
            "stages": stages,
        }

    def rows(self) -> list[dict]:
        with self._lock:
            return [asdict(f) for f in self.frames]
