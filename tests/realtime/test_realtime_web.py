"""The gateway's HTTP side for the browser client: the page's files at {prefix}/, and the single-use tokens of
POST /v1/realtime/sessions that open the socket on a server with --api-key (orchestrator/tokens.py)."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from importlib import resources
from urllib.parse import urlsplit

import pytest
from websockets.exceptions import InvalidStatus

from orchestrator.tokens import EphemeralTokens, TooManyTokens, offered_token
from tests.realtime.fakes import Client, serve

KEY = "sekret"


def http_request(url: str, method: str, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """One request to the server behind `url` (the raw path, unnormalized); its status, headers and body."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


async def request(server, method: str, path: str, **headers) -> tuple[int, dict, bytes]:
    return await asyncio.to_thread(http_request, server.url, method, path, headers)


async def token_for(server, **headers) -> str:
    status, _, body = await request(server, "POST", "/v1/realtime/sessions", **headers)
    assert status == 200, body
    return json.loads(body)["client_secret"]["value"]


async def upgrade(server, subprotocols, **kwargs):
    """The upgrade's status with these subprotocols offered, and the subprotocol the server chose."""
    try:
        client = await Client.open(server.url, subprotocols=subprotocols, **kwargs)
    except InvalidStatus as exc:
        return exc.response.status_code, None
    chosen = client.ws.subprotocol
    await client.recv()
    await client.close()
    return 101, chosen


def web_file(name: str) -> bytes:
    return resources.files("orchestrator.web").joinpath(name).read_bytes()


# -------------------------------------------------------------------------------------------- the page


def test_the_page_and_its_files_are_served_at_the_root_and_nothing_else_is():
    async def scenario(server):
        return {path: await request(server, "GET", path) for path in (
            "/", "/index.html", "/app.js", "/style.css", "/capture-worklet.js", "/playback-worklet.js",
            "/nope.js", "/../pyproject.toml", "/web/app.js", "/__init__.py")}

    got = serve(scenario)
    assert got["/"][2] == got["/index.html"][2] == web_file("index.html")
    assert got["/"][1]["Content-Type"] == "text/html; charset=utf-8"
    assert got["/app.js"][1]["Content-Type"] == "text/javascript; charset=utf-8"
    assert got["/style.css"][1]["Content-Type"] == "text/css; charset=utf-8"
    for name in ("app.js", "style.css", "capture-worklet.js", "playback-worklet.js"):
        status, headers, body = got[f"/{name}"]
        assert (status, body, int(headers["Content-Length"])) == (200, web_file(name), len(body))
        assert headers["X-Content-Type-Options"] == "nosniff" and headers["Cache-Control"] == "no-cache"
        assert headers["Content-Security-Policy"].startswith("default-src 'self'")
    for path in ("/nope.js", "/../pyproject.toml", "/web/app.js", "/__init__.py"):
        assert got[path][0] == 404, path


def test_the_page_moves_with_the_api_prefix():
    async def scenario(server):
        return [(await request(server, "GET", path))[0] for path in ("/api/", "/api/app.js", "/", "/app.js")]

    assert serve(scenario, api_prefix="/api") == [200, 200, 404, 404]


def test_the_page_is_served_to_any_origin_and_only_on_get():
    async def scenario(server):
        return [(await request(server, "GET", "/", Origin="https://evil.example"))[0],
                (await request(server, "POST", "/app.js"))[0]]

    # the socket and the tokens are what the origin list guards; a POST to a page is not a page
    assert serve(scenario, allowed_origins=["https://app.example"]) == [200, 404]


# ------------------------------------------------------------------------------------------- the tokens


def test_a_token_in_openai_shape_opens_one_upgrade_then_is_spent():
    async def scenario(server):
        before = time.time()
        status, headers, body = await request(server, "POST", "/v1/realtime/sessions", Authorization=f"Bearer {KEY}")
        session = json.loads(body)
        token = session["client_secret"]["value"]
        offered = ["realtime", f"openai-insecure-api-key.{token}"]
        return (status, headers, session, before, await upgrade(server, offered), await upgrade(server, offered),
                await upgrade(server, ["realtime", "openai-insecure-api-key.ek_never_issued"]),
                await upgrade(server, ["realtime"]))

    status, headers, session, before, first, again, unknown, none = serve(scenario, api_key=KEY, token_ttl_s=60)
    assert status == 200 and headers["Content-Type"] == "application/json" and headers["Cache-Control"] == "no-store"
    assert session["object"] == "realtime.session" and session["client_secret"]["value"].startswith("ek_")
    assert int(before) + 59 <= session["client_secret"]["expires_at"] <= time.time() + 60
    assert first == (101, "realtime")
    assert again == unknown == none == (401, None)


