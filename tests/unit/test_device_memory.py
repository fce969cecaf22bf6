"""A service on a shared device keeps headroom for the others: its MLX memory limit follows the device's free
memory (services.common.device_memory), so its buffer cache goes back before the device is full."""

import threading
import time

import mlx.core as mx
import pytest

from services.common import cli, device_memory
from services.common.device_memory import MIB, POOL_BYTES, Counters, Headroom, memory_limit, read_counters
from services.common.device_pool import DevicePool

GIB = 1 << 30


def test_the_limit_is_the_process_memory_plus_the_free_memory_less_the_headroom():
    # 10 GiB in arrays, 3 GiB cached, 20 GiB free on the device, 4 GiB kept: 10 + 3 + 20 - 4 = 29 GiB.
    assert memory_limit(Counters(free=20 * GIB, active=10 * GIB, cache=3 * GIB), 4 * GIB) == 29 * GIB
    # 1 GiB free, 4 kept: the limit is 3 GiB under the arrays and cache, so 3 GiB of cache go back first.
    assert memory_limit(Counters(free=1 * GIB, active=10 * GIB, cache=3 * GIB), 4 * GIB) == 10 * GIB
    assert memory_limit(Counters(free=2 * GIB, active=10 * GIB, cache=3 * GIB), 4 * GIB) == 11 * GIB


def test_the_limit_never_falls_under_the_arrays_held_nor_rises_over_an_explicit_one():
    full = Counters(free=0, active=10 * GIB, cache=3 * GIB)  # a full device, another process's doing
    assert memory_limit(full, 4 * GIB) == 10 * GIB
    roomy = Counters(free=60 * GIB, active=10 * GIB, cache=0)
    assert memory_limit(roomy, 4 * GIB, ceiling=16 * GIB) == 16 * GIB
    assert memory_limit(roomy, 4 * GIB, ceiling=None) == 66 * GIB


class _Device:
    """Counters a test sets, and the limits the guard set."""

    def __init__(self, free: int, active: int, cache: int) -> None:
        self.reading = Counters(free, active, cache)
        self.limits: list[int] = []
        self.read_event = threading.Event()

    def read(self) -> Counters:
        self.read_event.set()
        return self.reading

    def set_limit(self, limit: int) -> None:
        self.limits.append(limit)


def test_a_refresh_sets_the_limit_only_when_it_changed_and_warns_once_when_the_device_runs_short(caplog):
    device = _Device(free=30 * GIB, active=8 * GIB, cache=2 * GIB)
    guard = Headroom(4096, read=device.read, set_limit=device.set_limit)
    assert guard.refresh() == 36 * GIB
    assert guard.refresh() == 36 * GIB
    assert device.limits == [36 * GIB]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]

    device.reading = Counters(free=1 * GIB, active=8 * GIB, cache=2 * GIB)
    assert guard.refresh() == 8 * GIB  # 8 + 2 + 1 - 4 = 7, floored at the 8 in arrays
    device.reading = Counters(free=3 * GIB, active=8 * GIB, cache=0)
    assert guard.refresh() == 8 * GIB
    assert device.limits == [36 * GIB, 8 * GIB]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "1024 MiB free, under the 4096 MiB headroom" in warnings[0]

    device.reading = Counters(free=40 * GIB, active=8 * GIB, cache=0)  # room again; short again warns again
    assert guard.refresh() == 44 * GIB
    device.reading = Counters(free=0, active=8 * GIB, cache=0)
    guard.refresh()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 2


def test_the_thread_keeps_the_limit_fresh_until_stopped():
    device = _Device(free=30 * GIB, active=8 * GIB, cache=0)
    guard = Headroom(4096, ceiling_mb=32 * 1024, period_s=0.001, read=device.read, set_limit=device.set_limit)
    assert guard.start() is guard
    assert device.limits == [32 * GIB]  # set at once, under the explicit limit
    device.read_event.clear()
    device.reading = Counters(free=2 * GIB, active=8 * GIB, cache=1 * GIB)
    assert device.read_event.wait(5)
    device.read_event.clear()
    assert device.read_event.wait(5)  # a whole reading after the change
    guard.stop()
    assert device.limits[-1] == 8 * GIB
    count = len(device.limits)
    device.reading = Counters(free=50 * GIB, active=8 * GIB, cache=0)
    device.read_event.clear()
    assert not device.read_event.wait(0.05)  # stopped: no more readings
    assert len(device.limits) == count


