"""The grpc.aio server bootstrap shared by the four network services (and the orchestrator's service).

Every server gets the same furniture: `grpc.health.v1` (NOT_SERVING until the model has loaded, then SERVING
for "" and every service name), reflection, explicit message-size limits, graceful shutdown on SIGTERM/SIGINT,
and one interceptor that maps domain exceptions to status codes, so servicer methods carry no try/except:

    ValueError and an unparseable stream message -> INVALID_ARGUMENT, LimitExceeded and the device's memory running
    out (`services.common.errors.out_of_memory`) -> RESOURCE_EXHAUSTED, ServiceUnavailable -> UNAVAILABLE,
    NotImplementedError -> UNIMPLEMENTED, anything else -> INTERNAL (logged with its traceback).

A lost device (`services.common.errors.device_lost`: a sticky GPU fault) answers UNAVAILABLE, so the caller's
failover takes the session elsewhere, and `serve` ends: health turns NOT_SERVING, the calls in flight are cut,
and `serve` raises DeviceLost, on which the process exits with EXIT_DEVICE_LOST and its supervisor restarts it.

Given a Metrics, the interceptor counts each mapped error in voicechat_errors_total by status code name.

Until the server is marked serving, calls to the registered services are answered UNAVAILABLE.

    await serve([(codec_pb2_grpc.add_CodecServiceServicer_to_server, servicer)],
                [full_service_name(codec_pb2, "CodecService")], port=0, load=load_weights,
                on_ready=lambda running: print(f"listening on {running.address}"), metrics=servicer.metrics)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import (
    BindError,
    DeviceLost,
    LimitExceeded,
    ServiceUnavailable,
    bind_error,
    device_lost,
    out_of_memory,
)
from services.common.metrics import Metrics
from services.common.security import Tls, bearer_matches

log = logging.getLogger(__name__)

AddFn = Callable[[Any, grpc.aio.Server], None]
Registration = tuple[AddFn, object]  # (add_XServicer_to_server, servicer)

DEFAULT_MAX_MESSAGE_MB = 64
DEFAULT_GRACE_S = 5.0
MIN_CLIENT_PING_INTERVAL_MS = 1000  # the most often a client may ping without sending data
_MIB = 1024 * 1024
# Infrastructure services answer while loading and bypass error mapping.
_INFRA_SERVICES = (health.SERVICE_NAME, reflection.SERVICE_NAME)


def full_service_name(pb2: ModuleType, service: str) -> str:
    """`full_service_name(codec_pb2, "CodecService")` -> "voicechat.v1.CodecService"."""
    return pb2.DESCRIPTOR.services_by_name[service].full_name


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details a servicer exception becomes."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, DecodeError):  # a stream's next message: bytes that are not the request type
        return grpc.StatusCode.INVALID_ARGUMENT, f"a request message does not parse: {message}"
    if isinstance(exc, LimitExceeded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, message
    if isinstance(exc, ServiceUnavailable):
        return grpc.StatusCode.UNAVAILABLE, message
    if device_lost(exc):
        return grpc.StatusCode.UNAVAILABLE, (f"the service's device failed ({type(exc).__name__}: {exc}); the "
                                             "service is restarting: retry")
    if out_of_memory(exc):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, (
            f"the service ran out of device memory ({type(exc).__name__}: {exc}); it released its buffer cache. "
            "Serve fewer conversations on this device, or give the services a smaller --cache-limit-mb")
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, message
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, message
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


OnDeviceLost = Callable[[BaseException], None]


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, metrics: Metrics | None,
                 on_device_lost: OnDeviceLost | None = None) -> None:
    if isinstance(exc, grpc.aio.AbortError):  # the servicer aborted itself: its status stands
        raise exc
    code, message = status_for(exc)
    if metrics is not None:
        metrics.error(code.name)
    if device_lost(exc):
        if on_device_lost is not None:
            on_device_lost(exc)
    elif code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in a servicer method")
    elif out_of_memory(exc):
        log.warning("%s: %s", code.name, message)
    else:
        log.info("%s: %s", code.name, message)
    await context.abort(code, message)


class _Gate:
    """Whether the registered services take calls yet (the model has loaded)."""

    def __init__(self) -> None:
        self.open = False

    def check(self) -> None:
        if not self.open:
            raise ServiceUnavailable("the service is still loading its model; retry when health says SERVING")


def _wrap_unary_response(behavior: Callable, gate: _Gate, metrics: Metrics | None,
                         on_device_lost: OnDeviceLost | None) -> Callable:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            gate.check()
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        except Exception as exc:
            await _abort(context, exc, metrics, on_device_lost)

    return handler


def _wrap_stream_response(behavior: Callable, gate: _Gate, metrics: Metrics | None,
                          on_device_lost: OnDeviceLost | None) -> Callable:
    # An async generator function, so grpc.aio streams what it yields; it also serves servicers written
    # with context.write (a coroutine that yields nothing) and plain generators.
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            gate.check()
            result = behavior(request, context)
            if hasattr(result, "__aiter__"):
                async with contextlib.aclosing(result) as responses:  # close it (and free its session) now
                    async for response in responses:
                        yield response
            elif inspect.isawaitable(result):
                await result
            elif result is not None:
                for response in result:
                    yield response
        except Exception as exc:
            await _abort(context, exc, metrics, on_device_lost)

    return handler


def _wrap(handler: grpc.RpcMethodHandler, gate: _Gate, metrics: Metrics | None,
          on_device_lost: OnDeviceLost | None) -> grpc.RpcMethodHandler:
    return _rebuilt(handler, lambda behavior: _wrap_unary_response(behavior, gate, metrics, on_device_lost),
                    lambda behavior: _wrap_stream_response(behavior, gate, metrics, on_device_lost))


def _rebuilt(handler: grpc.RpcMethodHandler, unary: Callable[[Callable], Callable],
             stream: Callable[[Callable], Callable]) -> grpc.RpcMethodHandler:
    """The handler of the same kind and codecs whose behavior is unary(behavior) for a unary response, else
    stream(behavior)."""
    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **codecs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), **codecs)
    return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), **codecs)


UNAUTHENTICATED_MESSAGE = "missing or wrong API key: send the metadata `authorization: Bearer KEY`"


def _refusal(handler: grpc.RpcMethodHandler, metrics: Metrics | None) -> grpc.RpcMethodHandler:
    """The handler answering every call UNAUTHENTICATED (counted in `metrics`) before the servicer sees it."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        if metrics is not None:
            metrics.error(grpc.StatusCode.UNAUTHENTICATED.name)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    return _rebuilt(handler, lambda _: refuse, lambda _: refuse)