def test_an_expired_token_is_refused():
    async def scenario(server):
        now = [1000.0]
        server.tokens.clock = lambda: now[0]
        tokens = [await token_for(server, Authorization=f"Bearer {KEY}") for _ in range(2)]
        now[0] = 1000.0 + 30 - 1e-3
        before = await upgrade(server, ["realtime", f"openai-insecure-api-key.{tokens[0]}"])
        now[0] = 1000.0 + 30
        at = await upgrade(server, ["realtime", f"openai-insecure-api-key.{tokens[1]}"])
        return before, at

    assert serve(scenario, api_key=KEY, token_ttl_s=30) == ((101, "realtime"), (401, None))


def test_tokens_need_the_key_a_post_and_an_allowed_origin():
    async def scenario(server):
        statuses = [(await request(server, method, "/v1/realtime/sessions", **headers))[0] for method, headers in (
            ("POST", {}), ("POST", {"Authorization": "Bearer wrong"}), ("POST", {"Authorization": KEY}),
            ("GET", {"Authorization": f"Bearer {KEY}"}),
            ("POST", {"Authorization": f"Bearer {KEY}", "Origin": "https://evil.example"}),
            ("POST", {"Authorization": f"Bearer {KEY}", "Origin": "https://app.example"}))]
        _, headers, _ = await request(server, "GET", "/v1/realtime/sessions")
        return statuses, headers["Allow"]

    assert serve(scenario, api_key=KEY, allowed_origins=["https://app.example"]) == (
        [401, 401, 401, 405, 403, 200], "POST")


def test_a_token_does_not_pass_the_origin_check_and_the_key_still_works_alone():
    async def scenario(server):
        token = await token_for(server, Authorization=f"Bearer {KEY}")
        offered = ["realtime", f"openai-insecure-api-key.{token}"]
        return [await upgrade(server, offered, origin="https://evil.example"),
                await upgrade(server, None, additional_headers={"Authorization": f"Bearer {KEY}"},
                              origin="https://app.example")]

    assert serve(scenario, api_key=KEY, allowed_origins=["https://app.example"]) == [(403, None), (101, None)]


def test_a_malformed_subprotocol_header_is_401_not_a_server_error():
    async def scenario(server):
        status, _, body = await request(server, "GET", "/v1/realtime", Connection="Upgrade", Upgrade="websocket",
                                        **{"Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                                           "Sec-WebSocket-Version": "13", "Sec-WebSocket-Protocol": "realtime,,@"})
        return status, body

    status, body = serve(scenario, api_key=KEY)
    assert status == 401 and b"single-use" in body


def test_without_a_key_tokens_are_issued_and_the_socket_is_open_to_all():
    async def scenario(server):
        token = await token_for(server)
        return [await upgrade(server, ["realtime", f"openai-insecure-api-key.{token}"]),
                await upgrade(server, ["realtime", "openai-insecure-api-key.anything"]), await upgrade(server, None)]

    assert serve(scenario) == [(101, "realtime"), (101, "realtime"), (101, None)]


def test_ephemeral_tokens_expire_are_single_use_and_bounded():
    now = [100.0]
    tokens = EphemeralTokens(10.0, max_live=2, clock=lambda: now[0])
    (a, a_expiry), (b, _) = tokens.issue(), tokens.issue()
    assert a != b and a_expiry == 110
    with pytest.raises(TooManyTokens, match="2 tokens are live"):
        tokens.issue()
    assert tokens.redeem(a) and not tokens.redeem(a)
    tokens.issue()  # a's slot is free again
    now[0] = 110.0
    assert not tokens.redeem(b)  # expired at expires_at exactly
    tokens.issue(), tokens.issue()  # the expired ones are forgotten
    assert not tokens.redeem("") and not tokens.redeem("ek_x")
    with pytest.raises(ValueError, match="positive"):
        EphemeralTokens(0)


def test_offered_token_reads_the_subprotocol():
    assert offered_token(["realtime", "openai-insecure-api-key.ek_a"]) == "ek_a"
    assert offered_token(["realtime"]) is None and offered_token([]) is None
