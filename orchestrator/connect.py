"""Where the four networks run: started here as child processes (the default), already running elsewhere
(`--services`), or inside this process (`--in-process`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

from orchestrator.clients import Deadlines, ServiceError, close_clients, grpc_clients
from orchestrator.launcher import REPLICA, SERVICES, LaunchError, ServiceProcess, grpc_target, launched
from orchestrator.placement import check_environment, describe, parse_gpus, service_gpus
from orchestrator.timeline import Clients
from services.common.batching import DEFAULT_MAX_BATCH

log = logging.getLogger(__name__)

__all__ = ["Deadlines", "ServiceError", "add_deadline_flags", "connect", "deadlines_from_args", "parse_services"]


def parse_services(text: str) -> dict[str, str]:
    """`perception=TARGET,llm=TARGET,tts=TARGET,codec=TARGET` -> name -> gRPC target.

    A target is HOST:PORT, or any gRPC target naming the replicas of one network: `dns:///NAME:PORT` or
    `ipv4:HOST:PORT,HOST:PORT` (its commas stay with it: a new entry starts only at `NAME=`)."""
    entries = re.split(rf",\s*(?=(?:{'|'.join(SERVICES)})=)", text.strip())
    addresses: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in entries)):
        name, sep, address = part.partition("=")
        if not sep or name not in SERVICES or not _is_target(address):
            raise ValueError(
                f"--services entry {part!r}: expected NAME=HOST:PORT (or a gRPC target such as dns:///HOST:PORT) "
                f"with NAME one of {', '.join(SERVICES)}"
            )
        if name in addresses:
            raise ValueError(f"--services names {name} twice; give each of the four once")
        addresses[name] = address
    missing = [name for name in SERVICES if name not in addresses]
    if missing:
        raise ValueError(f"--services is missing {', '.join(missing)}; give all four as NAME=HOST:PORT")
    return addresses


def parse_service_flags(text: str) -> tuple[str, list[str]]:
    """`NAME=FLAGS` (NAME one of the services or `all`) -> (NAME, the flags split as a shell would)."""
    name, sep, flags = text.partition("=")
    name = name.strip()
    if not sep or name not in (*SERVICES, "all"):
        raise ValueError(f"--service-flags {text!r}: expected NAME=FLAGS with NAME one of {', '.join(SERVICES)} "
                         "or all, e.g. llm='--weights-dtype bfloat16'")
    try:
        return name, shlex.split(flags)
    except ValueError as exc:
        raise ValueError(f"--service-flags {text!r}: {exc}") from None


def service_flags(entries: list[tuple[str, list[str]]] | None) -> dict[str, list[str]]:
    """Repeated --service-flags -> name -> flags, `all` first and each service's own after it."""
    flags: dict[str, list[str]] = {name: [] for name in SERVICES}
    for target, extra in _per_service(entries):
        flags[target] += extra
    return flags


_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_service_env(text: str) -> tuple[str, dict[str, str]]:
    """`NAME=VAR=VALUE` (NAME one of the services or `all`) -> (NAME, {VAR: VALUE}); VALUE may hold `=`."""
    name, _, setting = text.partition("=")
    name = name.strip()
    variable, sep, value = setting.partition("=")
    if name not in (*SERVICES, "all") or not sep or not _VARIABLE.fullmatch(variable):
        raise ValueError(f"--service-env {text!r}: expected NAME=VAR=VALUE with NAME one of {', '.join(SERVICES)} "
                         "or all and VAR an environment variable's name, e.g. perception=MLX_USE_CUDA_GRAPHS=0")
    return name, {variable: value}


def service_envs(entries: list[tuple[str, dict[str, str]]] | None) -> dict[str, dict[str, str]]:
    """Repeated --service-env -> name -> variables, `all` first, so a service's own setting of a variable wins."""
    envs: dict[str, dict[str, str]] = {name: {} for name in SERVICES}
    for target, variables in _per_service(entries):
        envs[target].update(variables)
    return envs


