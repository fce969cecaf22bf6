"""StepBatcher: concurrent submissions form batches while the engine thread is busy, results and errors reach
their own caller, cancelled callers are dropped, max_batch bounds a batch; run_entries isolates entry errors."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.common.batching import SNAPSHOT, StepBatcher, answer_snapshots, is_snapshot, pipelined, run_entries
from services.common.engine_thread import EngineThread


class Recorder:
    """A batched 'engine': entry -> entry * 10; entries < 0 fail alone; the first batch can be held."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.started = threading.Event()

    def __call__(self, entries: list[int]) -> list[int | BaseException]:
        self.batches.append(list(entries))
        self.started.set()
        self.hold.wait(5)
        return [ValueError(f"bad entry {e}") if e < 0 else e * 10 for e in entries]


@pytest.fixture
def engine_thread():
    with EngineThread(name="test-batching") as thread:
        yield thread


async def _wait_started(recorder: Recorder) -> None:
    while not recorder.started.is_set():
        await asyncio.sleep(0.001)


async def _behind_a_held_batch(recorder: Recorder, batcher: StepBatcher, queue):
    """Hold batch [0] on the engine thread, await queue() (it submits more steps) meanwhile, then release the
    batch; returns what queue() returned."""
    recorder.hold.clear()
    blocker = asyncio.ensure_future(batcher.submit(0))
    await _wait_started(recorder)
    queued = await queue()
    recorder.hold.set()
    await blocker
    return queued


def test_steps_arriving_during_a_batch_form_the_next_one(engine_thread):
    recorder, sizes = Recorder(), []
    batcher = StepBatcher(engine_thread, recorder, max_batch=4, on_batch=sizes.append)

    async def scenario():
        recorder.hold.clear()
        first = asyncio.ensure_future(batcher.submit(1))
        await _wait_started(recorder)  # batch [1] is on the engine thread and held there
        rest = [asyncio.ensure_future(batcher.submit(n)) for n in range(2, 12)]
        await asyncio.sleep(0.01)
        recorder.hold.set()
        return await first, await asyncio.gather(*rest)

    first, rest = asyncio.run(scenario())
    assert first == 10 and rest == [n * 10 for n in range(2, 12)]
    assert recorder.batches == [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11]]
    assert sizes == [1, 4, 4, 2]


def test_a_lone_step_runs_alone_and_at_once(engine_thread):
    recorder = Recorder()
    batcher = StepBatcher(engine_thread, recorder)

    async def scenario():
        return [await batcher.submit(n) for n in (3, 4)]

    assert asyncio.run(scenario()) == [30, 40]
    assert recorder.batches == [[3], [4]]


def test_an_entry_error_reaches_its_caller_only(engine_thread):
    recorder = Recorder()
    batcher = StepBatcher(engine_thread, recorder)

    async def scenario():
        async def queue():
            return [asyncio.ensure_future(batcher.submit(n)) for n in (5, -1, 6)]

        futures = await _behind_a_held_batch(recorder, batcher, queue)
        return await asyncio.gather(*futures, return_exceptions=True)

    good, bad, other = asyncio.run(scenario())
    assert (good, other) == (50, 60)
    assert isinstance(bad, ValueError) and str(bad) == "bad entry -1"
    assert recorder.batches == [[0], [5, -1, 6]]


def test_a_failing_batch_fails_its_callers_and_the_next_batch_still_runs(engine_thread):
    calls = []

    def flaky(entries):
        calls.append(list(entries))
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return [e + 1 for e in entries]

    batcher = StepBatcher(engine_thread, flaky)

    async def scenario():
        with pytest.raises(RuntimeError, match="device lost"):
            await batcher.submit(1)
        return await batcher.submit(2)

    assert asyncio.run(scenario()) == 3


