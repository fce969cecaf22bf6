"""The embedded default: start the four network services as child processes and stop them when done.

Each child is `python -m services.<name> --model DIR --port 0`; it prints `listening on HOST:PORT` once its
health check says SERVING. Children die with the orchestrator: they are stopped on exit, on Ctrl-C and on
error, and on Linux the kernel also signals them if the orchestrator itself is killed (each child asks for that
itself at start, see `services.common.cli.die_with_parent`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.mps import MpsError, mps_daemon
from services.common.cli import PARENT_PID_ENV, SHARED, parse_ready_line
from services.common.metrics import METRICS_PORT_ENV, parse_metrics_line

SERVICES = ("perception", "llm", "tts", "codec")
# The buffer cache each launched service keeps (its --cache-limit-mb unless the caller's flags give one): a share
# of the device's memory (services.common.cli.shared_cache_limit_mb). MLX's own limit is about the device's whole
# memory, per process: four services sharing one GPU, each keeping every buffer size its batches have freed, ran a
# 141 GB H200 out of memory in 30 s at 16 conversations.
SHARED_CACHE_LIMIT = SHARED


class LaunchError(RuntimeError):
    """A service that did not come up."""


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    address: str = ""
    metrics_url: str = ""  # http://HOST:PORT/metrics once announced, when started with --metrics-port
    log: list[str] = field(default_factory=list)  # the child's stderr, kept for error messages
    command: list[str] = field(default_factory=list)  # how it was started, to start it again
    env: dict[str, str] = field(default_factory=dict)
    port: str = ""  # the port it served on, once it has: its restarts bind that one again

    def tail(self, lines: int = 5) -> str:
        return "\n".join(self.log[-lines:])

    def restart(self) -> None:
        """Start the service again in place of this (dead) process, on the port it had, so the clients' channels
        to that address reconnect by themselves. `address` is empty until the new process says it serves."""
        if self.address:
            self.port = self.address.rpartition(":")[2]
        self.process = _popen([*self.command, "--port", self.port or "0"], self.env)
        self.address = ""
        _watch(self)


def _popen(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _watch(child: ServiceProcess) -> None:
    """Keep the child's stderr in child.log and read its ready line into child.address."""
    threading.Thread(target=_drain, args=(child.process.stderr, child.log), daemon=True).start()
    threading.Thread(target=_read_ready, args=(child, child.process.stdout), daemon=True).start()


def _drain(stream, sink: list[str]) -> None:
    for line in stream:
        sink.append(line.rstrip())
        del sink[:-200]


def spawn_service(name: str, model: Path, extra: list[str] | None = None,
                  wrapper: list[str] | None = None, env: dict[str, str] | None = None) -> ServiceProcess:
    """Start one service on a free port (`extra` flags override; `wrapper` runs the command through another
    that execs it, e.g. `ip netns exec NS`; `env` is added to this process's environment). Its buffer cache is
    bounded to SHARED_CACHE_LIMIT unless `extra` says otherwise. Call from the main thread: on Linux the
    child is signalled when the thread that started it ends, which must be this process's lifetime, not a helper
    thread's."""
    command = [*(wrapper or []), sys.executable, "-m", f"services.{name}", "--model", str(model), "--port", "0",
               "--host", "127.0.0.1", "--log-level", "WARNING", "--cache-limit-mb", SHARED_CACHE_LIMIT,
               *(extra or [])]
    # No preexec_fn: forking a process that has gRPC loaded runs gRPC's fork handlers in the child, which can
    # abort it; without one the child is spawned directly and arranges its own death with this process.
    environment = {**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid())}
    environment.pop(METRICS_PORT_ENV, None)  # meant for this process: four children cannot all bind one port
    child = ServiceProcess(name, _popen(command, environment), command=command, env=environment)
    _watch(child)
    return child


def _read_ready(child: ServiceProcess, stdout) -> None:
    for line in stdout:
        parsed = parse_ready_line(line)
        if parsed:
            child.address = f"{parsed[0]}:{parsed[1]}"
            break
    for line in stdout:  # keep the pipe drained
        url = parse_metrics_line(line)
        if url:
            child.metrics_url = url


# A full checkpoint loads in tens of seconds; with --precompile-batches on a GPU a service takes minutes. A child
# that exits is reported at once whatever this says.
READY_TIMEOUT_S = 600.0


