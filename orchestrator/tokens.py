"""Short-lived, single-use tokens that let a browser open /v1/realtime on a server with --api-key.

Browsers cannot set `Authorization` on a WebSocket, so the page trades the key for a token first (OpenAI's
ephemeral-key shape), then offers it as a WebSocket subprotocol beside "realtime":

    POST /v1/realtime/sessions  (Authorization: Bearer KEY, no body)
        -> 200 {"object": "realtime.session", "client_secret": {"value": "ek_…", "expires_at": 1767225600}}
    new WebSocket(url, ["realtime", "openai-insecure-api-key.ek_…"])     // the server answers "realtime"

A token opens one upgrade: the first upgrade that presents it spends it, and it is refused after `expires_at`
(Unix seconds) either way.

    tokens = EphemeralTokens(ttl_s=60)
    value, expires_at = tokens.issue()
    tokens.redeem(value)   # True once; False after that, after expiry, or for a value never issued
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable, Iterable

TOKEN_PREFIX = "ek_"
SUBPROTOCOL = "realtime"  # the subprotocol the server selects; a browser needs one echoed when it offers any
TOKEN_SUBPROTOCOL = "openai-insecure-api-key."  # + token, as OpenAI's browser SDK offers its key


class TooManyTokens(RuntimeError):
    """Every live-token slot holds an unspent, unexpired token."""


class EphemeralTokens:
    """The tokens issued and not yet spent or expired, at most `max_live` of them.

    clock: Unix seconds (time.time unless given), the scale of `expires_at`."""

    def __init__(self, ttl_s: float = 60.0, *, max_live: int = 1024, clock: Callable[[], float] = time.time):
        if not ttl_s > 0:
            raise ValueError(f"token lifetime must be positive, got {ttl_s!r} s")
        self.ttl_s = ttl_s
        self.max_live = max_live
        self.clock = clock
        self._expiry: dict[str, float] = {}

    def issue(self) -> tuple[str, int]:
        """A new token and its expiry (whole Unix seconds, rounded down so a client never waits past it)."""
        now = self.clock()
        self._forget_expired(now)
        if len(self._expiry) >= self.max_live:
            raise TooManyTokens(f"{self.max_live} tokens are live and unspent; use one or wait "
                                f"{self.ttl_s:g} s for them to expire")
        value = TOKEN_PREFIX + secrets.token_urlsafe(24)  # URL-safe base64 is a valid subprotocol token
        expires_at = now + self.ttl_s
        self._expiry[value] = expires_at
        return value, int(expires_at)

    def redeem(self, value: str) -> bool:
        """True when `value` is a live token, which is then spent; False otherwise."""
        # Compare every live token in constant time: a dict lookup would leak how long a guessed prefix matched.
        match = next((t for t in list(self._expiry) if hmac.compare_digest(t.encode(), value.encode())), None)
        if match is None:
            return False
        expires_at = self._expiry.pop(match)
        return self.clock() < expires_at

    def _forget_expired(self, now: float) -> None:
        for value in [t for t, expiry in self._expiry.items() if expiry <= now]:
            del self._expiry[value]


def offered_token(subprotocols: Iterable[str]) -> str | None:
    """The token in the subprotocols a client offered, if any.

    >>> offered_token(["realtime", "openai-insecure-api-key.ek_abc"])
    'ek_abc'
    """
    for protocol in subprotocols:
        if protocol.startswith(TOKEN_SUBPROTOCOL):
            return protocol[len(TOKEN_SUBPROTOCOL):]
    return None