def test_a_caller_cancelled_while_queued_is_dropped(engine_thread):
    recorder = Recorder()
    batcher = StepBatcher(engine_thread, recorder)

    async def scenario():
        async def queue():
            gone = asyncio.ensure_future(batcher.submit(7))
            kept = asyncio.ensure_future(batcher.submit(8))
            await asyncio.sleep(0)  # both are queued
            gone.cancel()
            return kept

        return await (await _behind_a_held_batch(recorder, batcher, queue))

    assert asyncio.run(scenario()) == 80
    assert recorder.batches == [[0], [8]]


def test_a_result_count_mismatch_is_an_error(engine_thread):
    batcher = StepBatcher(engine_thread, lambda entries: [])

    async def scenario():
        await batcher.submit(1)

    with pytest.raises(RuntimeError, match="returned 0 results for 1 entries"):
        asyncio.run(scenario())


def test_max_batch_must_be_positive(engine_thread):
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        StepBatcher(engine_thread, lambda entries: entries, max_batch=0)


def test_run_entries_keeps_each_entrys_error_its_own():
    seen = []

    def prepare(entry: str) -> int:
        return int(entry)  # "x" fails here

    def run(values: list[int]) -> list[int | BaseException]:
        seen.append(values)
        return [ValueError("negative") if v < 0 else v * 2 for v in values]

    def finish(entry: str, out: int) -> str:
        if out == 8:
            raise KeyError("no reply for 4")
        return f"{entry}->{out}"

    results = run_entries(["1", "x", "-2", "3", "4"], prepare, run, finish)
    assert seen == [[1, -2, 3, 4]]
    assert results[0] == "1->2" and results[3] == "3->6"
    assert isinstance(results[1], ValueError) and "invalid literal" in str(results[1])
    assert isinstance(results[2], ValueError) and str(results[2]) == "negative"
    assert isinstance(results[4], KeyError)


def test_run_entries_skips_the_batch_when_nothing_is_left():
    ran = []
    results = run_entries(["x"], int, lambda values: ran.append(values) or [], str)
    assert ran == [] and isinstance(results[0], ValueError)


def test_entry_points_keep_float32_matmuls_out_of_tf32_unless_told(tmp_path):
    """Importing the services sets nothing; a service's entry point (`run_service`, here failing on a missing
    model directory after it) and the orchestrator's set MLX_ENABLE_TF32=0 unless the environment chose, and the
    CUDA plan caches' sizes the same way."""
    import os
    import subprocess
    import sys

    imported = "import os, services.llm.engine, orchestrator.cli; print(os.environ.get('MLX_ENABLE_TF32'))"
    service = ("import os\nfrom services.common.cli import run_service\n"
               "try:\n    run_service(None, prog='p', description='d', argv=['--model', '/nonexistent'])\n"
               "except SystemExit:\n    print(os.environ.get('MLX_ENABLE_TF32'))")
    orchestrator = ("import os\nfrom orchestrator.cli import main\n"
                    "try:\n    main(['--help'])\nexcept SystemExit:\n    print(os.environ.get('MLX_ENABLE_TF32'))")
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}

    def probe(code: str, **extra: str) -> str:
        run = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                             check=True)
        return run.stdout.strip().splitlines()[-1]

    assert probe(imported) == "None"
    assert [probe(service), probe(service, MLX_ENABLE_TF32="1")] == ["0", "1"]
    assert [probe(orchestrator), probe(orchestrator, MLX_ENABLE_TF32="1")] == ["0", "1"]
    conv = service.replace("'MLX_ENABLE_TF32'", "'MLX_CUDA_CONV_CACHE_SIZE'")
    assert [probe(conv), probe(conv, MLX_CUDA_CONV_CACHE_SIZE="64")] == ["4096", "64"]


def test_queued_and_running_count_the_steps_not_yet_answered(engine_thread):
    recorder = Recorder()
    batcher = StepBatcher(engine_thread, recorder)

    async def scenario():
        recorder.hold.clear()
        first = asyncio.ensure_future(batcher.submit(1))
        await _wait_started(recorder)
        more = [asyncio.ensure_future(batcher.submit(n)) for n in (2, 3)]
        await asyncio.sleep(0)
        counts = (batcher.running, batcher.queued)
        recorder.hold.set()
        await asyncio.gather(first, *more)
        return counts, (batcher.running, batcher.queued)

    assert asyncio.run(scenario()) == ((1, 2), (0, 0))


