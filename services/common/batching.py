"""Cross-session batching: the frame steps of concurrent sessions run as one batched call on the engine thread.

Each stream handler submits its session's step and awaits the result; the batcher hands every step waiting at
that moment (up to `max_batch`) to the service's batched engine call in one engine-thread job:

    batcher = StepBatcher(engine_thread, lambda entries: engine.step_batch(entries), max_batch=16)
    result = await batcher.submit((session, text_id))    # from each stream's handler

While a batch runs, the steps that arrive queue and form the next one, so batches grow with load: continuous
batching. When the engine is idle, a step waits for company only while fewer sessions have a step queued than
are open, and at most `gather_s` (a few ms): sessions whose frames arrive together then share one batch instead
of the first running alone and the rest after it. One session alone never waits and runs batches of one (the
engines' solo path), straight from its own handler: no batching task, no extra turns of the event loop. Batched
calls return one result per entry, an exception instance for an entry that failed on its own (bad input), so one
session's error reaches that session only.

With `cohort_s` (`--cohort-wait-ms`), a batch about to start also waits, up to that long, for the sessions that
stepped in the same batch as one of its steps last time (its cohort) and have not sent their next step yet.
Sessions whose frames left a stage together reach the next one spread over a few ms (each answer is read, handed
on and written by the orchestrator in turn), so without it the first few start a batch and the rest run in
another after it: at 32 conversations the services stepped 17-23 sessions a step, each step costing about what a
full one would. A cohort member that stepped since in a later batch is not waited for; one that closed is
waited for once (the cap), its cohort's next batch forming without it.

With `--read-ahead N` the services' stream handlers read ahead (`pipelined`): a session's next request is
submitted as soon as it has arrived, while its last step still runs, and the batcher (keyed by session,
`session_of`) keeps one step of each session per batch, in order. So the next batch is formed the moment the
last one ends, from the steps queued meanwhile, instead of after every handler has written its answer and read
its next request.

A session's snapshot request (a `SnapshotAsk` in place of its step) queues in order with its steps but is a read, not a
step: a batch takes it, ahead of the session's next step, without giving it a slot of its own, and the services'
batched calls answer it before they run the batch's steps (`answer_snapshots`), so the session stays in the same
batch as its neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from services.common.device_memory import MIB, hand_back, process_pool
from services.common.engine_thread import EngineThread
from services.common.steplog import StepLog

Entry = TypeVar("Entry")
Result = TypeVar("Result")
Prepared = TypeVar("Prepared")
Output = TypeVar("Output")
Request = TypeVar("Request")

DEFAULT_MAX_BATCH = 16
DEFAULT_GATHER_S = 0.002
_COHORT_MEMORY = 256  # batches after which a session that has not stepped since is forgotten (checked this often)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchOptions:
    """How a service batches: at most `max_batch` sessions per step, a gather wait of `gather_s`, and the batch
    sizes 1..`precompile` traced at load (0: each size is traced when it first occurs); `step_log` records every
    step's times and size; `read_ahead` is how many requests of a stream its handler reads and queues beyond
    the step it waits for (`pipelined`); `cohort_s` how long a batch waits for its sessions' last batch-mates."""

    max_batch: int = DEFAULT_MAX_BATCH
    gather_s: float = DEFAULT_GATHER_S
    precompile: int = 0
    step_log: StepLog | None = None
    read_ahead: int = 0
    cohort_s: float = 0.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchOptions:
        """From the common service flags --max-batch, --batch-wait-ms, --precompile-batches, --step-log and
        --read-ahead and --cohort-wait-ms."""
        log = StepLog.open(args.step_log) if args.step_log is not None else None
        return cls(args.max_batch, args.batch_wait_ms / 1000.0, args.precompile_batches, log, args.read_ahead,
                   args.cohort_wait_ms / 1000.0)


