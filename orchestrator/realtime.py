"""The `/v1/realtime` WebSocket gateway: one OnlineSession per connection, JSON text frames both ways.

    client -> session.update, input_audio_buffer.append ..., input_audio_buffer.commit (or session.cancel)
    server <- session.created, session.updated, transcript / text / function / audio deltas in frame order,
              input_audio_buffer.committed, response.done (or response.cancelled), then close 1000

With `tools` in session.update, the function channel's calls also come out as
response.function_call_arguments.delta / .done, and the client answers with conversation.item.create
{type: "function_call_output", call_id, output} (conversation.item.created confirms it); see orchestrator/tools.py.

    async with RealtimeServer(OnlineSessionFactory(clients, model_dir), port=8080) as server:
        print(server.url)                     # ws://127.0.0.1:8080/v1/realtime
        await server.serve_forever()

Each connection holds one of `max_sessions` slots from its upgrade until its session ends (server_busy and close
1013 past them). The session's blocking calls run on the connection's own worker thread, one call at a time, in
message order; an append is pushed in `frame_samples` slices and each slice's events are sent before the next
slice runs. The API key and the Origin header are checked on the upgrade request, before any WebSocket exists.
The same port serves the browser page at {prefix}/ (orchestrator/web/) and, at POST {prefix}/v1/realtime/sessions,
the single-use tokens a browser offers in place of the key (orchestrator/tokens.py).
The protocol, field for field, is in docs/protocol.md.

`metrics` (voicechat_*{service="orchestrator"}, shared with the gRPC conversation service under `orchestrator
serve`) sees the connections holding a slot, every frame whose audio delta went out (timed by the session's frame
interval, and by its LatencyTracker against the live schedule from the first append's arrival) and every error event
sent, by its error code (invalid_request, server_busy, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import collections
import concurrent.futures
import json
import logging
import math
import secrets
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import numpy as np
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidHeader
from websockets.headers import parse_subprotocol
from websockets.http11 import Request, Response

from orchestrator import web
from orchestrator.admission import BUSY, SHUTTING_DOWN, Admission, Refusal, Slot
from orchestrator.audio import to_pcm16
from orchestrator.latency import LatencyTracker, add_budget_flag
from orchestrator.tokens import SUBPROTOCOL, EphemeralTokens, TooManyTokens, offered_token
from services.common.errors import EXIT_BIND, BindError, bind_error
from services.common.metrics import Metrics, add_metrics_flags, start_from_args
from services.common.metrics import announce as announce_metrics
from services.common.security import Tls, add_tls_flags, bearer_matches, load_tls

log = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime"
SESSIONS_PATH = REALTIME_PATH + "/sessions"  # POST: a short-lived token for a browser (orchestrator/tokens.py)
PCM16_SCALE_IN = 32768.0  # append payloads decode as int16 / 32768
PCM16_SCALE_OUT = 32767.0  # response.audio.delta encodes round(clip(x, -1, 1) * 32767), as the reference does
MIB = 1 << 20

# WebSocket close codes (RFC 6455 section 7.4.1)
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the server is shutting down
CLOSE_POLICY = 1008  # no session.update in time, or an idle configured session
CLOSE_INTERNAL = 1011  # the commit's flush failed: there is no response.done to send
CLOSE_TRY_AGAIN = 1013  # server_busy

INVALID_REQUEST = "invalid_request"
SERVER_BUSY = "server_busy"
SERVER_SHUTTING_DOWN = "server_shutting_down"
SESSION_INITIALIZATION_FAILED = "session_initialization_failed"
INFERENCE_ERROR = "inference_error"
INVALID_FUNCTION_CALL = "invalid_function_call"  # the model wrote a malformed tool call; the session goes on
SESSION_CLOSED = "session_closed"  # after the error that ended the session: a notice, not another fault


def new_id(prefix: str) -> str:
    """`new_id("sess_")` -> "sess_3f9c0a1b2c3d4e5f" (16 hex digits)."""
    return prefix + secrets.token_hex(8)


@dataclass(frozen=True)
class RealtimeLimits:
    """What one connection may use; the defaults are the spec's."""

    max_message_bytes: int = MIB  # one WebSocket message (about 24 s of base64 PCM16 at 16 kHz)
    max_session_seconds: float = 600.0  # audio per session; session.max_streaming_seconds is clamped to it
    update_timeout_s: float = 30.0  # from the upgrade to session.update
    idle_timeout_s: float = 120.0  # a configured session with no client message (WebSocket pings do not count)

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_session_seconds", "update_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"RealtimeLimits.{name} must be a positive number, got {value!r}")


class RealtimeSession(Protocol):
    """What the gateway needs of a session (OnlineSession has it); every call comes from one worker thread."""

    frame_index: int

    def push_audio(self, samples: np.ndarray, sample_rate: int) -> list: ...

    def flush(self, pad_partial: bool = True) -> list: ...

    def cancel(self) -> list: ...

    def close(self) -> None: ...

    def submit_function_output(self, call_id: str, output: str) -> list: ...


