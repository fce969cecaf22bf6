"""Who may start a conversation: the slots and the refusals shared by both front doors.

    >>> admission = Admission(max_sessions=1)
    >>> slot = admission.try_admit()   # a Slot, or a Refusal: SHUTTING_DOWN, UNAVAILABLE (detail: why) or BUSY
    >>> admission.try_admit(), admission.live
    (Refusal(kind='busy', detail=None), 1)
    >>> slot.release(), slot.release(), admission.live   # once the conversation ends; again is a no-op
    (True, False, 0)
    >>> admission.drain(); admission.try_admit()
    Refusal(kind='shutting_down', detail=None)

A drain then awaits `admission.wait_idle(grace_s)`: True once every slot is free, False at the timeout.

The gRPC conversation service and the realtime gateway each hold one (their own `max_sessions`) and word the
refusals their clients see themselves. `drain()` refuses from then on; `unavailable` names why new conversations
are refused while a supervisor restarts a service (None once every service serves again). `live` is the count the
voicechat_active_sessions gauge reads.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

SHUTTING_DOWN = "shutting_down"
UNAVAILABLE = "unavailable"
BUSY = "busy"


@dataclass(frozen=True)
class Refusal:
    """Why a conversation was not admitted: `kind` is SHUTTING_DOWN, UNAVAILABLE or BUSY; `detail` is the
    supervisor's reason for UNAVAILABLE."""

    kind: str
    detail: str | None = None


class Slot:
    """One admitted conversation's place; `release` frees it once (True the first time, False after)."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> bool:
        with self._admission._lock:
            if not self._held:
                return False
            self._held = False
            self._admission._live -= 1
            return True


class Admission:
    """At most `max_sessions` conversations at once; none once draining or while a service is unavailable."""

    def __init__(self, max_sessions: int):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.draining = False  # set by drain(): every new conversation is refused from then on
        self.unavailable: str | None = None  # why new conversations are refused while a service restarts
        self._live = 0
        self._lock = threading.Lock()  # slots are taken on the event loop but may be released from any thread

    @property
    def live(self) -> int:
        """Conversations holding a slot."""
        return self._live

    def refusal(self) -> Refusal | None:
        """Why a new conversation would be refused now, capacity aside (SHUTTING_DOWN, then UNAVAILABLE)."""
        if self.draining:
            return Refusal(SHUTTING_DOWN)
        if self.unavailable is not None:
            return Refusal(UNAVAILABLE, self.unavailable)
        return None

    def try_admit(self) -> Slot | Refusal:
        """A slot, or the first reason to refuse: shutting down, a service unavailable, every slot taken."""
        with self._lock:
            refused = self.refusal()
            if refused is not None:
                return refused
            if self._live >= self.max_sessions:
                return Refusal(BUSY)
            self._live += 1
            return Slot(self)

    def drain(self) -> None:
        """Refuse every new conversation from now on (the slots held stay until released)."""
        self.draining = True

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait until no slot is held: True when none is, False when `timeout_s` passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._live:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True
