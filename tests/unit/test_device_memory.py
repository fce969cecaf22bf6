"""A service on a shared device keeps headroom for the others: its buffer cache limit follows the device's free
memory (services.common.device_memory), so its cache goes back before the device is full."""

import threading

import mlx.core as mx
import pytest

from services.common import cli, device_memory
from services.common.device_memory import MIB, POOL_BYTES, Counters, Headroom, cache_limit, read_counters
from services.common.device_pool import DevicePool

GIB = 1 << 30


def test_the_cache_limit_is_what_the_process_keeps_idle_plus_the_free_memory_less_the_headroom():
    # 3 GiB cached, 20 GiB free on the device, 4 GiB kept, an 8 GiB limit configured: 3 + 20 - 4 = 19, so 8.
    assert cache_limit(Counters(free=20 * GIB, active=10 * GIB, cache=3 * GIB), 4 * GIB, 8 * GIB) == 8 * GIB
    # 2 GiB free, 4 kept: 2 GiB of the 3 cached go back; the arrays held (10 GiB) do not count.
    assert cache_limit(Counters(free=2 * GIB, active=10 * GIB, cache=3 * GIB), 4 * GIB, 8 * GIB) == 1 * GIB
    assert cache_limit(Counters(free=2 * GIB, active=1 * GIB, cache=3 * GIB), 4 * GIB, 8 * GIB) == 1 * GIB
    # a full device, another process's doing: nothing cached, every freed buffer back to the driver
    assert cache_limit(Counters(free=0, active=10 * GIB, cache=3 * GIB), 4 * GIB, 8 * GIB) == 0


class _Device:
    """Counters a test sets, and the cache limits the guard set."""

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
    guard = Headroom(4096, ceiling=8 * GIB, read=device.read, set_limit=device.set_limit)
    assert guard.refresh() == 8 * GIB  # 2 + 30 - 4 = 28, under the configured 8
    assert guard.refresh() == 8 * GIB
    assert device.limits == [8 * GIB]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]

    device.reading = Counters(free=3 * GIB, active=8 * GIB, cache=2 * GIB)
    assert guard.refresh() == 1 * GIB  # 2 + 3 - 4: one of the two cached GiB goes back
    device.reading = Counters(free=1 * GIB, active=8 * GIB, cache=1 * GIB)
    assert guard.refresh() == 0
    device.reading = Counters(free=2 * GIB, active=8 * GIB, cache=0)
    assert guard.refresh() == 0
    assert device.limits == [8 * GIB, 1 * GIB, 0]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "3072 MiB free, under the 4096 MiB headroom" in warnings[0]

    device.reading = Counters(free=40 * GIB, active=8 * GIB, cache=0)  # room again; short again warns again
    assert guard.refresh() == 8 * GIB
    device.reading = Counters(free=0, active=8 * GIB, cache=0)
    guard.refresh()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 2


def test_the_thread_keeps_the_limit_fresh_until_stopped():
    device = _Device(free=30 * GIB, active=8 * GIB, cache=0)
    guard = Headroom(4096, ceiling=4 * GIB, period_s=0.001, read=device.read, set_limit=device.set_limit)
    assert guard.start() is guard
    assert device.limits == [4 * GIB]  # set at once, at the configured limit
    device.read_event.clear()
    device.reading = Counters(free=2 * GIB, active=8 * GIB, cache=3 * GIB)
    assert device.read_event.wait(5)
    device.read_event.clear()
    assert device.read_event.wait(5)  # a whole reading after the change
    guard.stop()
    assert device.limits[-1] == 1 * GIB
    count = len(device.limits)
    device.reading = Counters(free=50 * GIB, active=8 * GIB, cache=0)
    device.read_event.clear()
    assert not device.read_event.wait(0.05)  # stopped: no more readings
    assert len(device.limits) == count