class SessionFactory(Protocol):
    """Opens a session for session.update; the attributes describe what every session it opens takes."""

    model_id: str
    input_sample_rate: int
    output_sample_rate: int
    frame_samples: int

    def __call__(self, *, system_prompt: str | None, seed: int,
                 max_streaming_seconds: float) -> RealtimeSession: ...


class OnlineSessionFactory:
    """OnlineSessions over `clients` (gRPC or in-process stream clients) for the checkpoint in `model_dir`.

    By default the sessions run sequentially: the protocol sends a slice's events before it runs the next slice,
    so a one-frame slice leaves the stages nothing to overlap, and a frame costs the sum of its four stages.
    pipelined=True (`--realtime-pipelined`) overlaps the stages across slices instead: the same events in the same
    order, each sent with the append (or commit) after its frame completes, so a client gets a frame's events one
    append later, and a model that is slower than real time per frame but faster per stage keeps up.
    `text_window` bounds the sessions' text events (OnlineSession's; None: whole)."""

    def __init__(self, clients, model_dir: str | Path, *, model_id: str | None = None, pipelined: bool = False,
                 runner=None, ticker=None, text_window: int | None = None):
        from orchestrator.session import transcript_vocabulary
        from orchestrator.text import TextDecoder
        from services.common.config import VoiceChatConfig

        self.clients = clients
        self.config = VoiceChatConfig.load(model_dir)
        self.decoder = TextDecoder(model_dir, self.config)
        self.vocabulary = transcript_vocabulary(model_dir, self.config)
        self.model_id = model_id or Path(model_dir).resolve().name.lower()
        self.input_sample_rate = self.config.input_sample_rate
        self.output_sample_rate = self.config.output_sample_rate
        self.frame_samples = self.config.input_frame_samples
        self.pipelined = pipelined
        self.runner = runner  # a ToolRunner: the server's own tools, declared in every session
        self.ticker = ticker  # a FrameTicker shared with the server's other sessions (pipelined ones use it)
        self.text_window = text_window

    def __call__(self, *, system_prompt: str | None, seed: int, max_streaming_seconds: float, tools=(),
                 tool_choice: str = "auto"):
        from orchestrator.session import OnlineSession

        return OnlineSession(self.clients, self.config, self.decoder, system_prompt=system_prompt, seed=seed,
                             max_streaming_seconds=max_streaming_seconds, pipelined=self.pipelined,
                             rnnt_vocabulary=self.vocabulary, tools=list(tools), tool_choice=tool_choice,
                             runner=self.runner, ticker=self.ticker, text_window=self.text_window)


# ------------------------------------------------------------------------------------------ wire formats


def decode_pcm16(audio: Any) -> np.ndarray:
    """An append's `audio` (base64 little-endian PCM16) as float32 int16 / 32768; ValueError naming the fault.

    >>> decode_pcm16(base64.b64encode(np.array([16384, -32768], "<i2").tobytes()).decode())
    array([ 0.5, -1. ], dtype=float32)
    """
    if not isinstance(audio, str):
        raise ValueError("input_audio_buffer.append needs `audio`: a base64 string of little-endian PCM16")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("`audio` is not valid base64") from None
    if len(raw) % 2:
        raise ValueError(f"`audio` decodes to {len(raw)} bytes; PCM16 needs an even byte count")
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / PCM16_SCALE_IN


def encode_pcm16(samples: np.ndarray) -> str:
    """Float samples as base64 PCM16 of round(clip(x, -1, 1) * 32767)."""
    return base64.b64encode(to_pcm16(np.asarray(samples, np.float32), PCM16_SCALE_OUT).astype("<i2").tobytes()
                            ).decode("ascii")


def event_message(event, output_sample_rate: int) -> dict:
    """A session Event as its server event (without event_id)."""
    kind, frame = event.kind, {"frame_index": int(event.frame_index)}
    # past the session's text window the text is the cumulative one from *_start on; within it the key is left out
    start = int(event.text_start)
    if kind == "user_transcript_delta":
        return {"type": "conversation.item.input_audio_transcription.delta", **frame, "delta": event.delta,
                "transcript": event.text, **({"transcript_start": start} if start else {})}
    if kind in ("assistant_text_delta", "function_delta"):
        name = "response.text.delta" if kind == "assistant_text_delta" else "response.function.delta"
        return {"type": name, **frame, "token_id": int(event.token_id), "delta": event.delta, "text": event.text,
                **({"text_start": start} if start else {})}
    if kind == "audio":
        return {"type": "response.audio.delta", **frame, "delta": encode_pcm16(event.samples), "format": "pcm16",
                "sample_rate": output_sample_rate, "channels": 1,
                "audio_codes": [int(c) for c in event.audio_codes]}
    if kind.startswith("function_call_"):
        return function_call_message(event, frame)
    if kind == "done":
        return {"type": "response.done", **frame}
    if kind == "cancelled":
        return {"type": "response.cancelled", **frame}
    if kind == "error":
        return error_message(INFERENCE_ERROR, event.message or "the session failed")
    raise ValueError(f"no server event for session event kind {kind!r}")


