"""A step that runs the device out of memory runs once more after the buffer cache goes back
(services.common.device_memory.evaluate): its sessions' outputs and state are those of a step that never failed.

On the CPU the failure is made at the step's evaluation, before MLX evaluates anything; on a GPU
(`-m gpu`) a real allocation fails halfway through an evaluation and the second one completes it."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from bench.service import EngineDriver
from services.common import device_memory
from services.common.config import VoiceChatConfig
from services.common.metrics import Metrics

OUT_OF_MEMORY = "cudaMallocAsync(&data, size, stream) failed: out of memory"
SESSIONS = 3
FRAMES = 4


class FailingEval:
    """mx.eval, except that the first call after `arm()` raises the CUDA backend's out-of-memory error."""

    def __init__(self) -> None:
        self.real = mx.eval
        self.armed = False
        self.raised = 0

    def arm(self) -> None:
        self.armed = True

    def __call__(self, *arrays) -> None:
        if self.armed:
            self.armed = False
            self.raised += 1
            raise RuntimeError(OUT_OF_MEMORY)
        self.real(*arrays)


def plain(value):
    """Outputs as numpy and plain values, to compare two runs."""
    if isinstance(value, mx.array):
        return np.array(value)
    if isinstance(value, np.ndarray | str | int | float | type(None)):
        return value
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return str(value)


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def run(name: str, model, failing: FailingEval | None, fail_at: set[int]) -> list:
    driver = EngineDriver(name, model, VoiceChatConfig.load(model))
    sessions = [driver.open() for _ in range(SESSIONS)]
    outputs = []
    for frame in range(FRAMES):
        if failing is not None and frame in fail_at:
            failing.arm()
        outputs.append(plain(driver.step(sessions)))
        outputs.append(plain(driver.step(sessions[:1])))  # a lone session's step: the solo path
    return outputs


@pytest.mark.parametrize("name", ["perception", "llm", "tts", "codec"])
def test_a_step_that_ran_out_of_memory_runs_again_and_gives_what_it_would_have(name, tiny_checkpoint, monkeypatch,
                                                                               caplog):
    metrics = Metrics(name)
    before = {outcome: metrics.value("voicechat_out_of_memory_steps_total", outcome=outcome)
              for outcome in ("recovered", "failed")}
    expected = run(name, tiny_checkpoint, None, set())
    failing = FailingEval()
    monkeypatch.setattr(mx, "eval", failing)
    got = run(name, tiny_checkpoint, failing, {1, 3})
    assert failing.raised == 2
    assert same(got, expected)
    assert len([r for r in caplog.records if "ran the device out of memory" in r.getMessage()]) == 2
    assert metrics.value("voicechat_out_of_memory_steps_total", outcome="recovered") == before["recovered"] + 2
    assert metrics.value("voicechat_out_of_memory_steps_total", outcome="failed") == before["failed"]


def test_a_second_failure_or_another_error_is_raised(monkeypatch):
    calls = []

    def always(*arrays):
        calls.append(arrays)
        raise RuntimeError(OUT_OF_MEMORY)

    monkeypatch.setattr(mx, "eval", always)
    failed = device_memory.OUT_OF_MEMORY_STEPS["failed"]
    with pytest.raises(RuntimeError, match="out of memory"):
        device_memory.evaluate(mx.array(1))
    assert len(calls) == 2  # once, and once more after the cache went back
    assert device_memory.OUT_OF_MEMORY_STEPS["failed"] == failed + 1
    assert Metrics("codec").value("voicechat_out_of_memory_steps_total", outcome="failed") == failed + 1

    def broken(*arrays):
        calls.append(arrays)
        raise RuntimeError("decoder exploded")

    calls.clear()
    monkeypatch.setattr(mx, "eval", broken)
    with pytest.raises(RuntimeError, match="decoder exploded"):
        device_memory.evaluate(mx.array(1))
    assert len(calls) == 1  # not an allocation's failure: not run again


def test_the_cache_goes_back_before_the_second_evaluation(monkeypatch):
    real, cached = mx.eval, []

    def fails_first(*arrays):
        if not cached:
            cached.append(mx.get_cache_memory())
            raise RuntimeError(OUT_OF_MEMORY)
        cached.append(mx.get_cache_memory())
        real(*arrays)

    previous = mx.set_cache_limit(1 << 34)  # restored after
    try:
        buffers = mx.zeros((1 << 20,))
        real(buffers)
        del buffers
        monkeypatch.setattr(mx, "eval", fails_first)
        x = mx.arange(4) * 3
        device_memory.evaluate(x)
        assert cached[0] >= 4 << 20 and cached[1] == 0
        assert np.array(x).tolist() == [0, 3, 6, 9]
    finally:
        mx.set_cache_limit(previous)