def test_an_idle_engine_waits_briefly_for_the_other_open_sessions(engine_thread):
    recorder = Recorder()
    batcher = StepBatcher(engine_thread, recorder, sessions=lambda: 3, gather_s=0.9)

    async def scenario():
        first = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.05)  # well inside the gather window
        return await asyncio.gather(first, batcher.submit(2), batcher.submit(3))

    assert asyncio.run(scenario()) == [10, 20, 30]
    assert recorder.batches == [[1, 2, 3]]


def test_the_gather_wait_ends_at_its_deadline_and_never_exceeds_max_batch(engine_thread):
    recorder = Recorder()
    batcher = StepBatcher(engine_thread, recorder, max_batch=2, sessions=lambda: 3, gather_s=0.05)

    async def scenario():
        loop = asyncio.get_running_loop()
        start = loop.time()
        alone = await batcher.submit(1)  # the other two sessions never send: it runs after the deadline
        waited = loop.time() - start
        pair = await asyncio.gather(*(batcher.submit(n) for n in (2, 3, 4)))
        return alone, waited, pair

    alone, waited, pair = asyncio.run(scenario())
    assert alone == 10 and waited >= 0.045
    assert pair == [20, 30, 40] and recorder.batches[1:] == [[2, 3], [4]]


def test_a_lone_session_never_waits_for_company(engine_thread):
    recorder = Recorder()
    batcher = StepBatcher(engine_thread, recorder, sessions=lambda: 1, gather_s=0.9)

    async def scenario():
        loop = asyncio.get_running_loop()
        start = loop.time()
        results = [await batcher.submit(n) for n in range(3)]
        return results, loop.time() - start

    results, elapsed = asyncio.run(scenario())
    assert results == [0, 10, 20] and elapsed < 0.9  # one gather window would already be 0.9 s


def test_gather_must_be_under_a_second(engine_thread):
    with pytest.raises(ValueError, match="gather_s must be in"):
        StepBatcher(engine_thread, lambda entries: entries, gather_s=1.5)


def test_precompile_runs_on_the_engine_thread_capped_at_max_batch(engine_thread):
    from services.common.batching import BatchOptions

    calls = []

    def precompile(sizes: int) -> None:
        calls.append((sizes, engine_thread.on_engine_thread()))

    async def scenario(options):
        await StepBatcher.with_options(engine_thread, lambda entries: entries, options).precompile(precompile)

    asyncio.run(scenario(BatchOptions(max_batch=4, precompile=9)))
    asyncio.run(scenario(BatchOptions(max_batch=8, precompile=3)))
    asyncio.run(scenario(BatchOptions(max_batch=8)))  # 0: nothing at load
    assert calls == [(4, True), (3, True)]


def test_precompile_hands_back_the_cache_and_the_pools_reserve_its_steps_left(engine_thread, monkeypatch):
    import mlx.core as mx

    from services.common import batching

    class Pool:  # a driver pool holding 64 MiB that no array uses, until trimmed
        def __init__(self) -> None:
            self.trims, self.unused = [], 64 << 20

        def reserved(self) -> int:
            return (1 << 30) + self.unused

        def trim(self) -> None:
            self.trims.append(mx.get_cache_memory())  # the cache went back first
            self.unused = 0

    pool = Pool()
    monkeypatch.setattr(batching, "process_pool", lambda: pool)

    def precompile(sizes: int) -> None:  # a trace's step: its buffers freed into the cache
        for n in range(1, sizes + 1):
            mx.eval(mx.zeros((n << 18,)))

    async def scenario():
        options = batching.BatchOptions(max_batch=4, precompile=4)
        await StepBatcher.with_options(engine_thread, lambda entries: entries, options).precompile(precompile)

    previous = mx.set_cache_limit(1 << 34)
    try:
        mx.clear_cache()
        asyncio.run(scenario())
        assert mx.get_cache_memory() == 0
    finally:
        mx.set_cache_limit(previous)
    assert pool.trims == [0] and pool.unused == 0
    assert batching.precompiled(lambda sizes: None, 1) == (0, 0)  # nothing left idle: nothing handed back


