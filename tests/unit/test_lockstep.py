"""The shared frame clock (`serve --frame-tick-ms`): frames ready within one period leave together on the next
tick, a frame that has waited a period goes at once, and a session's events do not change."""

from __future__ import annotations

import threading

import pytest

from orchestrator.lockstep import FrameTicker
from tests.unit.test_session import WAVE, FakeClock, comparable, run


class StoppedClock:
    """Time moves only when someone sleeps (or the test sets it)."""

    def __init__(self, t: float = 10.0):
        self.t = t
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.t += max(seconds, 0.0)


def test_frames_ready_within_one_period_leave_on_the_same_tick():
    clock = StoppedClock(10.0)
    ticker = FrameTicker(0.08, clock)  # ticks at 10.00, 10.08, 10.16, ...
    clock.t = 10.101
    assert ticker.wait(arrived=10.1) == pytest.approx(10.16)
    clock.t = 10.159  # another session, ready 58 ms later, goes on the same tick
    assert ticker.wait(arrived=10.159) == pytest.approx(10.16)
    assert clock.slept == [pytest.approx(0.059), pytest.approx(0.001)]


def test_tickers_made_at_different_moments_share_one_grid():
    # two orchestrator processes over one set of services: their frames must leave in the same instants
    clock = StoppedClock(1234.567)
    first = FrameTicker(0.08, clock)
    clock.t = 1301.0101
    second = FrameTicker(0.08, clock)
    for now in (1301.0101, 1301.08, 1302.3999):
        assert first.next_tick(now) == second.next_tick(now)
        assert round(first.next_tick(now) / 0.08, 6) % 1 == 0 and 0 <= first.next_tick(now) - now < 0.08
    assert first.next_tick(1301.0101) == pytest.approx(1301.04)


def test_a_frame_on_a_tick_goes_at_once_and_one_that_waited_a_period_is_not_held_again():
    clock = StoppedClock(0.0)
    ticker = FrameTicker(0.05, clock)
    clock.t = 0.15  # exactly the third tick (floating point: 0.15 / 0.05 is 2.9999999999999996)
    assert ticker.wait(arrived=0.14) == pytest.approx(0.15) and clock.slept == [pytest.approx(0.0, abs=1e-9)]
    clock.t = 0.231
    assert ticker.wait(arrived=0.181) == 0.231  # ready 50 ms ago (its session catching up): no wait
    assert len(clock.slept) == 1


@pytest.mark.parametrize("period", [0.0, -0.08, float("nan")])
def test_a_tick_must_be_positive(period):
    with pytest.raises(ValueError, match="the frame tick must be positive"):
        FrameTicker(period, StoppedClock())


class RecordingTicker(FrameTicker):
    def __init__(self, *args):
        super().__init__(*args)
        self.calls: list[tuple[float, float]] = []  # (arrived, released)
        self._lock = threading.Lock()

    def wait(self, arrived: float) -> float:
        released = super().wait(arrived)
        with self._lock:
            self.calls.append((arrived, released))
        return released


def test_a_ticked_session_gives_the_same_events_and_holds_each_frame_at_most_to_the_next_tick():
    clock = FakeClock()
    ticker = RecordingTicker(0.08, clock)
    ticked = run(WAVE, 1280, pipelined=True, clock=clock, ticker=ticker)
    assert comparable(ticked) == comparable(run(WAVE, 1280, pipelined=True))
    assert len(ticker.calls) == 7  # every frame (6 and the padded one) asked the ticker once
    held = 0
    for arrived, released in ticker.calls:
        if released - arrived >= 0.08:  # caught up: it had waited a period behind the frames before it
            continue
        tick = released / 0.08
        assert abs(tick - round(tick)) < 1e-6 and arrived <= released, (arrived, released)
        held += 1
    assert held >= 1  # the first frame at least waited for a tick


def test_serve_refuses_a_negative_tick(tiny_checkpoint, capsys):
    from orchestrator import cli

    assert cli.main(["serve", "--model", str(tiny_checkpoint), "--frame-tick-ms", "-1", "--in-process"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("error: --frame-tick-ms -1.0: must be zero (off) "
                                                                "or more")
