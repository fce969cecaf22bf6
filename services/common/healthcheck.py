"""Ask a server's `grpc.health.v1.Health/Check` whether it serves; the exit code says (for Docker's HEALTHCHECK):

    python -m services.common.healthcheck [--address HOST:PORT] [--service NAME] [--timeout S]

Exit 0 when the answer is SERVING; 1 otherwise, with one line on stderr, e.g.
`health: 127.0.0.1:50051 answered NOT_SERVING` or `health: nothing answered at 127.0.0.1:50051 within 2.0 s`.
--address takes any gRPC target (`HOST:PORT`, `dns:///llm:50052`); --service "" (the default) asks about the
server as a whole. Imports only grpc, so it costs little to run every few seconds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 2.0


def check(address: str, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """None when `address` says SERVING for `service`; otherwise the reason, one line."""
    # A probe of a local port must not be sent through an HTTP proxy set in the environment.
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s,
                               wait_for_ready=True)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"nothing answered at {address} within {timeout_s} s"
            if code == grpc.StatusCode.NOT_FOUND:
                return f"{address} does not know the service {service!r}"
            return f"{address} failed the check: {code.name}: {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return f"{address} answered {status}" + (f" for {service}" if service else "")
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.common.healthcheck",
                                     description="Exit 0 when a gRPC server's health check says SERVING, else 1.")
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help=f"gRPC target (default {DEFAULT_ADDRESS})")
    parser.add_argument("--service", default="", help='service name to ask about (default "": the whole server)')
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds to wait for an answer (default {DEFAULT_TIMEOUT_S})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout {args.timeout}: must be positive")
    problem = check(args.address, args.service, args.timeout)
    if problem is not None:
        print(f"health: {problem}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