def test_a_lone_sessions_step_runs_in_its_own_task(engine_thread, monkeypatch):
    recorder, sizes, tasks = Recorder(), [], []
    batcher = StepBatcher(engine_thread, recorder, on_batch=sizes.append, sessions=lambda: 1)
    create_task = asyncio.create_task

    def counted(coro, **kwargs):
        tasks.append(coro)
        return create_task(coro, **kwargs)

    monkeypatch.setattr(asyncio, "create_task", counted)

    async def scenario():
        return [await batcher.submit(1), await _error_of(batcher.submit(-2)), await batcher.submit(3)]

    assert asyncio.run(scenario()) == [10, "bad entry -2", 30]
    assert recorder.batches == [[1], [-2], [3]] and sizes == [1, 1, 1]
    assert tasks == []  # no batching task: each step ran straight from its caller


async def _lone_step_on_the_engine(batcher: StepBatcher, recorder: Recorder, open_sessions: list[int],
                                   opened: int) -> asyncio.Future:
    """Session 1, alone, submits its step and the step is held on the engine thread; then `opened` sessions are
    open. Returns the lone step's future."""
    recorder.hold.clear()
    solo = asyncio.ensure_future(batcher.submit(1))
    await _wait_started(recorder)
    open_sessions[0] = opened
    return solo


def test_steps_arriving_during_a_lone_sessions_step_are_drained_after_it(engine_thread):
    recorder, open_sessions = Recorder(), [1]
    batcher = StepBatcher(engine_thread, recorder, sessions=lambda: open_sessions[0])

    async def scenario():
        solo = await _lone_step_on_the_engine(batcher, recorder, open_sessions, 3)
        later = [asyncio.ensure_future(batcher.submit(n)) for n in (2, 3)]  # two more sessions' first steps
        await asyncio.sleep(0.01)
        counts = (batcher.running, batcher.queued)
        recorder.hold.set()
        return await solo, await asyncio.gather(*later), counts

    solo, later, counts = asyncio.run(scenario())
    assert solo == 10 and later == [20, 30] and counts == (1, 2)
    assert recorder.batches == [[1], [2, 3]]


def test_a_cancelled_lone_step_still_lets_queued_steps_run(engine_thread):
    recorder, open_sessions = Recorder(), [1]
    batcher = StepBatcher(engine_thread, recorder, sessions=lambda: open_sessions[0])

    async def scenario():
        solo = await _lone_step_on_the_engine(batcher, recorder, open_sessions, 2)
        other = asyncio.ensure_future(batcher.submit(2))
        await asyncio.sleep(0)
        solo.cancel()
        await asyncio.wait({solo})
        recorder.hold.set()
        return solo.cancelled(), await other

    assert asyncio.run(scenario()) == (True, 20)
    assert recorder.batches == [[1], [2]]


async def _error_of(awaitable) -> str:
    try:
        await awaitable
    except ValueError as error:
        return str(error)
    raise AssertionError("no error")


def test_the_step_log_gets_each_batched_call_in_order_with_its_times_and_size(engine_thread, tmp_path):
    import time

    from services.common.steplog import StepLog, read_steps

    path = tmp_path / "steps.jsonl"
    recorder = Recorder()
    log = StepLog.open(path)
    batcher = StepBatcher(engine_thread, recorder, max_batch=4, step_log=log)
    before = time.monotonic()

    async def queue():
        steps = [asyncio.ensure_future(batcher.submit(n)) for n in (1, 2, 3)]
        await asyncio.sleep(0.01)  # queued behind the held batch
        return steps

    async def scenario():
        return await asyncio.gather(*await _behind_a_held_batch(recorder, batcher, queue))

    assert asyncio.run(scenario()) == [10, 20, 30]
    with path.open("a") as cut:  # a writer killed mid-line leaves a partial last line
        cut.write('{"formed": 1.0, "sta')
    steps = read_steps(path)
    assert [step["size"] for step in steps] == [len(batch) for batch in recorder.batches] == [1, 3]
    for step in steps:
        assert before <= step["formed"] <= step["start"] <= step["end"] <= time.monotonic()
    assert steps[1]["formed"] >= steps[0]["end"]  # the second batch formed once the held one was answered
    assert steps[0]["end"] - steps[0]["start"] > 0  # held until the others were queued


