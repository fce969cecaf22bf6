"""A service warms up before it reports SERVING: its engine's throwaway steps run during load, so the first
conversation never waits for a compilation (on a cold GPU one outlasted the orchestrator's 15 s step deadline)."""

from __future__ import annotations

import asyncio
import importlib
import time

import pytest

from services.common import cli
from services.common.batching import StepBatcher
from services.common.server import serve

NAMES = ("perception", "llm", "tts", "codec")


@pytest.mark.parametrize("name", NAMES)
def test_health_says_serving_only_after_a_warm_up_step_ran(name, tiny_checkpoint, monkeypatch):
    warmups: list[tuple[int, float]] = []  # (largest batch size warmed up, when it finished)
    original = StepBatcher.precompile

    async def recorded(self, precompile):
        def engine_precompile(max_batch):
            precompile(max_batch)
            warmups.append((max_batch, time.monotonic()))

        await original(self, engine_precompile)

    monkeypatch.setattr(StepBatcher, "precompile", recorded)
    main = importlib.import_module(f"services.{name}.__main__")
    parser = cli.build_parser(f"services.{name}", "test")
    main.add_arguments(parser)
    args = cli.parse_args(parser, ["--model", str(tiny_checkpoint)])  # the defaults, as a deployment runs it
    spec = main.build(args)
    serving_at: list[float] = []

    async def run() -> None:
        stop = asyncio.Event()

        def on_ready(running) -> None:
            serving_at.append(time.monotonic())
            stop.set()

        await serve(spec.registrations, spec.service_names, host="127.0.0.1", port=0, load=spec.load,
                    on_ready=on_ready, stop=stop, grace_s=0)

    try:
        asyncio.run(run())
    finally:
        spec.close()
    assert [size for size, _ in warmups] == [1], f"{name} warmed up {warmups} before SERVING"
    assert warmups[0][1] <= serving_at[0]
