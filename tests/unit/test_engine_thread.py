"""EngineThread.run: results and exceptions reach the awaiting task; cancellation drops queued jobs only."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.common.engine_thread import EngineThread


@pytest.fixture
def engine():
    thread = EngineThread("test-engine")
    yield thread
    thread.close()


def test_run_returns_the_result_computed_on_the_engine_thread(engine):
    async def main():
        return await engine.run(lambda a, b=0: (threading.get_ident(), a + b), 2, b=3)

    ident, total = asyncio.run(main())
    assert ident == engine.ident != threading.get_ident()
    assert total == 5


def test_run_raises_the_jobs_exception(engine):
    async def main():
        with pytest.raises(KeyError, match="missing"):
            await engine.run({}.__getitem__, "missing")
        return await engine.run(int, "7")  # the thread is fine after a failed job

    assert asyncio.run(main()) == 7


def test_cancelling_drops_a_queued_job_and_lets_a_running_one_finish(engine):
    started, release = threading.Event(), threading.Event()
    ran = []

    def blocking() -> str:
        started.set()
        release.wait(5)
        ran.append("blocking")
        return "blocking"

    async def main():
        running = asyncio.create_task(engine.run(blocking))
        queued = asyncio.create_task(engine.run(ran.append, "queued"))
        await asyncio.sleep(0)  # both jobs submitted
        while not started.is_set():
            await asyncio.sleep(0.001)
        running.cancel()
        queued.cancel()
        await asyncio.wait({running, queued})  # both stop waiting while the blocking job still runs
        assert running.cancelled() and queued.cancelled()
        release.set()
        return await engine.run(lambda: list(ran))  # behind everything submitted before

    assert asyncio.run(main()) == ["blocking"]


def test_a_job_that_outlives_its_loop_does_not_break_the_thread(engine):
    started, release = threading.Event(), threading.Event()

    def blocking() -> None:
        started.set()
        release.wait(5)

    async def start():
        asyncio.create_task(engine.run(blocking))
        while not started.is_set():
            await asyncio.sleep(0.001)

    asyncio.run(start())  # the loop closes while the job still runs
    release.set()
    assert engine.submit_sync(lambda: "next") == "next"