def test_a_step_log_that_cannot_be_written_stops_without_failing_the_step(tmp_path, caplog):
    from services.common.steplog import StepLog

    path = tmp_path / "steps.jsonl"
    log = StepLog.open(path)
    path.unlink()
    path.mkdir()  # appending to it now fails
    log.step(1.0, 2.0, 3.0, 4)
    log.step(1.0, 2.0, 3.0, 4)
    assert len([r for r in caplog.records if "no more steps are logged" in r.getMessage()]) == 1
    with pytest.raises(OSError):
        StepLog.open(path)  # opening says so at once


class Keyed:
    """A batched 'engine' over (session, n) entries: each entry -> n * 10; every batch is recorded."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, int]]] = []

    def __call__(self, entries: list[tuple[str, int]]) -> list[int]:
        self.batches.append(list(entries))
        return [n * 10 for _, n in entries]


def test_a_keyed_batch_takes_one_step_per_session_and_keeps_each_sessions_order(engine_thread):
    keyed = Keyed()
    batcher = StepBatcher(engine_thread, keyed, max_batch=2, key=lambda entry: entry[0])

    async def scenario():
        steps = [("a", 1), ("a", 2), ("b", 1), ("a", 3), ("c", 1), ("b", 2)]
        return await asyncio.gather(*(batcher.submit(step) for step in steps))

    assert asyncio.run(scenario()) == [10, 20, 10, 30, 10, 20]
    assert keyed.batches == [[("a", 1), ("b", 1)], [("a", 2), ("c", 1)], [("a", 3), ("b", 2)]]


def test_a_snapshot_comes_along_ahead_of_its_sessions_step_and_takes_no_slot(engine_thread):
    keyed = Keyed()
    state = lambda session, ask: f"state of {session}"  # noqa: E731 - the snapshot an ask gets
    batcher = StepBatcher(engine_thread, lambda entries: answer_snapshots(entries, state, keyed),
                          max_batch=2, key=lambda entry: entry[0], reads=is_snapshot)

    async def scenario():
        entries = [("a", 1), ("a", SNAPSHOT), ("a", 2), ("b", 1), ("b", 2), ("b", SNAPSHOT), ("c", 1)]
        return await asyncio.gather(*(batcher.submit(entry) for entry in entries))

    assert asyncio.run(scenario()) == [10, "state of a", 20, 10, 20, "state of b", 10]
    # a's snapshot waits behind its step 1 and rides with its step 2, b's behind its step 2: each session still
    # steps in every batch beside the others, as without snapshots (a batch of two steps, max_batch)
    assert keyed.batches == [[("a", 1), ("b", 1)], [("a", 2), ("b", 2)], [("c", 1)]]


def test_the_gather_counts_sessions_not_steps(engine_thread):
    keyed = Keyed()
    batcher = StepBatcher(engine_thread, keyed, sessions=lambda: 2, gather_s=0.3, key=lambda entry: entry[0])

    async def scenario():
        first = [asyncio.ensure_future(batcher.submit(("a", n))) for n in (1, 2)]  # one session, read ahead
        await asyncio.sleep(0.05)  # inside the window: two steps queued, but session b has none yet
        return await asyncio.gather(*first, batcher.submit(("b", 1)))

    assert asyncio.run(scenario()) == [10, 20, 10]
    assert keyed.batches == [[("a", 1), ("b", 1)], [("a", 2)]]  # counting steps, [("a", 1)] would have run alone


def test_steps_queued_during_a_batch_start_the_next_batch_without_a_gather_wait(engine_thread):
    recorder = Recorder()
    batcher = StepBatcher(engine_thread, recorder, sessions=lambda: 2, gather_s=0.9, key=lambda entry: entry % 2)

    async def scenario():
        loop = asyncio.get_running_loop()
        start = loop.time()
        recorder.hold.clear()
        running = [asyncio.ensure_future(batcher.submit(n)) for n in (0, 1)]
        await _wait_started(recorder)
        ahead = [asyncio.ensure_future(batcher.submit(n)) for n in (2, 3)]  # both sessions' next steps
        await asyncio.sleep(0.01)
        recorder.hold.set()
        results = await asyncio.gather(*running, *ahead)
        return results, loop.time() - start

    results, elapsed = asyncio.run(scenario())
    assert results == [0, 10, 20, 30] and elapsed < 0.5  # a gather wait would be 0.9 s
    assert recorder.batches == [[0, 1], [2, 3]]


async def _requests(items, read):
    for item in items:
        read.append(item)
        yield item


def test_pipelined_answers_in_order_and_starts_the_next_request_before_the_last_answer_is_taken():
    events = []

    async def start(n):
        events.append(f"start {n}")
        await asyncio.sleep(0.01 * (4 - n))  # later requests finish sooner: the order must still hold
        return n * 10

    async def scenario():
        answers = []
        async for answer in pipelined(_requests(range(4), []), start):
            events.append(f"answer {answer}")
            answers.append(answer)
            await asyncio.sleep(0.002)  # the answer's write
        return answers

    assert asyncio.run(scenario()) == [0, 10, 20, 30]
    for n in range(3):
        assert events.index(f"start {n + 1}") < events.index(f"answer {n * 10}")


def test_pipelined_reads_at_most_ahead_requests_beyond_the_awaited_one():
    gate = asyncio.Event
    state = {"started": 0, "answered": 0, "most": 0}

    async def start(n):
        state["started"] += 1
        state["most"] = max(state["most"], state["started"] - state["answered"])
        await state["gate"].wait()
        return n

    async def scenario():
        state["gate"] = gate()
        read = []
        stream = pipelined(_requests(range(10), read), start, ahead=2)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.02)
        held = (state["started"], len(read))
        state["gate"].set()
        answers = [await first]
        async for answer in stream:
            state["answered"] += 1
            answers.append(answer)
        return held, answers

    held, answers = asyncio.run(scenario())
    assert held == (3, 3) and answers == list(range(10)) and state["most"] <= 3


def test_pipelined_raises_a_failure_after_the_answers_before_it_and_cancels_what_it_read_beyond():
    cancelled = []

    async def start(n):
        if n == 2:
            raise ValueError("bad request 2")
        try:
            await asyncio.sleep(0.05 if n > 2 else 0)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise
        return n

    async def scenario():
        answers = []
        with pytest.raises(ValueError, match="bad request 2"):
            async for answer in pipelined(_requests(range(6), []), start):
                answers.append(answer)
                await asyncio.sleep(0.002)  # the answer's write
        await asyncio.sleep(0.1)
        return answers

    assert asyncio.run(scenario()) == [0, 1]
    assert cancelled == [3]  # read ahead of the failure, never answered


def test_pipelined_raises_a_broken_request_stream_in_order():
    async def broken():
        yield 1
        raise ConnectionError("stream reset")

    async def start(n):
        return n

    async def scenario():
        answers = []
        with pytest.raises(ConnectionError, match="stream reset"):
            async for answer in pipelined(broken(), start):
                answers.append(answer)
        return answers

    assert asyncio.run(scenario()) == [1]


def test_pipelined_ahead_must_not_be_negative():
    async def scenario():
        with pytest.raises(ValueError, match="ahead must be at least 0"):
            await anext(pipelined(_requests([], []), lambda n: n, ahead=-1))

    asyncio.run(scenario())


def test_pipelined_with_nothing_ahead_reads_each_request_after_the_last_answer_is_taken():
    events = []

    async def requests():
        for n in range(3):
            events.append(f"read {n}")
            yield n

    async def start(n):
        return n

    async def scenario():
        async for answer in pipelined(requests(), start, ahead=0):
            events.append(f"answer {answer}")
            await asyncio.sleep(0.002)

    asyncio.run(scenario())
    assert events == ["read 0", "answer 0", "read 1", "answer 1", "read 2", "answer 2"]


def _cohort_batcher(engine_thread, keyed, open_sessions: int, cohort_s: float) -> StepBatcher:
    return StepBatcher(engine_thread, keyed, sessions=lambda: open_sessions, gather_s=0.002, cohort_s=cohort_s,
                       key=lambda entry: entry[0])


async def _first_batch(batcher: StepBatcher, sessions: str) -> None:
    """`sessions` step together once (all open sessions arrive at once: no wait)."""
    await asyncio.gather(*(batcher.submit((s, 1)) for s in sessions))


async def _spread(batcher: StepBatcher, early: str, late: str, delay: float) -> float:
    """Step 2 of `early` now and of `late` after `delay`; the time until every answer is back."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    first = [asyncio.ensure_future(batcher.submit((s, 2))) for s in early]
    await asyncio.sleep(delay)
    await asyncio.gather(*first, *(batcher.submit((s, 2)) for s in late))
    return loop.time() - start


