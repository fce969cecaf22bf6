"""Domain exceptions that the gRPC layer maps to status codes (see services.common.server.status_for).

ValueError         -> INVALID_ARGUMENT   bad input: wrong shape, sample rate, message order
LimitExceeded      -> RESOURCE_EXHAUSTED a bound was passed: max_streaming_seconds, context length
ServiceUnavailable -> UNAVAILABLE        still loading, shutting down, a dependency is down
anything else      -> INTERNAL

BindError is not a gRPC status: an address a server cannot listen on, which ends the process with EXIT_BIND.
"""

import errno

EXIT_BIND = 2  # the exit code of a server whose port is in use (or whose host is not this machine's)


class LimitExceeded(Exception):
    """A session or request passed a configured bound; the message names the bound and its value."""


class ServiceUnavailable(Exception):
    """The service cannot take the call now (loading, shutting down, dependency down); retrying may work."""


class BindError(OSError):
    """A server cannot listen on its address; the message is one line naming the address and the likely cause."""


def bind_error(address: str, exc: OSError) -> BindError:
    """`cannot listen on ADDRESS: the port is in use` (or the system's reason) for a failed bind of ADDRESS."""
    reason = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return BindError(f"cannot listen on {address}: {reason}")