class StepBatcher(Generic[Entry, Result]):
    """Gathers concurrent `submit` calls into batched engine-thread jobs of at most `max_batch` entries.

    `run_batch(entries)` runs on the engine thread and returns a list aligned with `entries`: a result or an
    exception instance per entry. If it raises, every entry of that batch fails with that exception. All
    `submit` calls must come from one event loop (a gRPC aio server's).

    `sessions()` says how many sessions are open (steps that may come); with it, a batch waits up to `gather_s`
    for that many sessions' steps before it starts. Without it no batch waits. `key(entry)` names the session
    an entry belongs to: a session may then have its next steps queued while one runs (a stream reading ahead,
    `pipelined`), and a batch takes the first waiting step of each session only, the later ones staying queued
    in order for the batches after it; with `cohort_s` too, a batch waits up to that long for the sessions that last
    stepped beside one of its sessions (the module's docstring). `precompile` is the largest batch size
    `precompile()` has the engine trace at load (capped at max_batch). A `step_log` gets one line per batched call
    (when the batch was formed, when the engine thread began and ended it, its size)."""

    def __init__(self, engine_thread: EngineThread,
                 run_batch: Callable[[list[Entry]], Sequence[Result | BaseException]],
                 max_batch: int = DEFAULT_MAX_BATCH, on_batch: Callable[[int], None] | None = None,
                 sessions: Callable[[], int] | None = None, gather_s: float = DEFAULT_GATHER_S,
                 precompile: int = 0, step_log: StepLog | None = None,
                 key: Callable[[Entry], Hashable] | None = None, read_ahead: int = 0,
                 reads: Callable[[Entry], bool] | None = None, cohort_s: float = 0.0) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if not 0 <= gather_s < 1:
            raise ValueError(f"gather_s must be in [0, 1) seconds, got {gather_s}")
        if not 0 <= cohort_s < 1:
            raise ValueError(f"cohort_s must be in [0, 1) seconds, got {cohort_s}")
        self.engine_thread = engine_thread
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.on_batch = on_batch  # called with each batch's size (metrics)
        self.sessions = sessions
        self.gather_s = gather_s
        self.precompile_sizes = min(max(precompile, 0), max_batch)
        self.step_log = step_log
        self.key = key
        self.read_ahead = read_ahead  # for the handlers that submit here (`pipelined(..., batcher.read_ahead)`)
        self.reads = reads  # keyed entries that read their session (a snapshot) rather than step it
        self.cohort_s = cohort_s if key is not None else 0.0  # a cohort is known by its sessions' keys
        self._batches = 0  # batches taken so far: the number of the last one
        self._last_batch: dict[Hashable, int] = {}  # session -> the number of the batch it last stepped in
        self._stayed: dict[int, int] = {}  # batch number -> how many of its sessions have not stepped since
        self._waiting: list[tuple[Entry, asyncio.Future[Result]]] = []
        self._arrived = asyncio.Event()
        self._drainer: asyncio.Task[None] | None = None
        self._solo = False  # a lone session's step runs in its caller's task now
        self._running = 0  # entries of the batch on the engine thread now

    @classmethod
    def with_options(cls, engine_thread: EngineThread,
                     run_batch: Callable[[list[Entry]], Sequence[Result | BaseException]], options: BatchOptions,
                     on_batch: Callable[[int], None] | None = None,
                     sessions: Callable[[], int] | None = None,
                     key: Callable[[Entry], Hashable] | None = None,
                     reads: Callable[[Entry], bool] | None = None) -> StepBatcher[Entry, Result]:
        return cls(engine_thread, run_batch, options.max_batch, on_batch, sessions, options.gather_s,
                   options.precompile, options.step_log, key, options.read_ahead, reads, options.cohort_s)

    async def precompile(self, precompile: Callable[[int], None]) -> None:
        """Run the engine's `precompile(max_size)` on the engine thread when sizes are to be traced at load, then
        give the device what the traces' steps left idle (`precompiled`)."""
        if self.precompile_sizes:
            await self.engine_thread.run(precompiled, precompile, self.precompile_sizes)

    @property
    def queued(self) -> int:
        """Steps waiting for the next batch (not counting the batch running now)."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Steps in the batch handed to the engine thread and not answered yet."""
        return self._running

    async def submit(self, entry: Entry) -> Result:
        """Queue one session's step and wait for its result (or its exception). A caller cancelled while its
        step is still queued is dropped from the batch; once the batch runs, the step runs to its end."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiting.append((entry, future))
        self._arrived.set()
        if self._drainer is None and not self._solo:
            if self._alone():
                return await self._run_solo(future)
            self._drainer = asyncio.create_task(self._drain())
        return await future

    def _alone(self) -> bool:
        """One session is open and its step is the only one: a batch of one, with nothing to gather."""
        return self.sessions is not None and len(self._waiting) == 1 and self.sessions() <= 1

    async def _run_solo(self, future: asyncio.Future[Result]) -> Result:
        """Run the one waiting step in the caller's task; steps that arrive meanwhile queue and are drained after
        it, as they would behind any running batch."""
        batch, self._waiting = self._waiting, []
        self._solo = True
        try:
            await self._run(batch)
        finally:
            self._solo = False
            if self._waiting and self._drainer is None:
                self._drainer = asyncio.create_task(self._drain())
        return future.result()

    async def _drain(self) -> None:
        try:
            while self._waiting:
                await self._gather()
                batch = self._take()
                if batch:
                    await self._run(batch)
        except asyncio.CancelledError:  # the event loop is shutting down: nobody is left to answer
            for _, future in self._waiting:
                future.cancel()
            self._waiting = []
            raise
        finally:
            self._drainer = None

    def _take(self) -> list[tuple[Entry, asyncio.Future[Result]]]:
        """The next batch, taken from the queue: at most max_batch steps in their order, one per session when
        steps are keyed (a session's later steps stay queued, and the reads queued before its step come along,
        taking no slot), callers cancelled meanwhile dropped."""
        live = [(entry, future) for entry, future in self._waiting if not future.done()]
        if self.key is None:
            batch, self._waiting = live[: self.max_batch], live[self.max_batch :]
            return batch
        batch, self._waiting, taken, steps, stepped = [], [], set(), 0, []
        for entry, future in live:
            session = self.key(entry)
            if session in taken:  # its step is in this batch or waits for the next: the rest come after it
                self._waiting.append((entry, future))
            elif self.reads is not None and self.reads(entry):
                batch.append((entry, future))
            else:
                taken.add(session)
                if steps < self.max_batch:
                    steps += 1
                    batch.append((entry, future))
                    stepped.append(session)
                else:
                    self._waiting.append((entry, future))
        if self.cohort_s and stepped:
            self._remember(stepped)
        return batch

    def _remember(self, sessions: list[Hashable]) -> None:
        """`sessions` step together in a new batch: each one's cohort is now this batch."""
        self._batches += 1
        for session in sessions:
            self._leave(session)
            self._last_batch[session] = self._batches
        self._stayed[self._batches] = len(sessions)
        if not self._batches % _COHORT_MEMORY:  # now and then, not every batch: forget sessions gone long ago
            oldest = self._batches - _COHORT_MEMORY
            for session in [s for s, number in self._last_batch.items() if number < oldest]:
                self._leave(session)
                del self._last_batch[session]

    def _leave(self, session: Hashable) -> None:
        number = self._last_batch.get(session)
        if number is not None:
            self._stayed[number] -= 1
            if not self._stayed[number]:
                del self._stayed[number]

    def _companions_due(self) -> bool:
        """Whether a session that last stepped beside one now waiting has not sent its next step yet."""
        arrived: dict[int, int] = {}
        for session in {self.key(entry) for entry, _ in self._waiting
                        if self.reads is None or not self.reads(entry)}:
            number = self._last_batch.get(session)
            if number is not None:
                arrived[number] = arrived.get(number, 0) + 1
        return any(count < self._stayed[number] for number, count in arrived.items())

    def _sessions_waiting(self) -> int:
        if self.key is None:
            return len(self._waiting)
        return len({self.key(entry) for entry, _ in self._waiting})

    async def _gather(self) -> None:
        """Wait while fewer sessions have a step queued than are open (and max_batch allows): up to gather_s, or up
        to cohort_s while a waiting session's last batch-mates have not sent their step yet."""
        if self.sessions is None or (self.gather_s <= 0 and not self.cohort_s):
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        while self._sessions_waiting() < min(self.max_batch, self.sessions()):
            deadline = start + self.gather_s
            if self.cohort_s > self.gather_s and self._companions_due():
                deadline = start + self.cohort_s
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return

    async def _run(self, batch: list[tuple[Entry, asyncio.Future[Result]]]) -> None:
        if self.on_batch is not None:
            self.on_batch(len(batch))
        self._running = len(batch)
        try:
            results = await self.engine_thread.run(self._checked, [entry for entry, _ in batch], time.monotonic())
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as error:  # noqa: BLE001 - delivered to each waiting caller
            results = [error] * len(batch)
        finally:
            self._running = 0
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():  # its caller was cancelled while the batch ran
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def _checked(self, entries: list[Entry], formed: float) -> Sequence[Result | BaseException]:
        start = time.monotonic()
        results = self.run_batch(entries)
        if self.step_log is not None:
            self.step_log.step(formed, start, time.monotonic(), len(entries))
        if len(results) != len(entries):
            raise RuntimeError(f"a batched step returned {len(results)} results for {len(entries)} entries")
        return results


