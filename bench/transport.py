"""The orchestrator's CPU per request/answer round trip on a session's stream, for each way of running the streams.

    python -m bench.transport [--streams 16,64] [--ahead 1,2] [--rounds 200] [--size 4096]
                              [--variants threads,aio,mux,mux-coalesce] [--json]

A trivial grpc.aio echo service runs in a child process. K caller threads (as a session's stage threads are)
each hold one stream and send `--size`-byte requests, `--ahead` unanswered at most (1: one in flight; 2: the
session's send-ahead), each answer awaited before the next request past that. After a warm-up of 20 round trips
a stream, the client process's CPU seconds (time.process_time: every thread) and the server's (/proc/PID/stat
utime+stime) are read across `--rounds` round trips of every stream; a row gives milliseconds of CPU per round
trip on each side and the round trips per second. Variants:

    threads       today's BidiStream on gRPC's synchronous streams (orchestrator.transport.ThreadCall): a
                  request-iterator thread and a reader thread per stream, besides gRPC's spin thread
    aio           BidiStream on grpc.aio (orchestrator.transport.LoopCall): every stream on one event loop
                  thread; callers hand requests over with call_soon_threadsafe, answers come in a SimpleQueue
    mux           one synchronous gRPC stream for all K sessions: each message carries a session id, one reader
                  thread hands answers to per-session queues (a `Multiplex`-style RPC)
    mux-coalesce  mux, with the requests ready at once packed into one message (and echoed as one)

The CPU is the whole process's, so a row also includes the callers' own work (queue hand-offs: the same in all
variants). The machine's other load shows in wall time, far less in CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import grpc

from orchestrator.clients import BidiStream, Deadlines
from orchestrator.pending import Pending
from orchestrator.transport import LoopCall, ThreadCall, on_loop

STREAM = "/bench.Echo/Stream"
MULTIPLEX = "/bench.Echo/Multiplex"
WARMUP = 20
VARIANTS = ("threads", "aio", "mux", "mux-coalesce")
_HEADER = struct.Struct("<II")  # a multiplexed record: session id, payload length, then the payload


# ------------------------------------------------------------------------------------------------ the service


async def _echo(requests, context):
    async for request in requests:
        yield request


async def _serve() -> None:
    server = grpc.aio.server()
    handlers = {name: grpc.stream_stream_rpc_method_handler(_echo) for name in ("Stream", "Multiplex")}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------------ the clients


class _Channel:
    """What BidiStream needs of a Channel, over a raw-bytes echo stream on either transport."""

    name, deadlines = "echo", Deadlines()

    def __init__(self, address: str, transport: str):
        self.address, self.transport = address, transport
        if transport == "aio":
            self._channel = on_loop(lambda: grpc.aio.insecure_channel(address))
        else:
            self._channel = grpc.insecure_channel(address)
        self._method = self._channel.stream_stream(STREAM)

    def open_call(self, method: str):
        return LoopCall(self._method) if self.transport == "aio" else ThreadCall(self._method)

    def streams(self, count: int) -> list[BidiStream]:
        return [BidiStream(self, "Stream") for _ in range(count)]

    def close(self) -> None:
        if self.transport == "aio":
            on_loop(lambda: asyncio.ensure_future(self._channel.close()))
        else:
            self._channel.close()


class Multiplexer:
    """Many sessions' messages on one synchronous stream, each record tagged with its session's id; a reader
    thread hands each answer to its session's queue. With `coalesce`, the requests waiting when the stream takes
    the next one go out packed in one message."""

    _END = object()

    def __init__(self, address: str, coalesce: bool):
        self._channel = grpc.insecure_channel(address)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inboxes: list[queue.SimpleQueue] = []
        self.coalesce = coalesce
        self._responses = self._channel.stream_stream(MULTIPLEX)(self._requests())
        threading.Thread(target=self._read, daemon=True).start()

    def _requests(self):
        while (first := self._outbox.get()) is not self._END:
            records = [first]
            while self.coalesce:
                try:
                    records.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            yield b"".join(_HEADER.pack(session, len(payload)) + payload for session, payload in records)

    def _read(self) -> None:
        try:
            for message in self._responses:
                self._dispatch(message)
        except grpc.RpcError:
            pass  # closed: the sessions are done

    def _dispatch(self, message: bytes) -> None:
        at = 0
        while at < len(message):
            session, size = _HEADER.unpack_from(message, at)
            at += _HEADER.size
            self._inboxes[session].put(message[at:at + size])
            at += size

    def streams(self, count: int) -> list[MuxSession]:
        sessions = []
        for _ in range(count):
            self._inboxes.append(queue.SimpleQueue())
            sessions.append(MuxSession(self, len(self._inboxes) - 1))
        return sessions

    def close(self) -> None:
        self._outbox.put(self._END)
        self._responses.cancel()
        self._channel.close()


class MuxSession:
    def __init__(self, mux: Multiplexer, session: int):
        self.mux, self.session = mux, session

    def close(self) -> None:
        pass  # the multiplexed stream outlives its sessions

    def send(self, payload: bytes) -> Pending:
        self.mux._outbox.put((self.session, payload))
        return Pending(lambda: self.mux._inboxes[self.session].get(timeout=15))


# ------------------------------------------------------------------------------------------------ the bench


@dataclass
class Row:
    variant: str
    streams: int
    ahead: int
    round_trips: int
    client_ms: float  # client process CPU per round trip
    server_ms: float  # echo service CPU per round trip
    per_s: float  # round trips per second (wall)


def _converse(stream, payload: bytes, rounds: int, ahead: int, marks: threading.Barrier) -> None:
    for count in (WARMUP, rounds):
        marks.wait()
        sent = deque(stream.send(payload) for _ in range(min(ahead, count)))
        for i in range(count):
            assert len(sent.popleft().result()) == len(payload)
            if i + ahead < count:
                sent.append(stream.send(payload))
    marks.wait()


def measure(variant: str, address: str, server_pid: int, count: int, ahead: int, rounds: int,
            size: int) -> Row:
    transport = (Multiplexer(address, coalesce=variant == "mux-coalesce") if variant.startswith("mux")
                 else _Channel(address, variant))
    payload = os.urandom(size)
    marks = threading.Barrier(count + 1)
    streams = transport.streams(count)
    threads = [threading.Thread(target=_converse, args=(stream, payload, rounds, ahead, marks), daemon=True)
               for stream in streams]
    for thread in threads:
        thread.start()
    marks.wait()  # warm-up starts
    marks.wait()  # warm-up done
    client, server, wall = time.process_time(), cpu_seconds(server_pid), time.perf_counter()
    marks.wait()
    client, server = time.process_time() - client, cpu_seconds(server_pid) - server
    wall = time.perf_counter() - wall
    for thread in threads:
        thread.join()
    for stream in streams:
        stream.close()
    transport.close()
    total = count * rounds
    return Row(variant, count, ahead, total, round(client / total * 1e3, 4), round(server / total * 1e3, 4),
               round(total / wall, 1))


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=_ints, default=[16, 64], help="concurrent streams, comma-separated")
    parser.add_argument("--ahead", type=_ints, default=[1, 2], help="requests in flight a stream, comma-separated")
    parser.add_argument("--rounds", type=int, default=200, help="measured round trips a stream")
    parser.add_argument("--size", type=int, default=4096, help="request (and answer) bytes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of {', '.join(VARIANTS)}")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child: the echo service
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve())
        return 0
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
    server = subprocess.Popen([sys.executable, "-m", "bench.transport", "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{int(server.stdout.readline())}"
        rows = [measure(variant, address, server.pid, streams, ahead, args.rounds, args.size)
                for streams in args.streams for ahead in args.ahead for variant in variants]
    finally:
        server.terminate()
        server.wait()
    if args.json:
        print(json.dumps({"size": args.size, "rounds": args.rounds, "rows": [asdict(row) for row in rows]}))
        return 0
    print(f"{'variant':>13} {'streams':>7} {'ahead':>5} {'client ms/rt':>12} {'server ms/rt':>12} {'rt/s':>8}")
    for row in rows:
        print(f"{row.variant:>13} {row.streams:>7} {row.ahead:>5} {row.client_ms:>12.3f} {row.server_ms:>12.3f} "
              f"{row.per_s:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