def test_memory_freed_into_the_pool_counts_as_the_process_own_in_the_limit():
    # 10 GiB in arrays, 3 cached, 5 freed into the pool, 20 free on the device, 4 kept: 10 + 3 + 5 + 20 - 4 = 34.
    assert memory_limit(Counters(free=20 * GIB, active=10 * GIB, cache=3 * GIB, pooled=5 * GIB), 4 * GIB) == 34 * GIB


class _Pool:
    """A driver pool a test sets: reserved and used bytes; a trim hands every unused byte back."""

    def __init__(self, reserved: int, used: int) -> None:
        self.reserved_bytes, self.used_bytes, self.trims = reserved, used, 0

    def reserved(self) -> int:
        return self.reserved_bytes

    def used(self) -> int:
        return self.used_bytes

    def trim(self) -> None:
        self.trims += 1
        self.reserved_bytes = self.used_bytes


def test_the_pool_is_trimmed_only_while_the_device_is_short(monkeypatch):
    monkeypatch.setitem(POOL_BYTES, "pooled", 0)
    monkeypatch.setitem(POOL_BYTES, "trimmed", 0)
    device = _Device(free=30 * GIB, active=8 * GIB, cache=2 * GIB)
    pool = _Pool(reserved=16 * GIB, used=10 * GIB)  # 6 GiB freed by MLX, reserved for this process
    guard = Headroom(4096, read=device.read, set_limit=device.set_limit, pool=pool)
    assert guard.refresh() == (8 + 2 + 6 + 30 - 4) * GIB  # room on the device: the pool keeps it, counted as ours
    assert pool.trims == 0 and POOL_BYTES == {"pooled": 6 * GIB, "trimmed": 0}

    device.reading = Counters(free=1 * GIB, active=8 * GIB, cache=2 * GIB)  # short: the 6 GiB go back
    assert guard.refresh() == (8 + 2 + 1 + 6 - 4) * GIB  # what was pooled is free on the device now
    assert pool.trims == 1 and POOL_BYTES == {"pooled": 0, "trimmed": 6 * GIB}
    device.reading = Counters(free=7 * GIB, active=8 * GIB, cache=2 * GIB)  # the device after the trim
    guard.refresh()
    assert pool.trims == 1  # nothing pooled: no trim

    pool.reserved_bytes = pool.used_bytes + device_memory.TRIM_MIN_BYTES - 1  # too little to be worth a call
    device.reading = Counters(free=0, active=8 * GIB, cache=2 * GIB)
    guard.refresh()
    assert pool.trims == 1 and POOL_BYTES["pooled"] == device_memory.TRIM_MIN_BYTES - 1
    pool.reserved_bytes += 1
    guard.refresh()
    assert pool.trims == 2 and POOL_BYTES["trimmed"] == 6 * GIB + device_memory.TRIM_MIN_BYTES


def test_a_pool_that_stops_answering_is_dropped_and_the_limit_still_follows_the_device(monkeypatch, caplog):
    from services.common.device_pool import DriverError

    monkeypatch.setitem(POOL_BYTES, "pooled", 0)
    device = _Device(free=1 * GIB, active=8 * GIB, cache=2 * GIB)
    pool = _Pool(reserved=16 * GIB, used=10 * GIB)

    def failing() -> int:
        raise DriverError("cuMemPoolGetAttribute returned CUDA error 201")

    pool.reserved = failing
    guard = Headroom(4096, read=device.read, set_limit=device.set_limit, pool=pool)
    assert guard.refresh() == 8 * GIB and pool.trims == 0  # as without a pool: 8 + 2 + 1 - 4, floored at 8
    assert guard.refresh() == 8 * GIB
    warnings = [r.getMessage() for r in caplog.records if "stopped answering" in r.getMessage()]
    assert len(warnings) == 1 and "CUDA error 201" in warnings[0]