@pytest.mark.gpu
@pytest.mark.skipif("total_memory" not in mx.device_info(), reason="a GPU that reports its memory")
def test_on_a_gpu_an_evaluation_that_ran_out_of_memory_completes_once_the_cache_is_back():
    total = int(mx.device_info()["total_memory"])
    previous_limit = mx.set_memory_limit(1 << 62)  # MLX then never frees the cache before allocating
    previous_cache = mx.set_cache_limit(1 << 62)
    try:
        mx.clear_cache()
        x = mx.random.normal((1024, 1024), key=mx.random.key(0))
        mx.eval(x)
        row = 1 << 20  # float32s a row: a dimension stays under 2**31
        filler = mx.zeros((int(total * 0.7) // 4 // row, row), dtype=mx.float32)
        mx.eval(filler)
        del filler
        mx.synchronize()
        assert mx.get_cache_memory() >= int(total * 0.69)
        small = (x @ x).sum()  # fits beside the cache
        rows = int(total * 0.4) // 4 // row
        big = (mx.ones((rows, row), dtype=mx.float32) * 2).sum()  # does not
        result = small + big
        with pytest.raises(RuntimeError, match="out of memory"):  # as the step's own first evaluation meets it
            mx.eval(result)
        device_memory.evaluate(result)  # the cache goes back; the evaluation completes
        expected = float((np.array(x, dtype=np.float64) @ np.array(x, dtype=np.float64)).sum())
        count = rows * row
        assert abs(float(big) - 2.0 * count) <= 1e-3 * 2.0 * count
        assert abs(float(small) - expected) <= 1e-3 * max(1.0, abs(expected))
        assert np.array(result) == np.float32(np.array(small)) + np.float32(np.array(big))
    finally:
        mx.set_memory_limit(previous_limit)
        mx.set_cache_limit(previous_cache)
        mx.clear_cache()


class RecordingPool:
    """A memory pool holding `unused` bytes no allocation uses, which a trim hands back; logs each call in `log`."""

    def __init__(self, log: list, unused: int, fails: bool = False) -> None:
        self.log, self.unused, self.fails = log, unused, fails

    def reserved(self) -> int:
        if self.fails:
            raise device_memory.DriverError("cuMemPoolGetAttribute returned CUDA error 1")
        return (1 << 30) + self.unused

    def used(self) -> int:
        return 1 << 30

    def trim(self) -> None:
        self.log.append(("trim", mx.get_cache_memory()))
        self.unused = 0


def test_the_pools_unused_reserve_goes_back_after_the_cache_and_before_the_second_evaluation(monkeypatch):
    real, log = mx.eval, []
    pool = RecordingPool(log, unused=300 << 20)

    def fails_first(*arrays):
        log.append(("eval", mx.get_cache_memory()))
        if len(log) == 1:
            raise RuntimeError(OUT_OF_MEMORY)
        real(*arrays)

    previous = mx.set_cache_limit(1 << 34)
    try:
        buffers = mx.zeros((1 << 20,))
        real(buffers)
        del buffers
        monkeypatch.setattr(device_memory, "process_pool", lambda: pool)
        monkeypatch.setattr(mx, "eval", fails_first)
        x = mx.arange(4) * 3
        device_memory.evaluate(x)
    finally:
        mx.set_cache_limit(previous)
    assert [what for what, _ in log] == ["eval", "trim", "eval"]
    assert log[0][1] >= 4 << 20 and log[1][1] == 0  # the trim comes after the cache went back
    assert pool.unused == 0
    assert np.array(x).tolist() == [0, 3, 6, 9]


def test_hand_back_reports_what_went_back_and_survives_a_pool_that_stops_answering():
    previous = mx.set_cache_limit(1 << 34)
    try:
        for pool, trimmed in ((None, 0), (RecordingPool([], unused=300 << 20), 300 << 20),
                              (RecordingPool([], unused=300 << 20, fails=True), 0)):
            buffers = mx.zeros((1 << 20,))
            mx.eval(buffers)
            del buffers
            counted = device_memory.POOL_BYTES["trimmed"]
            cached, handed = device_memory.hand_back(pool)
            assert cached >= 4 << 20 and mx.get_cache_memory() == 0
            assert handed == trimmed
            assert device_memory.POOL_BYTES["trimmed"] == counted + trimmed  # voicechat_memory_trimmed_bytes_total
    finally:
        mx.set_cache_limit(previous)
