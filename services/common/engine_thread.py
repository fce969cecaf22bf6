"""One dedicated thread that owns all MLX work of a service.

MLX evaluation is tied to the thread that issues it, so a service keeps its weights and every session's
state on one thread and the asyncio handlers hand it work:

    engine = EngineThread()
    codes = await engine.run(session.step, token_id)   # from asyncio
    engine.submit_sync(load_weights, path)               # from plain threads
    engine.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from services.common.errors import out_of_memory

T = TypeVar("T")


class EngineThread:
    """A single worker thread; jobs run one at a time in submission order and exceptions propagate. A job that
    ran the device out of memory first hands the process's buffer cache back to the device (`mx.clear_cache`), so
    its memory serves this process's next step and the other processes on the device at once."""

    def __init__(self, name: str = "engine") -> None:
        self._ident: int | None = None
        # max_workers=1: the executor never makes a second thread, and its one worker lives until shutdown.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=self._on_start
        )
        self._closed = False
        self.submit(lambda: None).result()  # start the thread now so `ident` is known

    def _on_start(self) -> None:
        self._ident = threading.get_ident()

    @property
    def ident(self) -> int:
        """`threading.get_ident()` of the engine thread."""
        assert self._ident is not None
        return self._ident

    def on_engine_thread(self) -> bool:
        return threading.get_ident() == self._ident

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        """Queue fn(*args, **kwargs) on the engine thread; RuntimeError once closed."""
        if self._closed:
            raise RuntimeError("engine thread is closed")
        return self._executor.submit(_job, fn, args, kwargs)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn on the engine thread and await its result. Cancelling the awaiting task does not stop a
        job already running; a job still queued is dropped.

        The job hands its outcome straight to the awaiting loop (one `call_soon_threadsafe`), without the chain
        of futures `asyncio.wrap_future` builds around the executor's."""
        if self.on_engine_thread():  # an engine job running an event loop: do not queue behind itself
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        job = self.submit(_answer, loop, future, fn, args, kwargs)
        try:
            return await future
        except asyncio.CancelledError:
            job.cancel()  # still queued: dropped; already running: runs to its end, its outcome discarded
            raise

    def submit_sync(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn on the engine thread and block for its result; runs inline when already on it."""
        if self.on_engine_thread():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def close(self, wait: bool = True) -> None:
        """Stop accepting work, drop queued jobs, and (by default) wait for the running one to finish."""
        self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> EngineThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _job(fn: Callable[..., T], args: tuple, kwargs: dict[str, Any]) -> T:
    """On the engine thread: fn(*args, **kwargs), the buffer cache released when it ran the device out of memory."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        if out_of_memory(exc):
            import mlx.core as mx  # here only: the orchestrator's threads (batching) run no MLX and load none

            mx.clear_cache()
        raise


def _answer(loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], fn: Callable[..., T], args: tuple,
            kwargs: dict[str, Any]) -> None:
    """On the engine thread: run fn and pass its result or exception to `future` on `loop`."""
    try:
        result, error = _job(fn, args, kwargs), None
    except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting task
        result, error = None, exc
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:  # the loop has closed: nobody is left to answer
        pass


def _settle(future: asyncio.Future[T], result: T | None, error: BaseException | None) -> None:
    """On the loop: give the awaiting task its outcome, unless it stopped waiting."""
    if future.done():
        return
    if error is None:
        future.set_result(result)  # type: ignore[arg-type]
    else:
        future.set_exception(error)