def test_without_a_cuda_device_there_is_no_pool():
    if mx.cuda.is_available():
        pytest.skip("this host has MLX's CUDA backend: the pool exists (the GPU test below reads it)")
    assert DevicePool.open() is None


def test_a_device_that_does_not_report_its_free_memory_keeps_its_limit():
    limits: list[int] = []
    guard = Headroom(4096, read=lambda: None, set_limit=limits.append)
    assert guard.start() is None and guard.refresh() is None and limits == []
    if "free_memory" not in mx.device_info():  # the CPU here: MLX reports no free memory
        assert read_counters() is None
        assert cli.keep_device_headroom(None, None) is None


def test_the_headroom_flag():
    parser = cli.build_parser("svc", "test")
    model = ["--model", "."]
    assert cli.parse_args(parser, model).device_headroom_mb is None
    assert cli.parse_args(parser, [*model, "--device-headroom-mb", "0"]).device_headroom_mb == 0
    assert cli.parse_args(parser, [*model, "--device-headroom-mb", "2048"]).device_headroom_mb == 2048
    with pytest.raises(SystemExit):
        cli.parse_args(parser, [*model, "--device-headroom-mb", "-1"])
    assert cli.keep_device_headroom(0, None) is None  # off


needs_free_memory = pytest.mark.skipif("free_memory" not in mx.device_info(),
                                       reason="a device that reports its free memory (a CUDA GPU)")


@pytest.mark.gpu
@needs_free_memory
def test_on_a_gpu_a_device_under_the_headroom_hands_the_cache_back_at_the_next_allocation():
    previous_cache = mx.set_cache_limit(1 << 40)
    try:
        mx.clear_cache()
        held = mx.zeros((64 * MIB,), dtype=mx.float32)  # 256 MiB in use
        freed = mx.zeros((128 * MIB,), dtype=mx.float32)  # 512 MiB, freed into the cache
        mx.eval(held, freed)
        del freed
        mx.synchronize()  # a buffer goes to the cache once the work that used it has completed
        assert mx.get_cache_memory() >= 512 * MIB

        def short() -> Counters:  # the device as if another process had taken all but 0 bytes
            real = read_counters()
            return Counters(0, real.active, real.cache)

        guard = Headroom(1024, read=short)
        try:
            guard.refresh()
            mx.eval(mx.ones((3 * MIB,), dtype=mx.float32) + held[: 3 * MIB])  # a size the cache cannot serve
            mx.synchronize()
            assert mx.get_cache_memory() < 512 * MIB
        finally:
            mx.set_memory_limit(int(mx.device_info()["total_memory"] * 0.95))
    finally:
        mx.set_cache_limit(previous_cache)


@pytest.mark.gpu
@needs_free_memory
def test_on_a_gpu_memory_mlx_frees_stays_in_the_pool_until_it_is_trimmed():
    pool = DevicePool.open()
    assert pool is not None
    previous_cache = mx.set_cache_limit(0)  # every freed buffer goes straight back to the driver's pool
    try:
        mx.clear_cache()
        before = mx.device_info()["free_memory"]
        block = mx.zeros((256 * MIB,), dtype=mx.float32)  # 1 GiB
        mx.eval(block)
        assert pool.used() >= GIB
        del block
        mx.eval(mx.ones((4,)))  # a step's evaluation after the free, as an engine's next step (no stream sync)
        deadline = time.monotonic() + 2.0  # the free is stream-ordered: the pool sees it a moment later
        while pool.reserved() - pool.used() < GIB * 9 // 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.reserved() - pool.used() >= GIB * 9 // 10, "the freed GiB is not held by the pool"
        pool.trim()
        assert pool.reserved() - pool.used() < 64 * MIB
        assert mx.device_info()["free_memory"] >= before - 64 * MIB  # back on the device
    finally:
        mx.set_cache_limit(previous_cache)
