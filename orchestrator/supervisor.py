"""Keeping the services `orchestrator serve` started alive.

A service process that dies is logged (which one, its pid, its exit code or signal) and started again on the
port it had, so the orchestrator's channels to that address reconnect by themselves; a restart that fails is
tried again after a delay that doubles each time (INITIAL_BACKOFF_S .. MAX_BACKOFF_S). While any service is down
the front doors report NOT_SERVING and refuse new conversations; once every service serves again and the
orchestrator's channel to it has reconnected, they report SERVING.

    supervisor = Supervisor(children, connected=wait_for_channel)   # connected(name): awaits the channel
    task = asyncio.ensure_future(supervisor.run(on_change))         # on_change(reason) / on_change(None)
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable

from orchestrator.launcher import READY_TIMEOUT_S, ServiceProcess
from services.common.errors import EXIT_BIND, EXIT_DEVICE_LOST

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the children are looked at
INITIAL_BACKOFF_S = 0.5  # before the first restart of a service that had run a while
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a service that ran this long before it died starts its backoff over


_EXIT_MEANINGS = {EXIT_BIND: "its port is in use", EXIT_DEVICE_LOST: "its device failed"}


def describe_exit(code: int) -> str:
    """A Popen return code in words: `-9` -> "killed by SIGKILL", `1` -> "exited with code 1", `3` -> "exited
    with code 3 (its device failed)" for the codes a service gives a meaning (services.common.errors)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    meaning = _EXIT_MEANINGS.get(code)
    return f"exited with code {code}" + (f" ({meaning})" if meaning else "")


class Supervisor:
    """Watches `children` (the processes `launched` started) and restarts each one that dies."""

    def __init__(self, children: list[ServiceProcess], *,
                 connected: Callable[[str], Awaitable[None]] | None = None,
                 initial_backoff_s: float = INITIAL_BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S,
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.children = children
        self.connected = connected
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.ready_timeout_s = ready_timeout_s
        self.restarts = 0  # services started again, for the log and tests
        self._started = {id(child): time.monotonic() for child in children}
        self._crashes = {id(child): 0 for child in children}  # consecutive short lives

    async def run(self, on_change: Callable[[str | None], Awaitable[None]]) -> None:
        """Supervise until cancelled: on_change(reason) when a service dies, on_change(None) when all serve."""
        while True:
            dead = self._dead()
            if dead:
                await on_change(f"the {', '.join(sorted({c.name for c in dead}))} service is restarting "
                                f"({'; '.join(self._death(c) for c in dead)})")
                while dead:
                    for child in dead:
                        await self._restart(child)
                    dead = self._dead()
                    for child in dead:
                        self._death(child)
                await on_change(None)
            await asyncio.sleep(POLL_S)

    def _dead(self) -> list[ServiceProcess]:
        return [child for child in self.children if child.process.poll() is not None]

    def _death(self, child: ServiceProcess) -> str:
        """Log a child's death; the words for it."""
        how = describe_exit(child.process.returncode)
        lived = time.monotonic() - self._started[id(child)]
        self._crashes[id(child)] = 0 if lived >= STABLE_S else self._crashes[id(child)] + 1
        log.warning("the %s service (pid %d, %s) died: %s after %.0f s; restarting it", child.name,
                    child.process.pid, child.address or "not yet serving", how, lived)
        return f"{child.name} {how}"

    async def _restart(self, child: ServiceProcess) -> None:
        """Start `child` again until it serves, waiting longer after each failed try."""
        while True:
            await asyncio.sleep(self._backoff(child))
            child.restart()
            self._started[id(child)] = time.monotonic()
            if await self._serving(child):
                break
            self._crashes[id(child)] += 1
            what = (describe_exit(child.process.returncode) if child.process.poll() is not None
                    else f"not serving within {self.ready_timeout_s:.0f} s")
            log.warning("the %s service did not start again (%s: %s); next try in %.1f s", child.name, what,
                        child.tail(1) or "no output", self._backoff(child))
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
        if self.connected is not None:
            await self.connected(child.name)
        self.restarts += 1
        log.warning("the %s service serves again on %s (pid %d)", child.name, child.address, child.process.pid)

    def _backoff(self, child: ServiceProcess) -> float:
        """Seconds before the next start: INITIAL_BACKOFF_S after a long life, doubling with each short one."""
        return min(self.initial_backoff_s * 2 ** max(self._crashes[id(child)] - 1, 0), self.max_backoff_s)

    async def _serving(self, child: ServiceProcess) -> bool:
        """Whether the restarted child printed its ready line (it serves) before it exited or timed out."""
        deadline = time.monotonic() + self.ready_timeout_s
        while not child.address:
            if child.process.poll() is not None or time.monotonic() > deadline:
                await asyncio.sleep(0.05)  # the stderr reader catches the last lines
                return False
            await asyncio.sleep(0.05)
        return True