def test_the_headroom_sets_the_cache_limit_and_never_mlxs_memory_limit(monkeypatch):
    # A limit on the memory in use would make every evaluation over it wait for the device's queued work after each
    # command buffer: the headroom bounds only what the process keeps idle.
    monkeypatch.setitem(device_memory.CACHE_LIMIT, "bytes", None)
    previous_cache, memory = mx.set_cache_limit(6 * GIB), mx.get_memory_limit()
    try:
        def short() -> Counters:  # the device as if another process had taken all but 1 GiB
            return Counters(1 * GIB, mx.get_active_memory() + 20 * GIB, 2 * GIB)

        guard = Headroom(2048, read=short)
        assert guard.refresh() == 1 * GIB  # 2 + 1 - 2, under the 6 configured
        assert mx.set_cache_limit(6 * GIB) == 1 * GIB and device_memory.CACHE_LIMIT["bytes"] == 1 * GIB
        assert mx.get_memory_limit() == memory
        assert Headroom(2048, read=lambda: Counters(40 * GIB, 0, 0)).refresh() == 6 * GIB  # the configured one
    finally:
        mx.set_cache_limit(previous_cache)


def test_memory_freed_into_the_pool_counts_as_the_process_own_in_the_limit():
    # 1 GiB cached, 5 freed into the pool, 1 free on the device, 4 kept: 1 + 5 + 1 - 4 = 3.
    reading = Counters(free=1 * GIB, active=10 * GIB, cache=1 * GIB, pooled=5 * GIB)
    assert cache_limit(reading, 4 * GIB, 8 * GIB) == 3 * GIB


class _Pool:
    """A driver pool a test sets: reserved and used bytes; a trim hands every unused byte back to `device` (all of
    them, or `keeps` of them stay: a trim that cannot release everything)."""

    def __init__(self, reserved: int, used: int, device: _Device | None = None) -> None:
        self.reserved_bytes, self.used_bytes, self.trims, self.device, self.keeps = reserved, used, 0, device, 0

    def reserved(self) -> int:
        return self.reserved_bytes

    def used(self) -> int:
        return self.used_bytes

    def trim(self) -> None:
        self.trims += 1
        freed = self.reserved_bytes - self.used_bytes - self.keeps
        self.reserved_bytes -= freed
        if self.device is not None:
            r = self.device.reading
            self.device.reading = Counters(r.free + freed, r.active, r.cache)


def test_the_pool_is_trimmed_only_while_the_device_is_short(monkeypatch):
    monkeypatch.setitem(POOL_BYTES, "pooled", 0)
    monkeypatch.setitem(POOL_BYTES, "trimmed", 0)
    device = _Device(free=30 * GIB, active=8 * GIB, cache=2 * GIB)
    pool = _Pool(reserved=16 * GIB, used=10 * GIB, device=device)  # 6 GiB freed by MLX, reserved for this process
    guard = Headroom(4096, ceiling=64 * GIB, read=device.read, set_limit=device.set_limit, pool=pool)
    assert guard.refresh() == (2 + 6 + 30 - 4) * GIB  # room on the device: the pool keeps it, counted as ours
    assert pool.trims == 0 and POOL_BYTES == {"pooled": 6 * GIB, "trimmed": 0}

    device.reading = Counters(free=1 * GIB, active=8 * GIB, cache=2 * GIB)  # short: the 6 GiB go back
    assert guard.refresh() == (2 + 1 + 6 - 4) * GIB  # read again after the trim: free on the device now
    assert device.reading.free == 7 * GIB
    assert pool.trims == 1 and POOL_BYTES == {"pooled": 0, "trimmed": 6 * GIB}
    guard.refresh()
    assert pool.trims == 1  # nothing pooled: no trim

    pool.reserved_bytes = pool.used_bytes + device_memory.TRIM_MIN_BYTES - 1  # too little to be worth a call
    device.reading = Counters(free=0, active=8 * GIB, cache=2 * GIB)
    guard.refresh()
    assert pool.trims == 1 and POOL_BYTES["pooled"] == device_memory.TRIM_MIN_BYTES - 1
    pool.reserved_bytes += 1
    guard.refresh()
    assert pool.trims == 2 and POOL_BYTES["trimmed"] == 6 * GIB + device_memory.TRIM_MIN_BYTES


