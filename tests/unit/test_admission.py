"""The slots both front doors admit conversations into: capacity, one release per slot, drain and restart refusals,
and the wait a drain does for the last slot."""

from __future__ import annotations

import asyncio
import threading

import pytest

from orchestrator.admission import BUSY, SHUTTING_DOWN, UNAVAILABLE, Admission, Refusal, Slot


def test_admits_up_to_max_sessions_then_refuses_busy():
    admission = Admission(2)
    first, second = admission.try_admit(), admission.try_admit()
    assert isinstance(first, Slot) and isinstance(second, Slot) and first.held
    assert admission.live == 2
    assert admission.try_admit() == Refusal(BUSY)
    assert admission.live == 2  # a refusal takes nothing
    assert first.release() is True
    assert admission.live == 1
    third = admission.try_admit()
    assert isinstance(third, Slot) and admission.live == 2


def test_a_slot_released_twice_frees_one_place():
    admission = Admission(3)
    slots = [admission.try_admit() for _ in range(3)]
    assert slots[0].release() is True
    assert slots[0].release() is False
    assert not slots[0].held
    assert admission.live == 2  # not 1: the second release was a no-op
    assert [s.release() for s in slots[1:]] == [True, True]
    assert admission.live == 0


def test_draining_refuses_new_conversations_and_keeps_those_running():
    admission = Admission(4)
    running = admission.try_admit()
    admission.drain()
    assert admission.draining
    assert admission.try_admit() == Refusal(SHUTTING_DOWN)
    assert admission.refusal() == Refusal(SHUTTING_DOWN)
    assert admission.live == 1
    assert running.release() is True and admission.live == 0
    assert admission.try_admit() == Refusal(SHUTTING_DOWN)  # a drain is for good


def test_a_restarting_service_refuses_with_its_reason_until_it_serves_again():
    admission = Admission(1)
    admission.unavailable = "the tts service restarts (exit code 1)"
    assert admission.try_admit() == Refusal(UNAVAILABLE, "the tts service restarts (exit code 1)")
    admission.unavailable = None
    assert admission.refusal() is None
    assert isinstance(admission.try_admit(), Slot)
    admission.unavailable = "down"
    admission.drain()
    assert admission.try_admit() == Refusal(SHUTTING_DOWN)  # shutting down is said before unavailable


def test_capacity_is_checked_after_the_other_refusals():
    admission = Admission(1)
    admission.try_admit()
    admission.unavailable = "the llm service restarts"
    assert admission.try_admit().kind == UNAVAILABLE


def test_max_sessions_must_be_positive():
    with pytest.raises(ValueError, match="max_sessions must be at least 1, got 0"):
        Admission(0)


def test_concurrent_releases_of_one_slot_count_once():
    admission = Admission(2)
    slot, other = admission.try_admit(), admission.try_admit()
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(slot.release())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True]
    assert admission.live == 1 and other.held


def test_wait_idle_returns_when_the_last_slot_is_released_or_at_the_timeout():
    async def scenario():
        admission = Admission(2)
        slot = admission.try_admit()
        assert await admission.wait_idle(0.05, poll_s=0.01) is False  # still held at the timeout
        asyncio.get_running_loop().call_later(0.03, slot.release)
        assert await admission.wait_idle(5.0, poll_s=0.01) is True
        assert await Admission(1).wait_idle(0.0) is True  # nothing held: at once

    asyncio.run(scenario())
