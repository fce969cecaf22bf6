"""Device memory on a GPU several services share: each keeps headroom for the others, and a step that still runs
the device out of memory runs once more after the process's buffer cache went back.

MLX's allocator keeps the buffers a process frees in a buffer cache (up to `--cache-limit-mb`) and gives them
back only when the process's own arrays and cache pass its memory limit (about the whole device). Four services on
one GPU never get there each, so none hands its cache back for another's allocation: the caches sit unused while a
growing service runs the device out of memory.

`Headroom` keeps the process's buffer cache limit at what the device can spare: its cache, plus the device's free
memory, less a headroom kept for the others, never over the configured limit. While the device's free memory is
under the headroom, the limit falls under the cache, and the allocator hands the difference back at its next
allocation (and frees into the driver, not the cache, while the limit is 0). A background thread refreshes the
limit every `period_s`.

It leaves MLX's memory limit alone: past that limit an evaluation waits for the device to finish its queued work
after every command buffer it submits, so a limit held at the arrays a process holds (while the device is short)
makes every step pay its host time and its device time one after the other instead of at once; it frees nothing a
cache limit would not. An explicit `--memory-limit-mb` is the operator's, set once.

Memory MLX frees on CUDA goes back to the driver's memory pool, which keeps it reserved for this process
(`services.common.device_pool`): the device counts it as used, every other process is short of it. While the
device is short, the headroom hands that memory back (trims the pool), and until then counts it as this
process's own (the cache may grow into it without taking memory from the device).

A device that does not report its free memory (the CPU; Apple silicon's unified memory) leaves the cache limit as
it is.

`evaluate` is the engines' `mx.eval` of a step: when the device runs out of memory during it, the process's
buffer cache and its pool's unused reserve go back to the device (a large allocation needs memory the pool can
map whole, which blocks it freed in pieces may not give) and, after a pause in which the other services'
headroom threads see the device short and trim their pools, the evaluation runs once more. MLX leaves a failed
evaluation resumable (what it had evaluated stays evaluated, its queued work flushed; the rest keeps its graph),
so the second evaluation completes the same step, not another one; the step's sessions go on as if nothing
happened.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.device_pool import DevicePool, DriverError, Pool
from services.common.errors import out_of_memory

MIB = 1 << 20
DEFAULT_PERIOD_S = 0.05
# Steps of this process whose evaluation ran the device out of memory: `recovered` completed when run once more,
# `failed` ran out again (voicechat_out_of_memory_steps_total{service,outcome}).
OUT_OF_MEMORY_STEPS = {"recovered": 0, "failed": 0}
# This process's device memory outside MLX's counters (voicechat_memory_bytes{kind="pooled"}, as of the headroom's
# last reading) and what the headroom and `hand_back` handed back of it (voicechat_memory_trimmed_bytes_total).
POOL_BYTES = {"pooled": 0, "trimmed": 0}
# The buffer cache limit last set through `set_cache_limit` (voicechat_memory_bytes{kind="cache_limit"}); None:
# MLX's default.
CACHE_LIMIT: dict[str, int | None] = {"bytes": None}
TRIM_MIN_BYTES = 16 * MIB  # less unused in the pool is not worth a trim
# After a step ran the device out of memory, this long before it runs once more: time for the other services'
# headroom threads to see the device short and hand back what their pools hold (two of their readings).
RETRY_WAIT_S = 2 * DEFAULT_PERIOD_S


@dataclass(frozen=True)
class Counters:
    """One reading: the device's free bytes, this process's MLX active and cached bytes, and the bytes its driver
    pool holds for it that no allocation uses (freed by MLX, not yet back on the device; 0 where unknown)."""

    free: int
    active: int
    cache: int
    pooled: int = 0


def cache_limit(reading: Counters, headroom: int, ceiling: int) -> int:
    """The buffer cache limit that keeps `headroom` bytes of the device free for other processes: the bytes this
    process keeps idle (its cache and pooled memory) plus the device's free memory, less the headroom; never under
    0, never over `ceiling` (the configured limit)."""
    return max(0, min(ceiling, reading.cache + reading.pooled + reading.free - headroom))


def read_counters() -> Counters | None:
    """The device's free memory and this process's MLX counters; None where the device does not report its free
    memory."""
    import mlx.core as mx

    try:
        free = mx.device_info().get("free_memory")
    except RuntimeError:
        return None
    if not isinstance(free, int):
        return None
    return Counters(free, mx.get_active_memory(), mx.get_cache_memory())


def set_cache_limit(limit: int) -> int:
    """Set MLX's buffer cache limit (bytes) and keep it for the metrics (`CACHE_LIMIT`); the limit it replaced."""
    import mlx.core as mx

    CACHE_LIMIT["bytes"] = limit
    return mx.set_cache_limit(limit)


def configured_cache_limit() -> int:
    """MLX's buffer cache limit now (it has no getter: set and put back, before any engine runs)."""
    import mlx.core as mx

    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return limit