@pytest.mark.parametrize("cohort_s, expected", [
    (0.6, [["a", "b", "c", "d"]]),            # waits for c and d, who stepped beside a and b last time
    (0.0, [["a", "b"], ["c", "d"]]),          # off: a and b start after the 2 ms gather, c and d after them
])
def test_a_batch_waits_for_its_sessions_last_batch_mates(engine_thread, cohort_s, expected):
    keyed = Keyed()
    batcher = _cohort_batcher(engine_thread, keyed, open_sessions=6, cohort_s=cohort_s)

    async def scenario():
        batcher.sessions = lambda: 4  # the first batch: all four open sessions at once
        await _first_batch(batcher, "abcd")
        batcher.sessions = lambda: 6  # e and f opened since, elsewhere in their frames: not waited for
        return await _spread(batcher, "ab", "cd", 0.05)

    elapsed = asyncio.run(scenario())
    assert [[s for s, _ in batch] for batch in keyed.batches[1:]] == expected
    assert elapsed < 0.5  # the cohort came: no batch waited out the cap (nor for e and f)


def test_a_batch_does_not_wait_for_a_mate_that_stepped_since_nor_past_the_cap(engine_thread):
    keyed = Keyed()
    batcher = _cohort_batcher(engine_thread, keyed, open_sessions=4, cohort_s=0.3)

    async def scenario():
        loop = asyncio.get_running_loop()
        await _first_batch(batcher, "abcd")
        await batcher.submit(("c", 2))  # c runs ahead on its own after the 0.3 s cap (a, b, d do not come)
        start = loop.time()
        await asyncio.gather(batcher.submit(("a", 2)), batcher.submit(("b", 2)), batcher.submit(("d", 2)))
        early = loop.time() - start  # every mate still in batch 1 is here: no wait for c, now in batch 2
        start = loop.time()
        await batcher.submit(("c", 3))  # c's batch-mates of batch 2 are none: it never waits again
        return early, loop.time() - start

    early, alone = asyncio.run(scenario())
    assert [[s for s, _ in batch] for batch in keyed.batches] == [["a", "b", "c", "d"], ["c"], ["a", "b", "d"], ["c"]]
    assert early < 0.25 and alone < 0.25


def test_the_cohorts_of_sessions_long_gone_are_forgotten(engine_thread):
    keyed = Keyed()
    batcher = _cohort_batcher(engine_thread, keyed, open_sessions=2, cohort_s=0.01)

    async def scenario():
        for n in range(600):  # 600 batches, each of two sessions never seen again
            await asyncio.gather(batcher.submit((f"a{n}", 1)), batcher.submit((f"b{n}", 1)))

    asyncio.run(scenario())
    assert len(keyed.batches) == 600
    assert len(batcher._last_batch) <= 2 * 2 * 256 and len(batcher._stayed) <= 2 * 256  # not 1200 and 600