def function_call_message(event, frame: dict) -> dict:
    """A tool-call event as its server event (OpenAI Realtime's names; see docs/protocol.md)."""
    kind, call = event.kind, {"call_id": event.call_id}
    if kind == "function_call_delta":
        return {"type": "response.function_call_arguments.delta", **frame, **call, "delta": event.delta}
    if kind == "function_call_done":
        return {"type": "response.function_call_arguments.done", **frame, **call, "name": event.name,
                "arguments": event.arguments}
    if kind == "function_call_output":
        return {"type": "conversation.item.created", **frame, "item": {
            "type": "function_call_output", **call, "name": event.name, "output": event.output}}
    if kind == "function_call_error":
        message = error_message(INVALID_FUNCTION_CALL, event.message)
        message["error"].update(call)
        return message
    raise ValueError(f"no server event for session event kind {kind!r}")


def tool_settings(session) -> dict:
    """What session.updated reports of a session with tools: its instructions, every tool it declares (the
    server's own included) in the OpenAI shape, and the tool choice."""
    tools = getattr(session, "declared_tools", None)
    if not tools:
        return {}
    return {"instructions": session.instructions, "tool_choice": session.tool_choice,
            "tools": [{"type": "function", **t.listing()} for t in tools]}


def error_message(code: str, message: str) -> dict:
    return {"type": "error", "error": {"code": code, "message": message}}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def session_options(payload: Any, limits: RealtimeLimits) -> dict:
    """session.update's `session` object as the factory's keyword arguments; ValueError naming the field."""
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise ValueError("session.update needs `session` to be an object")
    prompt = payload.get("system_prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError("session.system_prompt must be a string")
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("session.model must be a string")
    seed = payload.get("seed", 0)
    if seed is None:
        seed = 0
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"session.seed must be a non-negative integer, got {json.dumps(seed)}")
    seconds = payload.get("max_streaming_seconds")
    if seconds is None:
        seconds = limits.max_session_seconds
    elif not (_is_number(seconds) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"session.max_streaming_seconds must be a positive number, got {json.dumps(seconds)}")
    options = {"system_prompt": prompt, "seed": seed, "max_streaming_seconds": min(float(seconds),
                                                                                   limits.max_session_seconds)}
    return {**options, **tool_options(payload)}


def tool_options(payload: dict) -> dict:
    """`instructions` (OpenAI's name for system_prompt), `tools` and `tool_choice` of session.update, as the
    factory's keyword arguments (only those given); ValueError naming the field."""
    from orchestrator.tools import parse_tool_choice, parse_tools

    options: dict = {}
    instructions = payload.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ValueError("session.instructions must be a string")
        if payload.get("system_prompt") not in (None, instructions):
            raise ValueError("session.instructions and session.system_prompt differ; send one of them")
        options["system_prompt"] = instructions
    if payload.get("tools") is not None:
        options["tools"] = parse_tools(payload["tools"], "session.tools")
    if payload.get("tool_choice") is not None:
        options["tool_choice"] = parse_tool_choice(payload["tool_choice"], "session.tool_choice")
    return options


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ValueError) and str(exc):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _audio_format(rate: int) -> dict:
    return {"type": "pcm16", "sample_rate": rate}


# --------------------------------------------------------------------------------------------- the server