def test_what_a_trim_leaves_in_the_pool_stays_pooled_and_is_not_counted_free(monkeypatch):
    monkeypatch.setitem(POOL_BYTES, "pooled", 0)
    monkeypatch.setitem(POOL_BYTES, "trimmed", 0)
    device = _Device(free=1 * GIB, active=8 * GIB, cache=2 * GIB)
    pool = _Pool(reserved=16 * GIB, used=10 * GIB, device=device)
    pool.keeps = 5 * GIB  # of the 6 unused, the trim gives back 1
    guard = Headroom(4096, ceiling=64 * GIB, read=device.read, set_limit=device.set_limit, pool=pool)
    assert guard.refresh() == (2 + 5 + 2 - 4) * GIB  # 2 free now, 5 still pooled (reusable by this process)
    assert POOL_BYTES == {"pooled": 5 * GIB, "trimmed": 1 * GIB}
    guard.refresh()  # still short: trimmed again, nothing more comes back
    assert pool.trims == 2 and POOL_BYTES == {"pooled": 5 * GIB, "trimmed": 1 * GIB}


def test_a_pool_that_stops_answering_is_dropped_and_the_limit_still_follows_the_device(monkeypatch, caplog):
    from services.common.device_pool import DriverError

    monkeypatch.setitem(POOL_BYTES, "pooled", 0)
    device = _Device(free=1 * GIB, active=8 * GIB, cache=2 * GIB)
    pool = _Pool(reserved=16 * GIB, used=10 * GIB)

    def failing() -> int:
        raise DriverError("cuMemPoolGetAttribute returned CUDA error 201")

    pool.reserved = failing
    guard = Headroom(4096, ceiling=8 * GIB, read=device.read, set_limit=device.set_limit, pool=pool)
    assert guard.refresh() == 0 and pool.trims == 0  # as without a pool: 2 + 1 - 4, floored at 0
    device.reading = Counters(free=3 * GIB, active=8 * GIB, cache=2 * GIB)
    assert guard.refresh() == 1 * GIB
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
        assert cli.keep_device_headroom(None) is None


def test_the_headroom_flag():
    parser = cli.build_parser("svc", "test")
    model = ["--model", "."]
    assert cli.parse_args(parser, model).device_headroom_mb is None
    assert cli.parse_args(parser, [*model, "--device-headroom-mb", "0"]).device_headroom_mb == 0
    assert cli.parse_args(parser, [*model, "--device-headroom-mb", "2048"]).device_headroom_mb == 2048
    with pytest.raises(SystemExit):
        cli.parse_args(parser, [*model, "--device-headroom-mb", "-1"])
    assert cli.keep_device_headroom(0) is None  # off


needs_free_memory = pytest.mark.skipif("free_memory" not in mx.device_info(),
                                       reason="a device that reports its free memory (a CUDA GPU)")


@pytest.mark.gpu
@needs_free_memory
def test_on_a_gpu_a_device_under_the_headroom_hands_the_cache_back_at_the_next_allocation(monkeypatch):
    monkeypatch.setitem(device_memory.CACHE_LIMIT, "bytes", None)
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

        memory = mx.get_memory_limit()
        assert Headroom(1024, read=short).refresh() == 0  # 512 cached, none free, 1024 kept
        mx.eval(mx.ones((3 * MIB,), dtype=mx.float32) + held[: 3 * MIB])
        mx.synchronize()
        assert mx.get_cache_memory() < 64 * MIB  # the next allocation handed the cache back
        assert mx.get_memory_limit() == memory
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
        # The free is stream-ordered: the pool counts it once the stream ran it. (No evaluation in between: an
        # allocation placed in the freed block, however small, keeps the whole block out of a trim.)
        mx.synchronize()
        assert pool.reserved() - pool.used() >= GIB * 9 // 10, "the freed GiB is not held by the pool"
        pool.trim()
        assert pool.reserved() - pool.used() < 64 * MIB
        assert mx.device_info()["free_memory"] >= before - 64 * MIB  # back on the device
    finally:
        mx.set_cache_limit(previous_cache)