class Headroom:
    """The background thread that keeps this process's buffer cache limit at its share of a shared device (see
    the module's docstring); `ceiling` is the configured limit in bytes (None: MLX's limit when started).
    `start()` returns None where the device does not report its free memory."""

    def __init__(self, headroom_mb: float, ceiling: int | None = None, period_s: float = DEFAULT_PERIOD_S,
                 read: Callable[[], Counters | None] = read_counters,
                 set_limit: Callable[[int], object] = set_cache_limit, pool: Pool | None = None) -> None:
        self.headroom = int(headroom_mb * MIB)
        self.ceiling = ceiling
        self.period_s = period_s
        self._read = read
        self._set_limit = set_limit
        self._pool = pool
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.limit: int | None = None  # the last cache limit set
        self.short = False  # whether the device's free memory was under the headroom at the last reading

    def refresh(self) -> int | None:
        """Read the counters and set the cache limit when it changed; the limit, or None where nothing is
        reported."""
        reading = self._read()
        if reading is None:
            return None
        if self.ceiling is None:
            self.ceiling = configured_cache_limit()
        short = reading.free < self.headroom
        if self._pool is not None:
            reading = self._read_pool(reading, short)
        limit = cache_limit(reading, self.headroom, self.ceiling)
        if short and not self.short:
            logging.getLogger(__name__).warning(
                "the device has %.0f MiB free, under the %.0f MiB headroom: this service hands back its buffer "
                "cache (%.0f MiB) as it allocates", reading.free / MIB, self.headroom / MIB, reading.cache / MIB)
        self.short = short
        if limit != self.limit:
            self._set_limit(limit)
            self.limit = limit
        return limit

    def _read_pool(self, reading: Counters, short: bool) -> Counters:
        """The reading with the pool's unused reserve. While the device is short that reserve goes back to the
        device first, and the counters are read again: what the trim gave back is counted once the device shows
        it free, and whatever it left stays counted as pooled. A pool that fails to answer is dropped (logged
        once), the reading kept as it was."""
        try:
            pooled = self._pooled()
            if short and pooled >= TRIM_MIN_BYTES:
                self._pool.trim()
                again = self._read()
                reading = reading if again is None else again
                pooled_after = self._pooled()
                POOL_BYTES["trimmed"] += max(0, pooled - pooled_after)
                pooled = pooled_after
            reading = Counters(reading.free, reading.active, reading.cache, pooled)
        except DriverError as exc:
            logging.getLogger(__name__).warning("device headroom: the memory pool stopped answering (%s); what "
                                                "this process frees stays reserved for it", exc)
            self._pool = None
        POOL_BYTES["pooled"] = reading.pooled
        return reading

    def _pooled(self) -> int:
        return max(0, self._pool.reserved() - self._pool.used())

    def start(self) -> Headroom | None:
        """Set the limit now and keep it fresh on a daemon thread; None (no thread) where the device reports no
        free memory."""
        if self.refresh() is None:
            return None
        logging.getLogger(__name__).info("device headroom: %.0f MiB kept free for the device's other processes",
                                         self.headroom / MIB)
        self._thread = threading.Thread(target=self._run, name="device-headroom", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a failed reading keeps the last limit; the service goes on
                logging.getLogger(__name__).exception("device headroom: reading the device's memory failed")
                self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


@functools.cache
def process_pool() -> Pool | None:
    """This process's device memory pool (`DevicePool.open`, once); None without one (the CPU, Apple silicon)."""
    return DevicePool.open()


def hand_back(pool: Pool | None) -> tuple[int, int]:
    """Give the device what this process holds and no array uses: MLX's buffer cache, then, once the stream has
    run the frees that queued, the pool's unused reserve (`pool.trim`). Returns the bytes of each handed back
    (the second 0 without a pool, or when the pool fails to answer)."""
    import mlx.core as mx

    cached = mx.get_cache_memory()
    mx.clear_cache()
    if pool is None:
        return cached, 0
    try:
        mx.synchronize()  # the cache's frees are stream-ordered: the pool holds them as unused once they ran
        before = pool.reserved()
        pool.trim()
        trimmed = max(0, before - pool.reserved())
        POOL_BYTES["trimmed"] += trimmed
        return cached, trimmed
    except DriverError as exc:
        logging.getLogger(__name__).warning("the memory pool could not be trimmed (%s)", exc)
        return cached, 0


def evaluate(*arrays) -> None:
    """`mx.eval(*arrays)`, run once more after the process's buffer cache and its pool's unused reserve went back
    to the device (`hand_back`) when the first evaluation ran it out of memory (see the module's docstring); a
    second failure propagates."""
    import mlx.core as mx

    try:
        mx.eval(*arrays)
    except RuntimeError as exc:
        if not out_of_memory(exc):
            raise
        cached, trimmed = hand_back(process_pool())
        logging.getLogger(__name__).warning(
            "a step ran the device out of memory (%s); running it once more after handing back the buffer cache "
            "(%.0f MiB) and the memory pool's unused reserve (%.0f MiB)", exc, cached / MIB, trimmed / MIB)
        time.sleep(RETRY_WAIT_S)
        try:
            mx.eval(*arrays)
        except RuntimeError as again:
            if out_of_memory(again):
                OUT_OF_MEMORY_STEPS["failed"] += 1
            raise
        OUT_OF_MEMORY_STEPS["recovered"] += 1
