"""Where the four networks run: started here as child processes (the default), already running elsewhere
(`--services`), or inside this process (`--in-process`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from orchestrator.clients import ServiceError, close_clients, grpc_clients, local_clients
from orchestrator.launcher import SERVICES, LaunchError, launched
from orchestrator.timeline import Clients

__all__ = ["ServiceError", "connect", "parse_services"]


def parse_services(text: str) -> dict[str, str]:
    """`perception=HOST:PORT,llm=HOST:PORT,tts=HOST:PORT,codec=HOST:PORT` -> name -> address."""
    addresses: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, address = part.partition("=")
        if not sep or name not in SERVICES or ":" not in address:
            raise ValueError(
                f"--services entry {part!r}: expected NAME=HOST:PORT with NAME one of {', '.join(SERVICES)}"
            )
        addresses[name] = address
    missing = [name for name in SERVICES if name not in addresses]
    if missing:
        raise ValueError(f"--services is missing {', '.join(missing)}; give all four as NAME=HOST:PORT")
    return addresses


@contextlib.contextmanager
def serving(model: Path, services: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """The four services' addresses: the ones given, or children started here (from the main thread) and
    stopped on exit. A client failure while a child has died names that child."""
    if services:
        yield services
        return
    try:
        with launched(model) as children:
            try:
                yield {name: child.address for name, child in children.items()}
            except ServiceError as exc:
                dead = [c.name for c in children.values() if c.process.poll() is not None]
                if dead:
                    raise ServiceError(f"{exc} (the {', '.join(dead)} service process exited)") from None
                raise
    except LaunchError as exc:
        raise ServiceError(str(exc)) from None


@contextlib.contextmanager
def connect(model: Path, *, services: dict[str, str] | None = None, in_process: bool = False) -> Iterator[Clients]:
    """Clients for the offline turn."""
    if in_process:
        yield local_clients(model)
        return
    with serving(model, services) as addresses:
        clients = grpc_clients(addresses)
        try:
            yield clients
        finally:
            close_clients(clients)
