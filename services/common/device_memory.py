"""Device memory on a GPU several services share: each keeps headroom for the others, and a step that still runs
the device out of memory runs once more after the process's buffer cache went back.

MLX's allocator gives a process a memory limit of about the whole device (95% on CUDA) and frees the process's
buffer cache only when its own arrays and cache pass that limit. Four services on one GPU never get there each,
so none frees its cache for another's allocation: the caches (up to `--cache-limit-mb` each) sit unused while a
growing service runs the device out of memory.

`Headroom` keeps the process's MLX memory limit at what the device has left for it: its own arrays and cache
plus the device's free memory, less a headroom kept for the others. When the device's free memory falls under
the headroom, the limit falls under the process's arrays and cache, and the allocator releases cached buffers
before it allocates more (and an evaluation past the limit waits for queued work, which frees its
temporaries). A background thread refreshes the limit every `period_s`; it never goes under the arrays the
process holds (a limit there would only slow each step, not free memory), nor over an explicit
`--memory-limit-mb`.

Memory MLX frees on CUDA goes back to the driver's memory pool, which keeps it reserved for this process
(`services.common.device_pool`): the device counts it as used, every other process is short of it. While the
device is short, the headroom hands that memory back (trims the pool), and until then counts it as this
process's own (a limit over it allocates from the pool, not from the device).

A device that does not report its free memory (the CPU; Apple silicon's unified memory) leaves the limit as it
is.

`evaluate` is the engines' `mx.eval` of a step: when the device runs out of memory during it, the process's
buffer cache goes back to the device and, after a pause in which the other services' headroom threads see the
device short and trim their pools, the evaluation runs once more. MLX leaves a failed evaluation
resumable (what it had evaluated stays evaluated, its queued work flushed; the rest keeps its graph), so the
second evaluation completes the same step, not another one; the step's sessions go on as if nothing happened.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.device_pool import DriverError, Pool
from services.common.errors import out_of_memory

MIB = 1 << 20
DEFAULT_PERIOD_S = 0.05
# Steps of this process whose evaluation ran the device out of memory: `recovered` completed when run once more,
# `failed` ran out again (voicechat_out_of_memory_steps_total{service,outcome}).
OUT_OF_MEMORY_STEPS = {"recovered": 0, "failed": 0}
# This process's device memory outside MLX's counters (voicechat_memory_bytes{kind="pooled"}) and what the headroom
# handed back of it (voicechat_memory_trimmed_bytes_total), as of the headroom's last reading.
POOL_BYTES = {"pooled": 0, "trimmed": 0}
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


def memory_limit(reading: Counters, headroom: int, ceiling: int | None = None) -> int:
    """The MLX memory limit that keeps `headroom` bytes of the device free for other processes: this process's
    arrays, cache and pooled memory plus the device's free memory, less the headroom; never under the arrays it
    holds, never over `ceiling` (an explicit limit)."""
    limit = max(reading.active, reading.active + reading.cache + reading.pooled + reading.free - headroom)
    return limit if ceiling is None else min(limit, ceiling)


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


def _set_limit(limit: int) -> None:
    import mlx.core as mx

    mx.set_memory_limit(limit)


class Headroom:
    """The background thread that keeps this process's MLX memory limit at its share of a shared device (see the
    module's docstring). `start()` returns None where the device does not report its free memory."""

    def __init__(self, headroom_mb: float, ceiling_mb: float | None = None, period_s: float = DEFAULT_PERIOD_S,
                 read: Callable[[], Counters | None] = read_counters,
                 set_limit: Callable[[int], None] = _set_limit, pool: Pool | None = None) -> None:
        self.headroom = int(headroom_mb * MIB)
        self.ceiling = None if ceiling_mb is None else int(ceiling_mb * MIB)
        self.period_s = period_s
        self._read = read
        self._set_limit = set_limit
        self._pool = pool
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.limit: int | None = None  # the last limit set
        self.short = False  # whether the device's free memory was under the headroom at the last reading

    def refresh(self) -> int | None:
        """Read the counters and set the limit when it changed; the limit, or None where nothing is reported."""
        reading = self._read()
        if reading is None:
            return None
        short = reading.free < self.headroom
        if self._pool is not None:
            reading = self._read_pool(reading, short)
        limit = memory_limit(reading, self.headroom, self.ceiling)
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
        """The reading with the pool's unused reserve, which goes back to the device (as free memory) while the
        device is short; a pool that fails to answer is dropped (logged once), the reading kept as it was."""
        try:
            pooled = max(0, self._pool.reserved() - self._pool.used())
            if short and pooled >= TRIM_MIN_BYTES:
                self._pool.trim()  # on the device now: counted as free, as it now (about) is
                POOL_BYTES["trimmed"] += pooled
                reading = Counters(reading.free + pooled, reading.active, reading.cache)
            else:
                reading = Counters(reading.free, reading.active, reading.cache, pooled)
        except DriverError as exc:
            logging.getLogger(__name__).warning("device headroom: the memory pool stopped answering (%s); what "
                                                "this process frees stays reserved for it", exc)
            self._pool = None
        POOL_BYTES["pooled"] = reading.pooled
        return reading

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


def evaluate(*arrays) -> None:
    """`mx.eval(*arrays)`, run once more after the process's buffer cache went back to the device when the first
    evaluation ran it out of memory (see the module's docstring); a second failure propagates."""
    import mlx.core as mx

    try:
        mx.eval(*arrays)
    except RuntimeError as exc:
        if not out_of_memory(exc):
            raise
        cached = mx.get_cache_memory()
        mx.clear_cache()
        logging.getLogger(__name__).warning(
            "a step ran the device out of memory (%s); running it once more after handing back the buffer cache "
            "(%.0f MiB)", exc, cached / MIB)
        time.sleep(RETRY_WAIT_S)
        try:
            mx.eval(*arrays)
        except RuntimeError as again:
            if out_of_memory(again):
                OUT_OF_MEMORY_STEPS["failed"] += 1
            raise
        OUT_OF_MEMORY_STEPS["recovered"] += 1
