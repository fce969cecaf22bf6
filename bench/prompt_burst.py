"""Language sessions opening at once with one new system prompt: how long until every one has opened, and how
many prompt rows the service fed for them.

    python -m bench.prompt_burst --model DIR [--sessions 8] [--prompt-tokens 60] [--rounds 3]

The language service starts in this process (its defaults: prompts kept) on a port of its own; each round,
`--sessions` Stream calls send the same `open` with a prompt of `--prompt-tokens` ids (bos and eos included)
that no earlier round used, and the round's time runs from the first open sent to the last open answered. The
rows fed are the round's growth of the service's batch-size sum (a session's prompt row counts one). One session
feeds a new prompt and the others take copies of its caches (services/llm/service.py), so a round feeds P rows,
not sessions x P.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import grpc

from protos.voicechat.v1 import language_pb2, language_pb2_grpc
from services.common.server import start_server
from services.llm.service import build_spec


def prompt(tokens: int, round_index: int, model) -> list[int]:
    """`tokens` ids, the model's bos and eos at the ends and a middle no other round has: a prompt not yet kept."""
    middle = [3 + (7 * round_index + 13 * i) % (model.vocab_size - 3) for i in range(tokens - 2)]
    return [model.bos_id, *middle, model.eos_id]


async def rounds(model: Path, sessions: int, tokens: int, count: int) -> list[tuple[float, float]]:
    """(seconds until every session opened, rows fed) per round."""
    spec = build_spec(model)
    running = await start_server(spec.registrations, spec.service_names, host="127.0.0.1", port=0)
    servicer = spec.registrations[0][1]
    out = []
    try:
        await running.become_ready(spec.load)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = language_pb2_grpc.LanguageServiceStub(channel)
            for r in range(count):
                opening = language_pb2.LanguageStreamRequest(open=language_pb2.LanguageOpen(
                    prompt_token_ids=prompt(tokens, r, servicer.engine.model),
                    prefix_precision=language_pb2.PREFIX_PRECISION_BFLOAT16))
                before = servicer.metrics.value("voicechat_batch_size_sum") or 0
                calls = [stub.Stream() for _ in range(sessions)]
                start = time.perf_counter()
                for call in calls:
                    await call.write(opening)
                await asyncio.gather(*(call.read() for call in calls))
                out.append((time.perf_counter() - start, (servicer.metrics.value("voicechat_batch_size_sum") or 0)
                            - before))
                for call in calls:
                    call.cancel()
                await asyncio.sleep(0.5)  # the sessions close
    finally:
        await running.stop(0)
        spec.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prompt_burst", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--sessions", type=int, default=8, help="sessions opening at once (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=60, help="the prompt's ids, bos and eos included")
    parser.add_argument("--rounds", type=int, default=3, help="bursts, each with a new prompt (default 3)")
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.prompt_tokens < 3 or args.rounds < 1:
        parser.error("--sessions and --rounds must be at least 1, --prompt-tokens at least 3")
    results = asyncio.run(rounds(args.model, args.sessions, args.prompt_tokens, args.rounds))
    print(f"{args.sessions} sessions opening with a new {args.prompt_tokens}-token prompt: "
          + ", ".join(f"{seconds * 1000:.0f} ms ({rows:.0f} rows fed)" for seconds, rows in results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
