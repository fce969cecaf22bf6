"""A fresh engine's first steps as a live opening meets them: what the service builds on first use.

    python -m bench.opening {perception,llm,tts,codec} --model DIR [--waves 15,16,1] [--steps N] [--rounds R]
                            [--weights-dtype stored|bfloat16] [--float32-weights] [--split-matmuls]
                            [--system-prompt default|none|TEXT] [--stack-all] [--graph-nodes] [--json]

The engine loads in this process and precompiles the largest batch the waves reach, then opens and closes one
session: what a service holds once `serve` has started it (its precompile, then the conversation it opens
before its ready line). Then, R times over (rounds), sessions open in waves, one wave before each of the first
steps (`--waves 15,16,1`: 15 sessions step alone once, 16 more join them for the next step, then one more), and
all of them step together for the rest of the N steps; each step's wall time is recorded and the sessions close.

Round 1 is what the first conversations meet on a fresh service; later rounds run the same steps on the same
engine. A step of round 1 that costs much more than the same step of round 2 is work the first use built
(kernels compiled, plans made, buffers allocated) that precompile did not reach. On a GPU, point
MLX_PTX_CACHE_DIR at an empty folder to see a cold machine's compiles (MLX keeps the kernels it compiles on disk,
under the temp folder, and later processes read them back).

`--graph-nodes` also counts the nodes of each step's evaluated graphs (`bench.stages.GraphNodes`): on a GPU each
operation outside a compiled function is a kernel launched, so a step of many fresh sessions that draws far more
nodes than a steady step of as many is work an opening adds on every machine, warm or not.

Inputs are those of `bench.service` (synthetic but valid); the language model's sessions open with the
checkpoint's default system prompt (`--system-prompt`), whose rows the first session feeds and the others copy,
as the service's do once `serve` has opened its first conversation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from bench.service import SERVICES, EngineDriver
from bench.stages import GraphNodes
from orchestrator.profile import percentile
from services.common.config import VoiceChatConfig
from services.common.loading import LoadOptions, process_settings


def waves_of(text: str) -> list[int]:
    """'15,16,1' -> [15, 16, 1]: sessions opening before each of the first steps (each at least 1)."""
    try:
        waves = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--waves {text!r}: expected comma-separated session counts, e.g. 15,16,1") from None
    if not waves or min(waves) < 1:
        raise argparse.ArgumentTypeError(f"--waves {text!r}: every wave opens at least one session")
    return waves


def opening_round(driver: EngineDriver, waves: list[int], steps: int,
                  nodes: GraphNodes | None = None) -> list[tuple[int, float] | tuple[int, float, int]]:
    """One round: a wave opens before each of the first steps, then every session steps together; returns each
    step's (sessions, wall ms), with its graphs' nodes when `nodes` (installed) counts them. The sessions are
    closed after."""
    live: list = []
    times: list = []
    try:
        for index in range(steps):
            if index < len(waves):
                live += [driver.open() for _ in range(waves[index])]
            if nodes is not None:
                nodes.take()  # what the openings evaluated is not the step's
            start = time.perf_counter()
            driver.step(live)
            elapsed = (time.perf_counter() - start) * 1000.0
            times.append((len(live), elapsed) if nodes is None else (len(live), elapsed, nodes.take()))
    finally:
        driver.close(live)
    return times


def report(rounds: list[list[tuple[int, float]]], waves: int) -> dict:
    """Per step: its sessions and each round's ms; the first round's excess over the last (first-use work),
    per step and summed; and the last round's median step after its `waves` opening steps (steady)."""
    first, last = rounds[0], rounds[-1]
    excess = [a[1] - b[1] for a, b in zip(first, last, strict=True)]
    return {
        "steps": [{"sessions": first[i][0], "ms": [r[i][1] for r in rounds], "excess_ms": excess[i],
                   **({"graph_nodes": last[i][2]} if len(last[i]) > 2 else {})} for i in range(len(first))],
        "first_round_ms": sum(step[1] for step in first),
        "last_round_ms": sum(step[1] for step in last),
        "excess_ms": sum(excess),
        "worst_excess_ms": max(excess),
        "steady_p50_ms": percentile([step[1] for step in last[waves:] or last], 0.5),
    }


def table(name: str, result: dict) -> str:
    rounds = len(result["steps"][0]["ms"])
    nodes = "graph_nodes" in result["steps"][0]
    lines = [f"{name}: each step's ms, round 1 (fresh) to {rounds}",
             "| step | sessions | " + " | ".join(f"round {r + 1}" for r in range(rounds)) + " | excess |"
             + (" graph nodes |" if nodes else ""),
             "| --- | --- |" + " --- |" * (rounds + 1 + nodes)]
    for i, step in enumerate(result["steps"]):
        times = " | ".join(f"{t:.1f}" for t in step["ms"])
        lines.append(f"| {i} | {step['sessions']} | {times} | {step['excess_ms']:.1f} |"
                     + (f" {step['graph_nodes']} |" if nodes else ""))
    lines.append(f"first round {result['first_round_ms']:.1f} ms, last {result['last_round_ms']:.1f} ms: first use "
                 f"cost {result['excess_ms']:.1f} ms (worst step {result['worst_excess_ms']:.1f}); steady step p50 "
                 f"{result['steady_p50_ms']:.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.opening", description=__doc__.split("\n\n")[0])
    parser.add_argument("service", choices=SERVICES)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--waves", type=waves_of, default=[15, 16, 1],
                        help="sessions opening before each of the first steps (default 15,16,1)")
    parser.add_argument("--steps", type=int, default=8, help="steps a round (at least as many as waves)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds on the same engine (at least 2)")
    parser.add_argument("--weights-dtype", choices=["stored", "bfloat16"], default="stored",
                        help="the language model's projections as stored or dequantized to bf16")
    parser.add_argument("--float32-weights", action="store_true", help="as the services' flag of that name")
    parser.add_argument("--split-matmuls", action="store_true", help="as the services' flag of that name")
    parser.add_argument("--system-prompt", default="default",
                        help="the language model's prompt: 'default' (the checkpoint's), 'none', or the text")
    parser.add_argument("--stack-all", action="store_true",
                        help="tts and llm: stack every attention cache of a batch, as on a GPU (bench.service's flag)")
    parser.add_argument("--graph-nodes", action="store_true",
                        help="count the nodes of each step's evaluated graphs (its last round's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < len(args.waves):
        parser.error(f"--steps {args.steps}: at least one step per wave ({len(args.waves)})")
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: at least 2 (the first is compared with the last)")
    if args.stack_all and args.service not in ("tts", "llm"):
        parser.error(f"--stack-all: only speech (tts) and the language model (llm) stack attention caches, not "
                     f"{args.service}")
    process_settings()
    config = VoiceChatConfig.load(args.model)
    prompt = {"default": config.default_system_prompt, "none": ""}.get(args.system_prompt, args.system_prompt)
    options = LoadOptions(args.weights_dtype if args.service == "llm" else "stored", args.float32_weights,
                          args.split_matmuls)
    driver = EngineDriver(args.service, args.model, config, options, system_prompt=prompt)
    if args.stack_all:
        driver.stack_all()
    driver.precompile(sum(args.waves))
    with GraphNodes() if args.graph_nodes else contextlib.nullcontext() as nodes:
        rounds = [opening_round(driver, args.waves, args.steps, nodes) for _ in range(args.rounds)]
    result = report(rounds, len(args.waves))
    result.update(service=args.service, waves=args.waves)
    print(json.dumps(result) if args.json else table(args.service, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