class RealtimeServer:
    """The gateway on `host:port` (0 picks a free port; `port` holds the bound one once started).

    api_key: when set, the upgrade must carry `Authorization: Bearer <key>` (the scheme in any case) or a token
        from POST /v1/realtime/sessions in its subprotocols (401 otherwise); tokens live `token_ttl_s` seconds.
    tls: serve https:// and wss:// with this certificate.
    allowed_origins: None accepts every Origin; otherwise a browser Origin not listed gets 403 ("*" allows all).
        A request without Origin is a non-browser client and is accepted.
    api_prefix: prepended to /v1/realtime (e.g. "/api" serves /api/v1/realtime); other paths get 404.
        The browser client's page is served at {api_prefix}/ (orchestrator/web/).
    metrics: where the gateway counts its sessions, frames and errors (a Metrics of its own when None); its frame
        budget becomes the factory's frame duration.
    """

    def __init__(self, factory: SessionFactory, *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, allowed_origins: Sequence[str] | None = None, api_prefix: str = "",
                 max_sessions: int = 1, limits: RealtimeLimits | None = None, metrics: Metrics | None = None,
                 token_ttl_s: float = 60.0, tls: Tls | None = None):
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty (leave it unset to accept every client)")
        self.factory = factory
        self.host = host
        self.port = port
        self.api_key = api_key
        self.allowed_origins = None if allowed_origins is None else {_normal_origin(o) for o in allowed_origins}
        self.prefix = normal_prefix(api_prefix)
        self.path = self.prefix + REALTIME_PATH
        self.tokens = EphemeralTokens(token_ttl_s)
        self.admission = Admission(max_sessions)  # upgrades are refused with 503 while draining or unavailable
        self.limits = limits or RealtimeLimits()
        self.tls = tls
        self._connections: set[_Connection] = set()
        self.metrics = metrics or Metrics("orchestrator")
        self.metrics.frame_budget_s = factory.frame_samples / factory.input_sample_rate
        self.metrics.track_sessions(lambda: self.admission.live)
        self._server: Server | None = None

    @property
    def live_sessions(self) -> int:
        """Connections holding a slot."""
        return self.admission.live

    @property
    def max_sessions(self) -> int:
        return self.admission.max_sessions

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("", "0.0.0.0", "::", "[::]") else "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{'wss' if self.tls else 'ws'}://{host}:{self.port}{self.path}"

    async def start(self) -> RealtimeServer:
        host = self.host.strip("[]") or None
        # Pings keep idle proxies from dropping the socket, but a missing pong ends nothing: a client that sends
        # audio faster than real time has its pong queued behind appends we have not read yet. Dead clients are
        # found by failed sends and the idle timeout instead.
        try:
            self._server = await serve(self._handle, host, self.port, process_request=self._check_upgrade,
                                       select_subprotocol=_select_subprotocol,
                                       max_size=self.limits.max_message_bytes, compression=None, ping_timeout=None,
                                       ssl=self.tls.ssl_context() if self.tls else None)
        except OSError as exc:
            raise bind_error(f"{self.host}:{self.port} for {self.path}", exc) from None
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("realtime gateway on %s", self.url)
        return self

    async def stop(self) -> None:
        """Stop listening, close every connection (1001) and wait until their sessions are freed."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def drain(self, grace_s: float) -> None:
        """Shutting down: refuse new connections (503), give live sessions `grace_s` seconds to end, then send
        each one left a `server_shutting_down` error, free its session and close it with 1001."""
        self.admission.drain()
        await self.admission.wait_idle(grace_s)
        message = f"the server is shutting down and its {grace_s:g} s drain period is over; the session ended"
        await asyncio.gather(*(c.shut_down(message) for c in list(self._connections)))

    async def serve_forever(self) -> None:
        if self._server is None:
            await self.start()
        await self._server.serve_forever()

    async def __aenter__(self) -> RealtimeServer:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ---------------------------------------------------------------------------------------- the upgrade

    def _check_upgrade(self, connection: ServerConnection, request: Request) -> Response | None:
        if self.admission.draining:
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE,
                                      "this server is shutting down; connect to another instance\n")
        route = urlsplit(request.path).path
        if route == self.prefix + SESSIONS_PATH:
            return self._issue_token(connection, request)
        page = web.page_name(route, self.prefix)
        if page is not None and request.method == "GET":
            return web.file_response(connection, page)
        if route != self.path:
            return connection.respond(HTTPStatus.NOT_FOUND, f"no such endpoint; the realtime socket is {self.path}\n")
        if self.admission.unavailable is not None:
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE,
                                      f"{self.admission.unavailable}; try again shortly\n")
        if self.api_key is not None and not (self._has_key(request) or self._redeems_token(request)):
            return _unauthorized(connection, "missing or wrong API key: send `Authorization: Bearer <key>`, or "
                                             f"offer a token from POST {self.prefix + SESSIONS_PATH} as the "
                                             "subprotocol openai-insecure-api-key.<token> (tokens are single-use)")
        return self._refuse_origin(connection, request)

    def _has_key(self, request: Request) -> bool:
        return bearer_matches(request.headers.get("Authorization"), self.api_key)

    def _redeems_token(self, request: Request) -> bool:
        try:
            offered = [p for value in request.headers.get_all("Sec-WebSocket-Protocol")
                       for p in parse_subprotocol(value)]
        except InvalidHeader:  # a malformed header carries no token
            return False
        token = offered_token(offered)
        return token is not None and self.tokens.redeem(token)

    def _refuse_origin(self, connection: ServerConnection, request: Request) -> Response | None:
        origin = request.headers.get("Origin")
        if origin is not None and not self._origin_allowed(origin):
            return connection.respond(HTTPStatus.FORBIDDEN, f"origin {origin} is not allowed on this server\n")
        return None

    def _issue_token(self, connection: ServerConnection, request: Request) -> Response:
        """POST /v1/realtime/sessions: a short-lived token for one upgrade, in OpenAI's client_secret shape."""
        if request.method != "POST":
            response = connection.respond(HTTPStatus.METHOD_NOT_ALLOWED, "POST here for a realtime token\n")
            response.headers["Allow"] = "POST"
            return response
        refused = self._refuse_origin(connection, request)
        if refused is not None:
            return refused
        if self.api_key is not None and not self._has_key(request):
            return _unauthorized(connection, "missing or wrong API key: send `Authorization: Bearer <key>`")
        try:
            value, expires_at = self.tokens.issue()
        except TooManyTokens as exc:
            return connection.respond(HTTPStatus.TOO_MANY_REQUESTS, f"{exc}\n")
        return web.json_response(connection, HTTPStatus.OK, {
            "object": "realtime.session", "client_secret": {"value": value, "expires_at": expires_at}})

    def _origin_allowed(self, origin: str) -> bool:
        allowed = self.allowed_origins
        return allowed is None or "*" in allowed or _normal_origin(origin) in allowed

    # ------------------------------------------------------------------------------------- a connection

    async def _handle(self, websocket: ServerConnection) -> None:
        slot = self.admission.try_admit()
        if isinstance(slot, Refusal):
            await self._refuse(_Connection(self, websocket, None), slot)
            return
        connection = _Connection(self, websocket, slot)
        self._connections.add(connection)
        log.info("realtime %s: connected (%d/%d slots)", connection.id, self.live_sessions, self.max_sessions)
        running = asyncio.ensure_future(connection.run())
        gone = asyncio.ensure_future(websocket.wait_closed())  # a client that leaves mid-append is noticed now
        try:
            await asyncio.wait({running, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not running.done():
                running.cancel()
                raise ConnectionClosed(None, None)
            running.result()
        except ConnectionClosed:
            log.info("realtime %s: the client disconnected", connection.id)
        finally:
            gone.cancel()
            self._connections.discard(connection)
            connection.release()  # at once: a client reconnecting right away must not find the server busy
            await connection.end_session()

    async def _refuse(self, connection: _Connection, refusal: Refusal) -> None:
        """A socket the admission refused: every slot taken, or a drain or a restart begun since its upgrade was
        checked. One error event, then the close."""
        if refusal.kind == SHUTTING_DOWN:
            code, message = SERVER_SHUTTING_DOWN, "this server is shutting down; connect to another instance"
            close = (CLOSE_GOING_AWAY, "server shutting down")
        else:
            busy = f"all {self.max_sessions} realtime session slot(s) are taken; try again later"
            code, close = SERVER_BUSY, (CLOSE_TRY_AGAIN, "server busy")
            message = busy if refusal.kind == BUSY else f"{refusal.detail}; try again shortly"
        try:
            await connection.error(code, message)
            await connection.websocket.close(*close)
        except ConnectionClosed:
            pass


def _unauthorized(connection: ServerConnection, message: str) -> Response:
    response = connection.respond(HTTPStatus.UNAUTHORIZED, message + "\n")
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def _select_subprotocol(protocol, offered: Sequence[str]) -> str | None:
    """"realtime" when offered (a browser that offers a token must get one subprotocol back), else none."""
    return SUBPROTOCOL if SUBPROTOCOL in offered else None


def normal_prefix(prefix: str) -> str:
    """`"api/"` -> "/api"; `""` -> ""."""
    prefix = prefix.strip().strip("/")
    return f"/{prefix}" if prefix else ""


def _normal_origin(origin: str) -> str:
    origin = origin.strip()
    return origin if origin == "*" else origin.rstrip("/").lower()


class _Connection:
    """One WebSocket's conversation: the message loop, its session and the worker thread that drives it."""

    def __init__(self, server: RealtimeServer, websocket: ServerConnection, slot: Slot | None):
        self.server = server
        self.websocket = websocket
        self.limits = server.limits
        self.factory = server.factory
        self.id = new_id("sess_")
        self.session: RealtimeSession | None = None
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.slot = slot  # None for a connection refused at once
        self.failure: str | None = None  # what closed the session, once a service failure has
        self.metrics = server.metrics
        self._intervals: collections.deque[float | None] = collections.deque()  # of audio deltas not yet sent
        self.timing = LatencyTracker(self.factory.frame_samples / self.factory.input_sample_rate,
                                     server.metrics.latency_budget_s, metrics=server.metrics)

    # ------------------------------------------------------------------------------------------ sending

    async def send(self, payload: dict) -> None:
        kind = payload["type"]
        if kind == "error" and payload["error"]["code"] != SESSION_CLOSED:  # a fault counts once
            self.metrics.error(payload["error"]["code"])
        timing = self.timing.frame() if kind == "response.audio.delta" else None  # a frame's last event goes out
        if timing is not None:  # the server's measure of the frame against a live microphone, for the client
            payload = {**payload, "latency_ms": round(timing.latency_s * 1e3, 1)}
        await self.websocket.send(json.dumps({"event_id": new_id("event_"), **payload}, separators=(",", ":")))
        if kind == "response.audio.delta":
            self.metrics.frame(self._intervals.popleft())

    async def error(self, code: str, message: str) -> None:
        await self.send(error_message(code, message))

    async def send_all(self, messages: list[dict]) -> None:
        for message in messages:
            await self.send(message)

    # ------------------------------------------------------------------------------------------- the loop

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        factory = self.factory
        await self.send({"type": "session.created", "session": {
            "id": self.id, "state": "configuring",
            "input_audio_format": _audio_format(factory.input_sample_rate),
            "output_audio_format": _audio_format(factory.output_sample_rate)}})
        update_deadline = loop.time() + self.limits.update_timeout_s
        while True:
            if self.session is None:
                timeout = update_deadline - loop.time()
                reason = f"no session.update within {self.limits.update_timeout_s:g} s of connecting"
            else:
                timeout = self.limits.idle_timeout_s
                reason = f"no client message for {self.limits.idle_timeout_s:g} s"
            try:
                frame = await asyncio.wait_for(self.websocket.recv(), max(timeout, 0.0))
            except TimeoutError:
                await self.error(INVALID_REQUEST, f"{reason}; closing")
                await self.finish(CLOSE_POLICY, "session.update timeout" if self.session is None else "idle")
                return
            message = _parse(frame)
            if isinstance(message, str):
                await self.error(INVALID_REQUEST, message)
                continue
            if await self.dispatch(message):
                return

    async def dispatch(self, message: dict) -> bool:
        """Handle one client message; True when the conversation is over (the socket is closed)."""
        kind = message.get("type")
        if kind == "session.ping":
            await self.send({"type": "session.pong"})
        elif kind == "session.update":
            if self.session is not None:
                await self.error(INVALID_REQUEST, "this session is already configured; a connection takes one "
                                                  "session.update (open a new connection for new settings: "
                                                  "instructions and tools cannot change inside a live session)")
            else:
                await self.configure(message.get("session"))
        elif self.session is None:
            await self.error(INVALID_REQUEST, "send session.update before audio")
        elif kind == "input_audio_buffer.append":
            await self.append(message)
        elif kind == "input_audio_buffer.commit":
            return await self.commit(message)
        elif kind == "conversation.item.create":
            await self.create_item(message.get("item"))
        elif kind in ("session.cancel", "response.cancel"):
            await self.cancel()
            return True
        else:
            await self.error(INVALID_REQUEST, f"unknown message type {json.dumps(kind)}")
        return False

    async def configure(self, payload: Any) -> None:
        try:
            options = session_options(payload, self.limits)
        except ValueError as exc:
            await self.error(SESSION_INITIALIZATION_FAILED, str(exc))
            return
        try:
            self.session = await self._call(lambda: self.factory(**options))
        except Exception as exc:  # noqa: BLE001 - any failure to open leaves the connection open for a retry
            log.info("realtime %s: session.update failed: %s", self.id, exc)
            await self.error(SESSION_INITIALIZATION_FAILED, _describe(exc))
            return
        factory = self.factory
        await self.send({"type": "session.updated", "session": {
            "id": self.id, "state": "ready", "model": factory.model_id, "frame_samples": factory.frame_samples,
            "input_audio_format": _audio_format(factory.input_sample_rate),
            "output_audio_format": _audio_format(factory.output_sample_rate), **tool_settings(self.session)}})

    async def append(self, message: dict) -> None:
        """Push the append's audio; after a failure that closed the session, audio is dropped (the client was told
        once, with SESSION_CLOSED)."""
        if self.failure is not None:
            return
        try:
            samples = decode_pcm16(message.get("audio"))
            rate = message.get("sample_rate", self.factory.input_sample_rate)
            if not isinstance(rate, int) or isinstance(rate, bool):
                raise ValueError(f"sample_rate must be an integer number of Hz, got {json.dumps(rate)}")
        except ValueError as exc:
            await self.error(INFERENCE_ERROR, str(exc))
            return
        self.timing.start()
        n = self.factory.frame_samples
        for start in range(0, max(len(samples), 1), n):  # an empty append still reaches the rate check
            try:
                messages = await self._run(self._push, samples[start : start + n], rate)
            except Exception as exc:  # noqa: BLE001 - the loop goes on; the append stops at this slice
                log.info("realtime %s: append failed: %s", self.id, _describe(exc))
                await self.error(INFERENCE_ERROR, _describe(exc))
                if self.session.closed:  # a service failed: the session is over, not just this append
                    self.failure = _describe(exc)
                    await self.error(SESSION_CLOSED, f"this session is closed because of the error above "
                                                     f"({self.failure}); commit to end it, then open a new connection")
                return
            await self.send_all(messages)

    def _push(self, samples: np.ndarray, rate: int) -> list:
        """One slice into the session (on the worker). A pipelined session queues its frames without running them,
        so this then waits while more than MAX_FRAMES_AHEAD of them are in the stages: a client that sends audio
        ahead of real time is read no faster than the session runs, and what it sent waits in its socket, not
        here (a sequential session has run the slice's frames already: no wait)."""
        from orchestrator.session import MAX_FRAMES_AHEAD

        return self.session.push_audio(samples, rate) + self.session.wait_behind(MAX_FRAMES_AHEAD)

    async def create_item(self, item: Any) -> None:
        """A function_call_output: queued for the function channel; conversation.item.created confirms it."""
        if not isinstance(item, dict) or item.get("type") != "function_call_output":
            await self.error(INVALID_REQUEST, "conversation.item.create takes an `item` of type "
                                              "\"function_call_output\" {type, call_id, output}; audio goes through "
                                              "input_audio_buffer.append")
            return
        try:
            messages = await self._run(self.session.submit_function_output, item.get("call_id"), item.get("output"))
        except ValueError as exc:
            await self.error(INVALID_REQUEST, str(exc))
            return
        await self.send_all(messages)

    async def commit(self, message: dict) -> bool:
        pad = message.get("pad_partial", True)
        if not isinstance(pad, bool):
            await self.error(INVALID_REQUEST, f"pad_partial must be true or false, got {json.dumps(pad)}")
            return False
        await self.send({"type": "input_audio_buffer.committed"})
        try:
            messages = await self._run(self._flush, pad)
        except Exception as exc:  # noqa: BLE001 - the commit ends the conversation either way
            log.warning("realtime %s: flush failed: %s", self.id, _describe(exc))
            await self.error(INFERENCE_ERROR, _describe(exc))
            await self.finish(CLOSE_INTERNAL, "flush failed")
            return True
        await self.send_all(messages)
        await self.finish(CLOSE_NORMAL, "committed")
        return True

    async def cancel(self) -> None:
        messages = await self._run(self._cancel)
        await self.send_all(messages)
        await self.finish(CLOSE_NORMAL, "cancelled")

    def _flush(self, pad: bool) -> list:
        from orchestrator.session import ContextLimitError

        session = self.session
        try:
            events = session.flush(pad)
        except ContextLimitError:  # the partial frame is past the limit: end without it
            events = session.flush(False)
        return self._terminated(events, "done")

    def _cancel(self) -> list:
        return self._terminated(self.session.cancel(), "cancelled")

    def _terminated(self, events: list, kind: str) -> list:
        """The events, ending with `kind` even when an earlier failure had already closed the session."""
        if not any(e.kind == kind for e in events):
            from orchestrator.session import Event

            events = [*events, Event(kind, int(getattr(self.session, "frame_index", 0)))]
        return events

    # -------------------------------------------------------------------------------------- the worker

    async def _call(self, fn: Callable, *args):
        """fn(*args) on this connection's worker thread (one call at a time, in order)."""
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                 thread_name_prefix=f"realtime-{self.id}")
        return await asyncio.wrap_future(self._worker.submit(fn, *args))

    async def _run(self, method: Callable, *args) -> list[dict]:
        """A session call on the worker; its events come back already serialized (base64 audio included)."""
        rate = self.factory.output_sample_rate
        return await self._call(lambda: self._serialize(method(*args), rate))

    def _serialize(self, events: list, rate: int) -> list[dict]:
        """The events as server messages; each audio frame's interval waits in `_intervals` for its send."""
        messages = [event_message(e, rate) for e in events]
        self._intervals.extend(e.interval_s for e in events if e.kind == "audio")
        return messages

    # ---------------------------------------------------------------------------------------- the end

    async def finish(self, code: int, reason: str) -> None:
        """Free the slot and the session, then send the close frame."""
        self.release()
        await self.end_session()
        await self.websocket.close(code, reason)

    async def shut_down(self, message: str) -> None:
        """The server is going away: say so, free the session and close with 1001."""
        try:
            await self.error(SERVER_SHUTTING_DOWN, message)
            await self.finish(CLOSE_GOING_AWAY, "server shutting down")
        except ConnectionClosed:
            self.release()
            await self.end_session()

    async def end_session(self) -> None:
        """Close the session (a no-op after flush or cancel; frees every service's state otherwise)."""
        session, self.session = self.session, None
        worker, self._worker = self._worker, None
        if worker is None:
            return
        try:
            if session is not None:
                # queued behind any call still running; shutdown(wait=False) below does not drop it
                await asyncio.wrap_future(worker.submit(session.close))
        except Exception:  # noqa: BLE001 - a service already gone
            log.exception("realtime %s: closing the session failed", self.id)
        finally:
            worker.shutdown(wait=False)

    def release(self) -> None:
        if self.slot is not None and self.slot.release():
            self.timing.close()
            log.info("realtime %s: slot released", self.id)


def _parse(frame: str | bytes) -> dict | str:
    """A client frame as a JSON object, or the invalid_request message saying why it is not one."""
    if isinstance(frame, bytes):
        return "binary frames are not part of this protocol; send JSON text frames"
    try:
        message = json.loads(frame)
    except ValueError:
        return "the frame is not valid JSON; every client message is a JSON object"
    except RecursionError:  # nesting deeper than the interpreter's recursion limit
        return "the frame's JSON nests too deeply to parse; every client message is a JSON object"
    if not isinstance(message, dict):
        return f"a client message must be a JSON object, got {type(message).__name__}"
    return message


# ------------------------------------------------------------------------------------------- standalone


def build_parser() -> argparse.ArgumentParser:
    from orchestrator.connect import add_connection_flags, add_failover_flags
    from orchestrator.text import add_text_window_flag

    parser = argparse.ArgumentParser(prog="python -m orchestrator.realtime",
                                     description="Serve /v1/realtime alone (orchestrator serve runs it too).")
    add_connection_flags(parser)
    add_failover_flags(parser)
    parser.add_argument("--alias", default=None, help="model id session.updated reports (default: folder name)")
    add_realtime_flags(parser, port_flag="--port")
    add_text_window_flag(parser)
    parser.add_argument("--drain-seconds", type=float, default=5.0,
                        help="on SIGTERM: new connections are refused and live sessions get this many seconds, then "
                             "end with server_shutting_down (default 5)")
    add_metrics_flags(parser)
    add_budget_flag(parser)
    return parser


def add_realtime_flags(parser: argparse.ArgumentParser, *, port_flag: str = "--realtime-port") -> None:
    """The gateway's flags (for `orchestrator serve` and the standalone entry point)."""
    parser.add_argument(port_flag, dest="realtime_port", type=int, default=8080,
                        help="WebSocket port for /v1/realtime; 0 picks a free one (default 8080)")
    parser.add_argument("--realtime-host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on the WebSocket upgrade and, under `serve`, as "
                             "gRPC metadata on every Converse call")
    add_tls_flags(parser)
    parser.add_argument("--allowed-origins", default=None,
                        help="comma-separated browser origins allowed to connect (default: any; '*' = any)")
    parser.add_argument("--api-prefix", default="", help="path prefix, e.g. /api serves /api/v1/realtime")
    parser.add_argument("--realtime-pipelined", action="store_true",
                        help="overlap the four stages across appends; a frame's events go out one append later")
    parser.add_argument("--realtime-max-sessions", type=int, default=1,
                        help="concurrent realtime sessions (default 1, as the spec); server_busy past it")
    parser.add_argument("--max-message-bytes", type=int, default=MIB, help="largest client message (1 MiB)")
    parser.add_argument("--max-session-seconds", type=float, default=600.0,
                        help="audio per realtime session; session.max_streaming_seconds is clamped to it (600)")
    parser.add_argument("--session-update-timeout", type=float, default=30.0,
                        help="seconds a connection has to send session.update (30)")
    parser.add_argument("--idle-timeout", type=float, default=120.0,
                        help="seconds a configured session may stay silent before close 1008 (120)")


def server_from_args(args: argparse.Namespace, factory: SessionFactory,
                     metrics: Metrics | None = None) -> RealtimeServer:
    """A RealtimeServer configured by `add_realtime_flags`' flags, counting in `metrics`; ValueError naming a bad
    value."""
    if not 0 <= args.realtime_port <= 65535:
        raise ValueError(f"realtime port {args.realtime_port}: must be 0..65535")
    origins = None
    if args.allowed_origins is not None:
        origins = [o for o in (p.strip() for p in args.allowed_origins.split(",")) if o]
    limits = RealtimeLimits(max_message_bytes=args.max_message_bytes, max_session_seconds=args.max_session_seconds,
                            update_timeout_s=args.session_update_timeout, idle_timeout_s=args.idle_timeout)
    return RealtimeServer(factory, host=args.realtime_host, port=args.realtime_port, api_key=args.api_key,
                          allowed_origins=origins, api_prefix=args.api_prefix,
                          max_sessions=args.realtime_max_sessions, limits=limits, metrics=metrics,
                          tls=load_tls(args.tls_cert, args.tls_key))


def main(argv: Sequence[str] | None = None) -> int:
    from orchestrator.connect import connection_from_args
    from orchestrator.model import resolve_model
    from orchestrator.stream_clients import connect_streams
    from orchestrator.text import text_window_from_args

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics = Metrics("orchestrator", latency_budget_s=args.latency_budget_s)
    exposition = None
    try:
        connection = connection_from_args(args)
        text_window = text_window_from_args(args)
        model = resolve_model(args.model)
        exposition = start_from_args(metrics, args)  # a busy port fails before any service
        with connect_streams(model, **connection) as clients:
            factory = OnlineSessionFactory(clients, model, model_id=args.alias, pipelined=args.realtime_pipelined,
                                           text_window=text_window)
            server = server_from_args(args, factory, metrics)

            async def run() -> None:
                stop = asyncio.Event()
                for signum in (signal.SIGINT, signal.SIGTERM):
                    asyncio.get_running_loop().add_signal_handler(signum, stop.set)
                async with server:
                    print(f"realtime on {server.url}", flush=True)
                    if exposition is not None:
                        announce_metrics(exposition)
                    await stop.wait()
                    await server.drain(args.drain_seconds)

            asyncio.run(run())
    except KeyboardInterrupt:
        return 0
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BIND if isinstance(exc, BindError) else 1
    finally:
        if exposition is not None:
            exposition.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
