"""A client that sends all of a conversation's audio at once and takes its answers slowly: whether the server's
memory grows with what the client has not taken.

    python -m bench.slow_client --model DIR [--seconds 180] [--take-ms 40] [--every 10] [--json]

`orchestrator serve` starts on the model with its four services; one gRPC Converse conversation sends
`--seconds` of the bundled question looped, every chunk at once, and waits `--take-ms` after each audio frame it
takes before reading on (slower than the services make frames on any machine fast enough to serve live). Every
`--every` seconds it prints the orchestrator's resident set. The server holds at most a bounded number of each
conversation's frames (orchestrator/conversation.py), so the figure stays near where it began, apart from the
failover log (about 23 KB a frame on the full model, dropped at 7,500 frames: orchestrator/failover.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from bench.load import EXAMPLE, orchestrator
from bench.long_session import rss_bytes
from orchestrator.audio import read_audio
from protos.voicechat.v1 import conversation_pb2 as pb
from protos.voicechat.v1 import conversation_pb2_grpc

CHUNK = 1280  # one 80 ms frame of 16 kHz audio a message


def looped(seconds: float) -> np.ndarray:
    """`seconds` of the bundled question, repeated, as PCM16."""
    wave = read_audio(EXAMPLE)
    n = round(seconds * 16_000)
    return (np.clip(np.resize(wave, n), -1.0, 1.0) * 32767).astype("<i2")


async def converse(address: str, pcm: np.ndarray, take_s: float, every_s: float, pid: int) -> list[dict]:
    """The conversation; a row {seconds, frames, rss_mb} every `every_s` and one at the end."""
    rows: list[dict] = []
    start = time.monotonic()
    frames = 0

    def sample() -> None:
        rss = rss_bytes(pid)
        rows.append({"seconds": round(time.monotonic() - start, 1), "frames": frames,
                     "rss_mb": None if rss is None else round(rss / 2**20, 1)})
        print(f"{rows[-1]['seconds']:7.1f} s  {frames:6d} frames taken  orchestrator RSS {rows[-1]['rss_mb']} MB",
              file=sys.stderr, flush=True)

    async def requests():
        yield pb.ConverseRequest(configure=pb.Configure(seed=0))
        for i in range(0, len(pcm), CHUNK):
            yield pb.ConverseRequest(audio=pb.AudioIn(pcm16=pcm[i : i + CHUNK].tobytes()))
        yield pb.ConverseRequest(flush=pb.Flush())

    async with grpc.aio.insecure_channel(address) as channel:
        due = start
        async for response in conversation_pb2_grpc.ConversationServiceStub(channel).Converse(requests()):
            kind = response.WhichOneof("event")
            if kind == "error":
                raise RuntimeError(f"{pb.ErrorCode.Name(response.error.code)}: {response.error.message}")
            if kind != "audio":
                continue
            frames += 1
            if time.monotonic() >= due:
                sample()
                due += every_s
            await asyncio.sleep(take_s)
    sample()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slow_client", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--seconds", type=float, default=180.0, help="audio sent, seconds (default 180)")
    parser.add_argument("--take-ms", type=float, default=40.0, help="wait after each frame taken (default 40)")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if not args.seconds > 0 or args.take_ms < 0 or not args.every > 0:
        parser.error("--seconds and --every must be positive, --take-ms 0 or more")
    pcm = looped(args.seconds)
    served: list = []
    limit = ["--max-streaming-seconds", str(args.seconds + 60)]
    with orchestrator(args.model, 1, limit, served) as (address, _):
        rows = asyncio.run(converse(address, pcm, args.take_ms / 1000, args.every, served[0].pid))
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
