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

from bench.load import EXAMPLE, Outcome, conversations, grpc_conversation, orchestrator
from bench.long_session import rss_bytes
from orchestrator.audio import read_audio


async def converse(address: str, seconds: float, take_s: float, every_s: float, pid: int) -> list[dict]:
    """The conversation (bench.load's client, all its audio sent at once); a row {seconds, frames, rss_mb} of the
    frames taken so far and the orchestrator's RSS every `every_s`, and one at the end."""
    [talk] = conversations(read_audio(EXAMPLE), 1, seconds)
    outcome = Outcome("grpc")
    start = time.monotonic()
    task = asyncio.ensure_future(grpc_conversation(address, talk, pace="burst", outcome=outcome, take_s=take_s))
    rows: list[dict] = []
    while True:
        rss = rss_bytes(pid)
        rows.append({"seconds": round(time.monotonic() - start, 1), "frames": outcome.frames,
                     "rss_mb": None if rss is None else round(rss / 2**20, 1)})
        print(f"{rows[-1]['seconds']:7.1f} s  {outcome.frames:6d} frames taken  orchestrator RSS "
              f"{rows[-1]['rss_mb']} MB", file=sys.stderr, flush=True)
        if task.done():
            break
        await asyncio.wait({task}, timeout=every_s)
    if outcome.errors or not outcome.done:
        raise RuntimeError(f"the conversation did not end with Done: {outcome.errors or 'no Done'}")
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
    served: list = []
    limit = ["--max-streaming-seconds", str(args.seconds + 60)]
    with orchestrator(args.model, 1, limit, served) as (address, _):
        rows = asyncio.run(converse(address, args.seconds, args.take_ms / 1000, args.every, served[0].pid))
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