MAX_REPLICAS = 16


def parse_replicas(text: str) -> tuple[str, int]:
    """`NAME=N` (NAME one of the services or `all`) -> (NAME, N), 1 <= N <= MAX_REPLICAS."""
    name, sep, count = text.partition("=")
    name = name.strip()
    if name not in (*SERVICES, "all") or not sep or not count.strip().isdigit() \
            or not 1 <= int(count) <= MAX_REPLICAS:
        raise ValueError(f"--replicas {text!r}: expected NAME=N with NAME one of {', '.join(SERVICES)} or all and "
                         f"N from 1 to {MAX_REPLICAS}, e.g. perception=2")
    return name, int(count)


def service_replicas(entries: list[tuple[str, int]] | None, gpus: dict[str, list[str]] | None = None
                     ) -> dict[str, int]:
    """Repeated --replicas -> name -> processes to start, `all` first, so a service's own count wins; a service
    that --replicas leaves out runs one process per GPU of its placement (`gpus`, from --gpus), else one."""
    given = dict(_per_service(entries))
    return {name: given.get(name, len((gpus or {}).get(name, ())) or 1) for name in SERVICES}


def batch_flags(flags: dict[str, list[str]], sessions: int, replicas: dict[str, int]) -> dict[str, list[str]]:
    """Each started service's flags with `--max-batch` first: its replicas' share of the server's `sessions`
    (at least the services' own default), so every conversation's step can join one batch; a `--max-batch` in
    the service's own flags comes after and wins.

    >>> batch_flags({"tts": ["--precompile-batches", "32"]}, 32, {"tts": 1})
    {'tts': ['--max-batch', '32', '--precompile-batches', '32']}
    >>> batch_flags({"tts": [], "llm": []}, 8, {"tts": 1, "llm": 1})
    {'tts': ['--max-batch', '16'], 'llm': ['--max-batch', '16']}
    """
    return {name: ["--max-batch", str(max(DEFAULT_MAX_BATCH, -(-sessions // replicas.get(name, 1)))), *own]
            for name, own in flags.items()}


def _per_service(entries: list[tuple[str, object]] | None) -> Iterator[tuple[str, object]]:
    """(service, value) for each entry, in order, `all` entries first and given to every service."""
    for name, value in sorted(entries or [], key=lambda entry: entry[0] != "all"):
        for target in SERVICES if name == "all" else (name,):
            yield target, value


def _is_target(address: str) -> bool:
    scheme, sep, rest = address.partition(":")
    if sep and scheme in _SCHEMES:
        return bool(rest.strip("/"))
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit())


_SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock")


def add_deadline_flags(parser: argparse.ArgumentParser) -> None:
    """--open-timeout and --frame-timeout: how long a service may take before the orchestrator calls it gone."""
    default = Deadlines()
    parser.add_argument("--open-timeout", type=float, default=default.open_s, metavar="S",
                        help=f"seconds a service may take to open a session (default {default.open_s:g})")
    parser.add_argument("--frame-timeout", type=float, default=default.frame_s, metavar="S",
                        help=f"seconds a service may take for one frame before the session ends with an error "
                             f"naming it (default {default.frame_s:g})")


def deadlines_from_args(args: argparse.Namespace) -> Deadlines:
    return Deadlines(open_s=args.open_timeout, frame_s=args.frame_timeout)


def failover_from_args(args: argparse.Namespace):
    """The FailoverPolicy of --snapshot-seconds; UsageError for a value out of range."""
    from orchestrator.failover import FailoverPolicy

    try:
        return FailoverPolicy.every(args.snapshot_seconds)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


class UsageError(ValueError):
    """A command line that cannot run; reported in one line."""


def checked(parse):
    """An argparse type from a parser that raises ValueError: its message becomes the usage error."""
    def typed(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    typed.__name__ = parse.__name__
    return typed


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """Where the networks run: --model, --services or --in-process, --service-flags, --service-env and --mps for
    the services the command starts, and the deadlines."""
    parser.add_argument("--model", help="converted checkpoint folder (default $VOICECHAT_MODEL, else the demo)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--services", type=checked(parse_services),
                       metavar="perception=HOST:PORT,llm=...,tts=...,codec=...",
                       help="use running services instead of starting them")
    where.add_argument("--in-process", action="store_true", help="run the engines in this process")
    parser.add_argument("--service-flags", type=checked(parse_service_flags), action="append", metavar="NAME=FLAGS",
                        help="extra flags for a service this command starts (NAME: perception, llm, tts, codec or "
                             "all; repeatable), e.g. --service-flags llm='--weights-dtype bfloat16' "
                             "--service-flags all='--precompile-batches 16'")
    parser.add_argument("--service-env", type=checked(parse_service_env), action="append", metavar="NAME=VAR=VALUE",
                        help="an environment variable for a service this command starts (NAME as for "
                             "--service-flags; repeatable), e.g. --service-env perception=MLX_USE_CUDA_GRAPHS=0: "
                             "settings read once per process, such as MLX's and CUDA MPS's, per service")
    parser.add_argument("--mps", action="store_true",
                        help="the services this command starts share the GPU through a CUDA MPS daemon started for "
                             "them and stopped after (NVIDIA GPUs; needs nvidia-cuda-mps-control): their kernels run "
                             "side by side instead of taking turns")
    parser.add_argument("--replicas", type=checked(parse_replicas), action="append", metavar="NAME=N",
                        help="start N processes of a service this command starts (NAME as for --service-flags; "
                             "repeatable); new sessions spread over them round-robin, and each replica batches "
                             f"its own sessions' steps in a process of its own. {REPLICA} in its flags and "
                             "environment values becomes each replica's index, e.g. --service-flags "
                             f"perception=--step-log=steps-{REPLICA}.jsonl")
    parser.add_argument("--gpus", type=checked(parse_gpus), action="append", metavar="NAME=INDEX[,INDEX...]",
                        help="the NVIDIA GPUs a service this command starts runs on (NAME as for --service-flags; "
                             "repeatable): one replica per GPU unless --replicas gives the count, replicas "
                             "round-robin over the GPUs, each process seeing only its own (CUDA_VISIBLE_DEVICES), "
                             "e.g. --gpus llm=1 --gpus perception=0 --gpus tts=0,1")
    add_deadline_flags(parser)


def add_failover_flags(parser: argparse.ArgumentParser) -> None:
    """--snapshot-seconds, for the commands whose sessions' streams fail over (stream, serve, the gateway)."""
    from orchestrator.failover import DEFAULT_SNAPSHOT_FRAMES

    default = DEFAULT_SNAPSHOT_FRAMES * 0.08
    parser.add_argument("--snapshot-seconds", type=float, default=default, metavar="S",
                        help="seconds of conversation between snapshots of each session's state on each network, "
                             "kept by the orchestrator so that a session whose replica fails is restored on another "
                             "and only the frames since are replayed (0: never, the whole session is replayed; "
                             f"default {default:g}; docs/operations.md gives the memory and bandwidth)")


def connection_from_args(args: argparse.Namespace) -> dict:
    """Where the services are, as `connect` / `connect_streams` take it, from `add_connection_flags`' flags;
    UsageError for flags that cannot go together."""
    for flag, given in (("--service-flags", args.service_flags), ("--service-env", args.service_env),
                        ("--mps", args.mps), ("--replicas", args.replicas), ("--gpus", args.gpus)):
        if given and (args.services is not None or args.in_process):
            raise UsageError(f"{flag} is for services this command starts; it cannot go with --services "
                             "or --in-process")
    envs, gpus = service_envs(args.service_env), service_gpus(args.gpus)
    try:
        check_environment(gpus, envs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    connection = {"services": args.services, "in_process": args.in_process, "deadlines": deadlines_from_args(args),
                  "flags": service_flags(args.service_flags), "envs": envs, "mps": args.mps,
                  "replicas": service_replicas(args.replicas, gpus), "gpus": gpus}
    if hasattr(args, "snapshot_seconds"):  # a command with streams (add_failover_flags)
        connection["failover"] = failover_from_args(args)
        if warning := connection["failover"].uncovered(_longest_session_s(args)):
            log.warning("%s", warning)
    return connection


def _longest_session_s(args: argparse.Namespace) -> float:
    """The longest conversation the command's flags admit (gRPC sessions, and realtime ones where served)."""
    limits = [getattr(args, "max_streaming_seconds", None)]
    if not getattr(args, "no_realtime", False):
        limits.append(getattr(args, "max_session_seconds", None))
    return max((limit for limit in limits if limit is not None), default=0.0)


@contextlib.contextmanager
def serving(model: Path, services: dict[str, str] | None = None, flags: dict[str, list[str]] | None = None,
            mps: bool = False, envs: dict[str, dict[str, str]] | None = None,
            replicas: dict[str, int] | None = None, gpus: dict[str, list[str]] | None = None,
            children: list[ServiceProcess] | None = None) -> Iterator[dict[str, str]]:
    """The four services' gRPC targets: the ones given, or children started here (from the main thread, with
    their extra `flags` and environment variables `envs`, `replicas[name]` processes of a service placed on
    `gpus[name]`, under an MPS daemon of their own with `mps`; added to `children` when given) and stopped on
    exit. A client failure while a child has died names that child."""
    if services:
        yield services
        return
    if gpus:
        print(describe(gpus, {name: (replicas or {}).get(name, 1) for name in SERVICES}), file=sys.stderr,
              flush=True)
    try:
        with launched(model, flags=flags, mps=mps, envs=envs, replicas=replicas, gpus=gpus) as started:
            if children is not None:
                children.extend(child for group in started.values() for child in group)
            try:
                yield {name: grpc_target(group) for name, group in started.items()}
            except ServiceError as exc:
                dead = sorted({c.name for group in started.values() for c in group
                               if c.process.poll() is not None})
                if dead:
                    raise ServiceError(f"{exc} (the {', '.join(dead)} service process exited)") from None
                raise
    except LaunchError as exc:
        raise ServiceError(str(exc)) from None


def reconnected(clients, timeout_s: float = 30.0):
    """connected(name) for a Supervisor: waits (off the event loop) until these clients' channel to the service
    `name` is connected again; a channel retries every 2 s at most (orchestrator.clients.Channel)."""
    by_name = {"perception": clients.perception, "llm": clients.language, "tts": clients.speech,
               "codec": clients.codec}

    async def connected(name: str) -> None:
        if not await asyncio.to_thread(by_name[name].channel.wait_ready, timeout_s):
            log.warning("the channel to the %s service did not reconnect within %.0f s", name, timeout_s)

    return connected


@contextlib.contextmanager
def connect(model: Path, *, services: dict[str, str] | None = None, in_process: bool = False,
            deadlines: Deadlines | None = None, flags: dict[str, list[str]] | None = None,
            mps: bool = False, envs: dict[str, dict[str, str]] | None = None,
            replicas: dict[str, int] | None = None, gpus: dict[str, list[str]] | None = None) -> Iterator[Clients]:
    """Clients for the offline turn."""
    if in_process:
        from orchestrator.local import local_clients  # MLX and the engines, only when asked for

        yield local_clients(model)
        return
    with serving(model, services, flags, mps, envs, replicas, gpus) as addresses:
        clients = grpc_clients(addresses, deadlines)
        try:
            yield clients
        finally:
            close_clients(clients)
