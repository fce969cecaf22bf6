"""Domain exceptions that the gRPC layer maps to status codes (see services.common.server.status_for).

ValueError         -> INVALID_ARGUMENT   bad input: wrong shape, sample rate, message order
LimitExceeded      -> RESOURCE_EXHAUSTED a bound was passed: max_streaming_seconds, context length
ServiceUnavailable -> UNAVAILABLE        still loading, shutting down, a dependency is down
anything else      -> INTERNAL
"""


class LimitExceeded(Exception):
    """A session or request passed a configured bound; the message names the bound and its value."""


class ServiceUnavailable(Exception):
    """The service cannot take the call now (loading, shutting down, dependency down); retrying may work."""