def _authorization(details: grpc.HandlerCallDetails) -> str | None:
    return next((value for key, value in details.invocation_metadata or () if key == "authorization"), None)


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAVAILABLE until the gate opens and maps servicer exceptions to status codes (status_for),
    counting them in `metrics` when given. With `api_key`, every call but a health check needs the metadata
    `authorization: Bearer KEY` (UNAUTHENTICATED otherwise): probes stay open, reflection does not.
    `on_device_lost` hears of every call that failed on a lost device."""

    def __init__(self, gate: _Gate, metrics: Metrics | None = None, api_key: str | None = None,
                 on_device_lost: OnDeviceLost | None = None) -> None:
        self._gate = gate
        self._metrics = metrics
        self._api_key = api_key
        self._on_device_lost = on_device_lost
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method  # "/package.Service/Method"
        service = method.lstrip("/").split("/")[0]
        if self._api_key is not None and service != health.SERVICE_NAME \
                and not bearer_matches(_authorization(handler_call_details), self._api_key):
            handler = await continuation(handler_call_details)
            return None if handler is None else _refusal(handler, self._metrics)
        if method in self._wrapped:
            return self._wrapped[method]
        handler = await continuation(handler_call_details)
        if handler is None or service in _INFRA_SERVICES:
            return handler
        self._wrapped[method] = _wrap(handler, self._gate, self._metrics, self._on_device_lost)
        return self._wrapped[method]


class RunningServer:
    """A started server: its bound port, its health servicer, and the switch between loading and serving."""

    def __init__(
        self,
        server: grpc.aio.Server,
        host: str,
        port: int,
        health_servicer: health.aio.HealthServicer,
        service_names: Sequence[str],
        gate: _Gate,
    ) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.health = health_servicer
        self.service_names = list(service_names)
        self._gate = gate

    @property
    def address(self) -> str:
        """HOST:PORT as bound, e.g. "[::]:43121"."""
        return f"{self.host}:{self.port}"

    @property
    def serving(self) -> bool:
        return self._gate.open

    async def set_serving(self, serving: bool) -> None:
        """Open (or close) the services and report SERVING (NOT_SERVING) for "" and every service name."""
        self._gate.open = serving
        await self.report(serving)

    async def report(self, serving: bool) -> None:
        """Report SERVING (NOT_SERVING) for "" and every service name, the services staying open: for a server
        whose calls answer for themselves while something it needs is down."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def become_ready(self, load: Callable[[], Awaitable[None]] | None = None) -> None:
        """Await load() (the model's weights; its exceptions propagate), then start serving."""
        if load is not None:
            await load()
        await self.set_serving(True)

    async def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """Report NOT_SERVING, refuse new calls, and give calls in flight grace_s seconds to finish."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def _check_free(host: str, port: int) -> None:
    """BindError when HOST:PORT cannot be bound. gRPC refuses it too, but says why only in a log line of its own
    on stderr; this probe puts the reason in the one line the process prints."""
    if port == 0:
        return
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
    except socket.gaierror:
        return  # gRPC's own resolution reports it
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a port in TIME_WAIT is free
        try:
            probe.bind(where)
        except OSError as exc:
            raise bind_error(f"{host}:{port}", exc) from None


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def start_server(
    registrations: Sequence[Registration],
    service_names: Sequence[str],
    *,
    host: str = "[::]",
    port: int = 0,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    metrics: Metrics | None = None,
    api_key: str | None = None,
    tls: Tls | None = None,
    on_device_lost: OnDeviceLost | None = None,
) -> RunningServer:
    """Bind and start a server whose services answer UNAVAILABLE (health NOT_SERVING) until set_serving(True).

    port 0 binds an ephemeral port, reported as `RunningServer.port`. Errors the interceptor maps are counted in
    `metrics` when given. With `api_key` calls need `authorization: Bearer KEY` (see ServiceInterceptor); with
    `tls` the port speaks TLS only. `on_device_lost(exc)` is called for each call that failed on a lost device.
    """
    if max_message_mb <= 0:
        raise ValueError(f"max_message_mb must be positive, got {max_message_mb}")
    limit = int(max_message_mb * _MIB)
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
               # Clients keep sessions alive with pings every few seconds (the orchestrator's every 2 s), also
               # while a session's stream is idle; the default policy (one per 5 minutes without data) would
               # answer them with GOAWAY "too_many_pings" and end every session on the connection.
               ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
               ("grpc.keepalive_permit_without_calls", 1),
               # With SO_REUSEPORT (gRPC's default on Linux) a second server binds a busy port and the kernel
               # splits the connections between the two: a port in use must fail instead.
               ("grpc.so_reuseport", 0)]
    gate = _Gate()
    server = grpc.aio.server(interceptors=[ServiceInterceptor(gate, metrics, api_key, on_device_lost)],
                             options=options)
    for add, servicer in registrations:
        add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, *_INFRA_SERVICES], server)

    host = _bracket(host)
    address = f"{host}:{port}"
    _check_free(host, port)
    try:
        bound = (server.add_secure_port(address, tls.grpc_credentials()) if tls is not None
                 else server.add_insecure_port(address))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise BindError(f"cannot listen on {address}: the port is in use (or the host is not this machine's)")
    running = RunningServer(server, host, bound, health_servicer, service_names, gate)
    await running.set_serving(False)
    await server.start()
    return running


def _install_signal_handlers(stop: asyncio.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT set `stop`; returns the undo. A no-op off the main thread or where unsupported."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass

    def undo() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)

    return undo


async def serve(
    registrations: Sequence[Registration],
    service_names: Sequence[str],
    *,
    host: str = "[::]",
    port: int = 0,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    load: Callable[[], Awaitable[None]] | None = None,
    on_ready: Callable[[RunningServer], None] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    stop: asyncio.Event | None = None,
    drain: Callable[[float], Awaitable[None]] | None = None,
    metrics: Metrics | None = None,
    api_key: str | None = None,
    tls: Tls | None = None,
) -> None:
    """Run a server until SIGTERM/SIGINT (or `stop` is set), then shut down gracefully.

    The server listens at once with health NOT_SERVING, awaits load(), turns SERVING and calls on_ready.
    A load() failure stops the server and propagates. `metrics` counts the errors the interceptor maps;
    `api_key` and `tls` are start_server's.

    Shutting down, health turns NOT_SERVING (so health-checking clients send new sessions elsewhere). Without
    `drain`, new calls are refused and calls in flight get grace_s seconds before they are cancelled. With it,
    the server keeps taking calls while `drain(grace_s)` runs (the servicer refuses new sessions itself and
    ends the last ones with a message of its own), then stops with one more second for those messages.

    A call that fails on a lost device stops the server at once (no drain: the device runs nothing more, so the
    sessions go to their callers' failover) and `serve` raises DeviceLost.
    """
    stop = stop or asyncio.Event()
    lost: list[BaseException] = []

    def on_device_lost(exc: BaseException) -> None:
        if not lost:
            log.error("the device failed (%s: %s): stopping, for this service to be started afresh",
                      type(exc).__name__, exc)
            lost.append(exc)
        stop.set()

    running = await start_server(
        registrations, service_names, host=host, port=port, max_message_mb=max_message_mb, metrics=metrics,
        api_key=api_key, tls=tls, on_device_lost=on_device_lost,
    )
    undo_signals = _install_signal_handlers(stop)
    ready = asyncio.ensure_future(running.become_ready(load))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            ready.result()
            log.info("serving %s on %s", ", ".join(service_names), running.address)
            if on_ready is not None:
                on_ready(running)
            await stopped
    finally:
        for task in (ready, stopped):
            task.cancel()
        undo_signals()
        if lost:
            await running.stop(0)
            raise DeviceLost(f"the device failed: {type(lost[0]).__name__}: {lost[0]}") from lost[0]
        log.info("shutting down (grace %.1f s)", grace_s)
        if drain is not None and running.serving:
            await running.health.enter_graceful_shutdown()
            await drain(grace_s)
            await running.stop(1.0)
        else:
            await running.stop(grace_s)
