"""The CUDA driver's memory pool that MLX allocates a process's device memory from, and handing its unused memory
back to the device.

MLX's CUDA allocator takes device memory with `cudaMallocAsync` from the device's default memory pool and frees
its buffers into that pool (`cudaFreeAsync`). Memory freed into the pool can stay reserved by the process (until
the driver releases it at a synchronization, past the pool's release threshold): this process can allocate it
again, no other process can. Measured on an H100 before any conversation opened: the four services' MLX arrays
and caches were 40,408 MiB, the device's memory in use 76,402 MiB (docs/performance-history.md, "40 conversations
on an H100; device memory outside MLX's counters"); in a 40-conversation run the pools held up to 2.6-13.0 GB
each that no array used. A trim hands back only the pool's wholly free blocks: a block holding any live
allocation, however small, stays reserved (`python -m bench.device_memory` reads the pool phase by phase).
Reading the pool costs two driver calls.

`DevicePool` reads the pool's reserved and used bytes and trims it (`cuMemPoolTrimTo`), through the CUDA driver
(libcuda), which every CUDA process has loaded. Where there is no CUDA device (the CPU, Apple silicon) or the
driver lacks the calls, `DevicePool.open()` is None and nothing here runs.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Protocol

# CUmemPool_attribute values (cuda.h)
RESERVED_MEM_CURRENT = 5
USED_MEM_CURRENT = 7


class Pool(Protocol):
    """What `Headroom` needs of a pool: its reserved and used bytes, and trimming it."""

    def reserved(self) -> int: ...
    def used(self) -> int: ...
    def trim(self) -> None: ...


class DriverError(RuntimeError):
    """A CUDA driver call returned an error code."""


class DevicePool:
    """The default memory pool of CUDA device `ordinal` (the first visible one, where MLX allocates)."""

    def __init__(self, driver: ctypes.CDLL, handle: ctypes.c_void_p, context: ctypes.c_void_p) -> None:
        self._driver = driver
        self._handle = handle
        self._context = context  # the device's primary context (MLX's), made current on the calling thread

    @classmethod
    def open(cls, ordinal: int = 0) -> DevicePool | None:
        """The pool of the device MLX allocates on; None without MLX's CUDA backend, the CUDA driver, or the
        pool calls (a driver older than CUDA 11.2)."""
        try:
            import mlx.core as mx

            if not mx.cuda.is_available():
                return None
            driver = ctypes.CDLL("libcuda.so.1")
            _declare(driver)
        except (ImportError, AttributeError, OSError):
            return None
        try:
            _check(driver.cuInit(0), "cuInit")
            device = ctypes.c_int()
            _check(driver.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
            handle = ctypes.c_void_p()
            _check(driver.cuDeviceGetDefaultMemPool(ctypes.byref(handle), device), "cuDeviceGetDefaultMemPool")
            context = ctypes.c_void_p()
            _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
            pool = cls(driver, handle, context)
            pool.reserved()
        except DriverError as exc:
            logging.getLogger(__name__).warning("the device's memory pool cannot be read (%s): memory this "
                                                "process frees stays reserved for it", exc)
            return None
        return pool

    def _current(self) -> None:
        """The driver's pool calls act in the calling thread's context: MLX's, on whichever thread calls."""
        _check(self._driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def _attribute(self, attribute: int) -> int:
        self._current()
        value = ctypes.c_uint64()
        _check(self._driver.cuMemPoolGetAttribute(self._handle, attribute, ctypes.byref(value)),
               "cuMemPoolGetAttribute")
        return value.value

    def reserved(self) -> int:
        """Bytes of the device the pool holds for this process."""
        return self._attribute(RESERVED_MEM_CURRENT)

    def used(self) -> int:
        """Bytes of those in allocations (MLX's arrays and its buffer cache)."""
        return self._attribute(USED_MEM_CURRENT)

    def trim(self) -> None:
        """Hand every reserved byte that no allocation uses back to the device."""
        self._current()
        _check(self._driver.cuMemPoolTrimTo(self._handle, ctypes.c_size_t(0)), "cuMemPoolTrimTo")


def _declare(driver: ctypes.CDLL) -> None:
    """The signatures of the driver calls used here (an AttributeError where the driver lacks one)."""
    calls = {
        "cuInit": [ctypes.c_uint],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDeviceGetDefaultMemPool": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
        "cuCtxSetCurrent": [ctypes.c_void_p],
        "cuMemPoolGetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p],
        "cuMemPoolTrimTo": [ctypes.c_void_p, ctypes.c_size_t],
    }
    for name, argtypes in calls.items():
        function = getattr(driver, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int


def _check(code: int, call: str) -> None:
    if code != 0:
        raise DriverError(f"{call} returned CUDA error {code}")
