"""The browser client's static files, served by the realtime gateway beside its socket.

    GET {prefix}/                       index.html (the page opens ws(s)://HOST{prefix}/v1/realtime)
    GET {prefix}/app.js, style.css, capture-worklet.js, playback-worklet.js

Only the files listed in FILES are served (no directory walk, so no path escapes the package); each response says
its type and `no-cache`, so a browser picks up a new release on reload.
"""

from __future__ import annotations

import json
from functools import cache
from http import HTTPStatus
from importlib import resources

from websockets.http11 import Response

INDEX = "index.html"
FILES = {
    INDEX: "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "capture-worklet.js": "text/javascript; charset=utf-8",
    "playback-worklet.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# The page loads only its own files and talks only to its own host (ws/wss: 'self' covers them in CSP 3).
SECURITY_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
}


@cache
def file_bytes(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


def page_name(path: str, prefix: str) -> str | None:
    """The file a request path names under `prefix` (`{prefix}/` is the index), or None when it names none.

    >>> page_name("/api/app.js", "/api"), page_name("/", ""), page_name("/etc/passwd", "")
    ('app.js', 'index.html', None)
    """
    if not path.startswith(prefix + "/"):
        return None
    name = path[len(prefix) + 1:] or INDEX
    return name if name in FILES else None


def with_body(response: Response, body: bytes, content_type: str) -> Response:
    """`response` (from connection.respond) carrying `body` as `content_type`."""
    response.body = body
    for name, value in {"Content-Type": content_type, "Content-Length": str(len(body))}.items():
        del response.headers[name]
        response.headers[name] = value
    return response


def file_response(connection, name: str) -> Response:
    response = with_body(connection.respond(HTTPStatus.OK, ""), file_bytes(name), FILES[name])
    for header, value in SECURITY_HEADERS.items():
        response.headers[header] = value
    return response


def json_response(connection, status: HTTPStatus, payload: dict) -> Response:
    body = (json.dumps(payload, separators=(",", ":")) + "\n").encode()
    response = with_body(connection.respond(status, ""), body, "application/json")
    response.headers["Cache-Control"] = "no-store"  # a token must not sit in any cache
    return response
