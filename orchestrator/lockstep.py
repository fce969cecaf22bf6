"""One frame clock for every conversation of a process, so the services batch all of them together.

Live conversations start at arbitrary moments, so their frames reach perception spread over the whole 80 ms
frame: each service then steps whichever few are ready, and its later batches split the same way. A
`FrameTicker` holds each conversation's next input frame until the next tick of one shared grid, so every
conversation with a frame ready sends it in the same instant and each stage gets them as one batch. A frame
waits at most one period (on average half); a frame that has already waited a period (its session behind,
catching up) goes at once, so a backlog drains at the services' pace, not the clock's.

    ticker = FrameTicker(0.08)          # the shared grid: ticks at the multiples of 0.08 s of the host's clock
    ticker.wait(arrived)                # in a session's perception sender, before the frame's request

The grid is the same in every process of a host: its ticks are the multiples of the period on the system-wide
monotonic clock (`time.perf_counter`, CLOCK_MONOTONIC on Linux), so several orchestrators over one set of services
(`serve --services`) release their frames in the same instants and the services batch them together too.

Nothing about a frame's numbers changes, only when its request leaves.
"""

from __future__ import annotations

import math

from orchestrator.profile import Clock, MonotonicClock


class FrameTicker:
    """A grid of ticks `period_s` apart on `clock` (the multiples of the period), shared by the sessions of a
    process and by every process reading the same clock (thread-safe: it keeps no per-call state)."""

    def __init__(self, period_s: float, clock: Clock | None = None):
        if not period_s > 0:
            raise ValueError(f"the frame tick must be positive, got {period_s}")
        self.period_s = period_s
        self.clock = clock or MonotonicClock()

    def next_tick(self, now: float) -> float:
        """The first tick at or after `now` (a tick `now` is within a nanosecond of counts as reached)."""
        ticks = math.ceil(round(now / self.period_s, 9))
        return round(ticks * self.period_s, 9)

    def wait(self, arrived: float) -> float:
        """Sleep until the next tick, unless the frame (ready since `arrived`) has waited a period already;
        returns the time it may go."""
        now = self.clock.now()
        if now - arrived >= self.period_s:
            return now
        tick = self.next_tick(now)
        self.clock.sleep(tick - now)
        return tick

