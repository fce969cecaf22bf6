"""Domain exceptions that the gRPC layer maps to status codes (see services.common.server.status_for).

ValueError         -> INVALID_ARGUMENT   bad input: wrong shape, sample rate, message order
LimitExceeded      -> RESOURCE_EXHAUSTED a bound was passed: max_streaming_seconds, context length
out of memory      -> RESOURCE_EXHAUSTED the device's memory ran out (`out_of_memory`)
ServiceUnavailable -> UNAVAILABLE        still loading, shutting down, a dependency is down
anything else      -> INTERNAL

BindError is not a gRPC status: an address a server cannot listen on, which ends the process with EXIT_BIND.

A lost device is not one either: once a GPU's context has failed (an illegal memory access, a launch failure),
every later call on it fails the same way, so the call is answered UNAVAILABLE (another replica, or this one
started again, can take it) and the process ends with EXIT_DEVICE_LOST for its supervisor to start it afresh.
"""

import errno

EXIT_BIND = 2  # the exit code of a server whose port is in use (or whose host is not this machine's)
EXIT_DEVICE_LOST = 3  # the exit code of a service whose device failed for good (see `device_lost`)

# What the CUDA runtime (as MLX's errors quote it) and Metal say once a device's context is unusable: such an error
# is sticky, every later kernel of the process failing too. Running out of memory is not among them.
_DEVICE_LOST = ("illegal memory access", "unspecified launch failure", "device-side assert", "misaligned address",
                "illegal instruction", "uncorrectable ecc error", "hardware stack error", "gpu address fault",
                "context is destroyed", "gpu has fallen off the bus")


# What MLX's allocators and the CUDA runtime say when the device's memory ran out: that call fails, the device and
# every other session on it are fine.
_OUT_OF_MEMORY = ("out of memory", "unable to allocate", "insufficient memory")


class LimitExceeded(Exception):
    """A session or request passed a configured bound; the message names the bound and its value."""


class ServiceUnavailable(Exception):
    """The service cannot take the call now (loading, shutting down, dependency down); retrying may work."""


class DeviceLost(RuntimeError):
    """The service's device failed for good: the process ends with EXIT_DEVICE_LOST; the message says why."""


def device_lost(exc: BaseException) -> bool:
    """Whether `exc` says the device's context is lost (a sticky GPU fault), not a failure of one call.

    >>> device_lost(RuntimeError("cudaGraphLaunch(...) failed: an illegal memory access was encountered"))
    True
    >>> device_lost(RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory"))
    False
    """
    if isinstance(exc, DeviceLost):
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(text in message for text in _DEVICE_LOST)


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says an allocation on the device failed (this call's failure, not a lost device's).

    >>> out_of_memory(RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory"))
    True
    >>> out_of_memory(RuntimeError("[malloc] Unable to allocate 1073741824 bytes."))
    True
    >>> out_of_memory(RuntimeError("cudaGraphLaunch(...) failed: an illegal memory access was encountered"))
    False
    """
    message = str(exc).lower()
    return (isinstance(exc, RuntimeError) and not device_lost(exc)
            and any(text in message for text in _OUT_OF_MEMORY))


class BindError(OSError):
    """A server cannot listen on its address; the message is one line naming the address and the likely cause."""


def bind_error(address: str, exc: OSError) -> BindError:
    """`cannot listen on ADDRESS: the port is in use` (or the system's reason) for a failed bind of ADDRESS."""
    reason = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return BindError(f"cannot listen on {address}: {reason}")