def wait_ready(children: list[ServiceProcess], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Block until every child has printed its address; a child that exits or stalls is an error."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        while not child.address:
            if child.process.poll() is not None:
                time.sleep(0.05)  # let the stderr reader catch the last lines
                # its last line says why: a usage error, or the exception that ended a traceback
                raise LaunchError(f"the {child.name} service exited with code {child.process.returncode}: "
                                  f"{child.tail(1) or 'no output'}")
            if time.monotonic() > deadline:
                raise LaunchError(f"the {child.name} service did not become ready within {timeout_s:.0f} s")
            time.sleep(0.02)


def stop(children: list[ServiceProcess], grace_s: float = 5.0) -> None:
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


# In a replica's flags and environment values, this becomes the replica's index (0, 1, ...): what each replica
# needs for itself, such as its own --step-log file or --metrics-port.
REPLICA = "{replica}"
# Flags whose value two replicas cannot share: a port binds once (0 picks a free one each), and one step log
# would mix the replicas' steps into what reads as one engine's.
_OWN_FLAGS = ("--port", "--metrics-port", "--step-log")


def grpc_target(replicas: list[ServiceProcess]) -> str:
    """The gRPC target naming a service's started replicas: HOST:PORT for one, else an `ipv4:` list, over which
    the orchestrator's channel spreads new sessions round-robin."""
    if len(replicas) == 1:
        return replicas[0].address
    return "ipv4:" + ",".join(child.address for child in replicas)


# The variable that gives a process its GPU (see orchestrator.placement).
GPU_ENV = "CUDA_VISIBLE_DEVICES"


def gpu_of_replicas(gpus: list[str], count: int) -> list[str]:
    """The GPU of each of `count` replicas: round-robin over `gpus`."""
    return [gpus[r % len(gpus)] for r in range(count)]


def replica_settings(name: str, count: int, flags: list[str], env: dict[str, str], gpus: list[str] | None = None
                     ) -> list[tuple[list[str], dict[str, str]]]:
    """Each of `count` replicas' flags and environment: REPLICA replaced by its index, and with `gpus` its GPU
    (GPU_ENV, round-robin over them). ValueError when replicas would share a value only one process may hold (a
    fixed --port or --metrics-port, one --step-log)."""
    placed = [{GPU_ENV: gpu} for gpu in gpu_of_replicas(gpus, count)] if gpus else [{}] * count
    settings = [([flag.replace(REPLICA, str(r)) for flag in flags],
                 {**{var: value.replace(REPLICA, str(r)) for var, value in env.items()}, **placed[r]})
                for r in range(count)]
    if count > 1:
        for flag in _OWN_FLAGS:
            values = [_flag_value(own, flag) for own, _ in settings]
            if values[0] is not None and values[0] != "0" and len(set(values)) < count:
                raise ValueError(f"{count} {name} replicas would share {flag} {values[0]}: put {REPLICA} in its "
                                 f"value, e.g. {flag}={_example(flag)}, so each replica has its own")
    return settings


def _flag_value(flags: list[str], flag: str) -> str | None:
    """The last value given for `flag` (as `--flag VALUE` or `--flag=VALUE`), or None."""
    value = None
    for i, item in enumerate(flags):
        if item == flag and i + 1 < len(flags):
            value = flags[i + 1]
        elif item.startswith(flag + "="):
            value = item[len(flag) + 1:]
    return value


def _example(flag: str) -> str:
    return "steps-" + REPLICA + ".jsonl" if flag == "--step-log" else "910" + REPLICA


@contextlib.contextmanager
def launched(model: Path, names: tuple[str, ...] = SERVICES, flags: dict[str, list[str]] | None = None,
             mps: bool = False, envs: dict[str, dict[str, str]] | None = None,
             replicas: dict[str, int] | None = None, gpus: dict[str, list[str]] | None = None
             ) -> Iterator[dict[str, list[ServiceProcess]]]:
    """Start the services (they load in parallel) with their extra `flags` (name -> flags) and environment
    variables `envs` (name -> variables, over this process's own), `replicas[name]` processes of a service (default
    one; REPLICA in its flags and variables becomes each one's index) spread round-robin over `gpus[name]` when
    given, yield name -> its processes, and always stop them. With `mps` they share the GPU through an MPS daemon
    started for them first and stopped after them (see orchestrator.mps)."""
    try:
        settings = {name: replica_settings(name, (replicas or {}).get(name, 1), (flags or {}).get(name, []),
                                           (envs or {}).get(name, {}), (gpus or {}).get(name))
                    for name in names}
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    with contextlib.ExitStack() as stack:
        try:
            daemon = stack.enter_context(mps_daemon()) if mps else {}
        except MpsError as exc:
            raise LaunchError(str(exc)) from None
        children: dict[str, list[ServiceProcess]] = {}
        started: list[ServiceProcess] = []
        try:
            for name in names:
                for extra, env in settings[name]:
                    started.append(spawn_service(name, model, extra, env={**daemon, **env}))
                    children.setdefault(name, []).append(started[-1])
            wait_ready(started)
            yield children
        finally:
            stop(started)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
