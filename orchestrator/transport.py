"""The client streams of every session on one asyncio event loop (grpc.aio), not three threads a stream.

gRPC's synchronous bidi streams each hold a request-iterator thread and a reply-reader thread beside the channel's
spin thread, so a request hops stage thread -> iterator thread and its answer spin thread -> reader thread ->
stage thread, every hop a GIL hand-off; at 16 conversations (64 streams) that machinery, not the sessions'
logic, was most of the orchestrator's CPU. Here one daemon thread runs an event loop for the whole process; a
stream is two small tasks on it (a writer draining the stream's outbox, a reader filling its reply queue), and a
caller thread hands a request over through the loop's Handoff (`call_soon_threadsafe`, one wake-up for all the
requests waiting) and takes an answer from a thread-safe queue:

    caller thread --Handoff--> loop: outbox -> call.write                    (one hop)
    loop: call.read -> replies.put --> caller thread: replies.get            (one hop)

LoopCall is that; ThreadCall the same four calls over gRPC's synchronous streams (Channel's "threads" transport).

`bench/transport.py` measures it against the threaded streams (client CPU per round trip); docs/performance.md
has the numbers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_handoff: Handoff | None = None


class Handoff:
    """Calls from other threads run on the loop in the order handed over, every call waiting at a wake-up run in
    that one: under load many streams' requests share a wake-up (call_soon_threadsafe wakes the loop each time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._calls: deque = deque()
        self._lock = threading.Lock()
        self._armed = False  # a run is scheduled and has not taken the calls yet

    def __call__(self, function: Callable, *args) -> None:
        with self._lock:
            self._calls.append((function, args))
            if self._armed:
                return
            self._armed = True
        self._loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            calls, self._calls, self._armed = self._calls, deque(), False
        for function, args in calls:
            function(*args)


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's client event loop, started (on a daemon thread) at the first call."""
    global _loop, _handoff
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="grpc-client-loop", daemon=True).start()
            _loop, _handoff = loop, Handoff(loop)
        return _loop


def handoff() -> Handoff:
    """The client loop's Handoff."""
    event_loop()
    return _handoff


def on_loop(function: Callable[[], T], timeout: float | None = None) -> T:
    """function() run on the client loop (where grpc.aio objects must be made and used); its result here."""
    loop = event_loop()
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(function())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            done.set_exception(exc)

    loop.call_soon_threadsafe(run)
    return done.result(timeout)


def await_on_loop(coroutine, timeout: float | None = None) -> Any:
    """A coroutine run to its end on the client loop; its result here."""
    return asyncio.run_coroutine_threadsafe(coroutine, event_loop()).result(timeout)


class LoopCall:
    """One bidirectional grpc.aio call driven from ordinary threads: `put(message)` queues a request (written in
    order), `get(timeout)` takes the next reply, `cancel()` ends the call. `get` returns a reply, `EOF` once the
    service ended the stream, or the grpc.RpcError that broke it; it raises queue.Empty after `timeout`.

    `start` (called on the loop) opens the call: a grpc.aio stream-stream multicallable called with no request
    iterator, e.g. `stub.Stream`.
    """

    EOF = object()
    _END = object()

    def __init__(self, start: Callable[[], grpc.aio.StreamStreamCall]):
        self._loop, self._handoff = event_loop(), handoff()
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: asyncio.Queue | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._tasks: list[asyncio.Task] = []
        # the loop runs callbacks in the order they were scheduled, so every put below finds the call open
        self._handoff(self._open, start)

    def put(self, message) -> None:
        self._handoff(self._enqueue, message)

    def get(self, timeout: float):
        return self._replies.get(timeout=timeout)

    def cancel(self) -> None:
        self._handoff(self._cancel)

    def close(self) -> None:
        """Half-close the requests, then cancel the call (what a session's end does)."""
        self._handoff(self._enqueue, self._END)
        self.cancel()

    # ------------------------------------------------------------------ on the loop

    def _open(self, start: Callable[[], grpc.aio.StreamStreamCall]) -> None:
        self._outbox = asyncio.Queue()
        try:
            self._call = start()
        except grpc.RpcError as exc:
            self._replies.put(exc)
            return
        self._tasks = [self._loop.create_task(self._write()), self._loop.create_task(self._read())]

    def _enqueue(self, message) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(message)

    def _cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()
        for task in self._tasks:
            task.cancel()

    async def _write(self) -> None:
        call, outbox = self._call, self._outbox
        try:
            while (message := await outbox.get()) is not self._END:
                await call.write(message)
            await call.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the call is over: its reader reports why

    async def _read(self) -> None:
        try:
            while (reply := await self._call.read()) is not grpc.aio.EOF:
                self._replies.put(reply)
            self._replies.put(self.EOF)
        except grpc.RpcError as exc:
            self._replies.put(_as_reported(exc))
        except asyncio.CancelledError:
            self._replies.put(_Cancelled())
        finally:
            self._tasks[0].cancel()  # the writer: nothing more can be sent


# What grpc.aio reports when a write fails because the stream already ended (the server went away, or ended the
# call): it overwrites the call's real status with this one (grpc/grpc#36066). It says nothing about the service.
CORE_WRITE_FAILURE = "Internal error from Core"


def _as_reported(exc: grpc.RpcError) -> grpc.RpcError:
    """The call's error as a service failure: grpc.aio's INTERNAL for a write into a stream that had ended becomes
    UNAVAILABLE (the stream broke), as the synchronous streams report it; any other error is itself. Without this
    a replica killed while a request was being written looked like a service's own INTERNAL error, which no other
    replica can recover from, and its sessions ended instead of moving."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else None
    if code == grpc.StatusCode.INTERNAL and details == CORE_WRITE_FAILURE:
        return _Broken()
    return exc


class _Broken(grpc.RpcError):
    """A stream that broke under a write (see `_as_reported`)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"the stream broke during a write (gRPC: {CORE_WRITE_FAILURE})"


class _Cancelled(grpc.RpcError):
    """The reply a call cancelled here ends with (grpc.aio raises CancelledError, not a status, for those)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "the stream was cancelled by this client"


class ThreadCall:
    """The same calls (`put`, `get`, `cancel`, `close`) over gRPC's synchronous bidi stream: a request-iterator
    thread (gRPC's) and a reply-reader thread (this one's) per stream. `stream` is a sync stream-stream
    multicallable, e.g. `stub.Stream`."""

    EOF = LoopCall.EOF
    _END = object()

    def __init__(self, stream: grpc.StreamStreamMultiCallable):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = stream(iter(self._requests.get, self._END))
        threading.Thread(target=self._read, name="grpc-replies", daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self._responses:
                self._replies.put(reply)
            self._replies.put(self.EOF)
        except grpc.RpcError as exc:
            self._replies.put(exc)

    def put(self, message) -> None:
        self._requests.put(message)

    def get(self, timeout: float):
        return self._replies.get(timeout=timeout)

    def cancel(self) -> None:
        self._responses.cancel()

    def close(self) -> None:
        self._requests.put(self._END)
        self._responses.cancel()