def session_of(entry: tuple) -> int:
    """The batcher `key` of the services' entries, `(session, request...)` tuples: the session object."""
    return id(entry[0])


async def pipelined(requests: AsyncIterator[Request], start: Callable[[Request], Awaitable[Result]],
                    ahead: int = 1) -> AsyncIterator[Result]:
    """A stream's answers, in order: `start(request)` runs for each request as soon as it has arrived, up to
    `ahead` requests beyond the one whose answer is being waited for, and each answer is yielded when ready.
    With `ahead` 0, each request is read once the last answer has been taken (the plain loop).

    A handler that reads its next request only after writing its last answer leaves its service's next batch
    waiting for that turnaround, sixteen streams' worth of it; reading ahead, the next steps are queued while
    the batch before them runs (the batcher, keyed by session, keeps a session's steps in order, one per batch),
    so the next batch starts as the last one ends and the answers are written meanwhile. A `start` that checks
    its request against the session must therefore count what it accepted itself, not read what the engine has
    stepped. The first failure is raised after the answers before it; the requests read beyond it are cancelled
    (a step already in a running batch runs to its end, unanswered)."""
    if ahead < 0:
        raise ValueError(f"ahead must be at least 0, got {ahead}")
    if ahead == 0:
        async for request in requests:
            yield await start(request)
        return
    room = asyncio.Semaphore(ahead + 1)
    started: asyncio.Queue[asyncio.Future[Result] | BaseException | None] = asyncio.Queue()

    async def read() -> None:
        try:
            while True:
                await room.acquire()
                request = await anext(requests, _END)
                if request is _END:
                    break
                started.put_nowait(asyncio.ensure_future(start(request)))
        except Exception as error:  # noqa: BLE001 - the stream's own failure, raised in order
            started.put_nowait(error)
            return
        started.put_nowait(None)

    reader = asyncio.create_task(read())
    item: asyncio.Future[Result] | BaseException | None = None
    try:
        while (item := await started.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            answer = await item
            room.release()
            yield answer
    finally:  # an error, or the stream closed or cancelled: nothing read beyond it is answered
        reader.cancel()
        pending = [item] if isinstance(item, asyncio.Future) else []
        while not started.empty():
            pending.append(started.get_nowait())
        for future in pending:
            if isinstance(future, asyncio.Future):
                future.cancel()


_END = object()


class SnapshotAsk(NamedTuple):
    """An entry's request that asks for its session's state (`answer_snapshots`): against the snapshot `base`
    (0: whole), which the stream's `marks` (`snapshot.Marks`) may still know."""

    base: int = 0
    marks: Any = None


SNAPSHOT = SnapshotAsk()  # a whole snapshot


def is_snapshot(entry: tuple) -> bool:
    """The batcher `reads` of the services' entries: a `(session, SnapshotAsk)` entry."""
    return isinstance(entry[1], SnapshotAsk)


def answer_snapshots(entries: Sequence[tuple], snapshot: Callable[[Any, SnapshotAsk], Any],
                     run: Callable[[list[tuple]], Sequence[Result | BaseException]]) -> list[Result | BaseException]:
    """A service's batched call with its snapshot entries: each `(session, ask)` answered by
    `snapshot(session, ask)` first (the batcher takes a session's snapshot only ahead of its step in the batch),
    then `run` of the other entries, as one batch."""
    results: list = [None] * len(entries)
    steps = []
    for i, entry in enumerate(entries):
        if not is_snapshot(entry):
            steps.append(i)
            continue
        try:
            results[i] = snapshot(*entry)
        except Exception as error:  # noqa: BLE001 - this entry's own error
            results[i] = error
    if steps:
        for i, result in zip(steps, run([entries[i] for i in steps]), strict=True):
            results[i] = result
    return results


def raise_first(results: Sequence[object]) -> None:
    """Raise the first exception instance among a batched call's results (for callers that own every entry,
    such as a warm-up)."""
    for result in results:
        if isinstance(result, BaseException):
            raise result


def precompiled(precompile: Callable[[int], None], sizes: int) -> tuple[int, int]:
    """`precompile(sizes)`, then the buffer cache and the memory pool's unused reserve its steps left handed back
    to the device (`device_memory.hand_back`), before live steps allocate among them: a live array placed in a
    block of the pool keeps the whole block from a later trim. Returns the bytes of each handed back."""
    precompile(sizes)
    cached, trimmed = hand_back(process_pool())
    log.info("batch sizes 1-%d traced; handed back %.0f MiB of buffer cache and %.0f MiB of pooled memory",
             sizes, cached / MIB, trimmed / MIB)
    return cached, trimmed


def run_entries(entries: Sequence[Entry], prepare: Callable[[Entry], Prepared],
                run: Callable[[list[Prepared]], Sequence[Output | BaseException]],
                finish: Callable[[Entry, Output], Result]) -> list[Result | BaseException]:
    """The shape of every service's batched step: `prepare` each entry (decode its request; an exception fails
    that entry alone), `run` the prepared ones as one batch, `finish` each output into its reply."""
    results: list[Result | BaseException | None] = [None] * len(entries)
    prepared, slots = [], []
    for i, entry in enumerate(entries):
        try:
            prepared.append(prepare(entry))
        except Exception as error:  # noqa: BLE001 - this entry's own error
            results[i] = error
            continue
        slots.append(i)
    if prepared:
        outputs = run(prepared)
        for i, output in zip(slots, outputs, strict=True):
            if isinstance(output, BaseException):
                results[i] = output
                continue
            try:
                results[i] = finish(entries[i], output)
            except Exception as error:  # noqa: BLE001 - this entry's own error
                results[i] = error
    return results  # type: ignore[return-value]
