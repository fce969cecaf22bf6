"""Each service over a real grpc.aio server: concurrent sessions' steps run as batches, and every session gets
exactly what it gets alone, whether the batch sizes were compiled at load (--precompile-batches) or on use.

The engine thread is held while the sessions' frame i arrives, so the steps queue up and meet in at most two
batches (the one the drain took when the first step arrived, and the rest); then the same sessions run one at a
time through the same server. On this CPU a batched row is computed exactly as a solo row, so the replies
are compared byte for byte (ids, codes and float tensors alike)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import threading
import time

import grpc
import numpy as np
import pytest

from bench.service import workload
from protos.voicechat.v1 import snapshot_pb2
from services.common.cli import build_parser, parse_args
from services.common.config import VoiceChatConfig
from services.common.server import start_server

HOST = "127.0.0.1"
SESSIONS = 3
FRAMES = 6


@contextlib.asynccontextmanager
async def served(name: str, model_dir, *flags: str):
    main = importlib.import_module(f"services.{name}.__main__")
    parser = build_parser(f"services.{name}", "")
    main.add_arguments(parser)
    spec = main.build(parse_args(parser, ["--model", str(model_dir), *flags]))
    running = await start_server(spec.registrations, spec.service_names, host=HOST, port=0)
    try:
        await running.become_ready(spec.load)
        yield f"{HOST}:{running.port}", spec.registrations[0][1]
    finally:
        await running.stop(0)
        spec.close()


async def _until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


async def run_together(channel, load, servicer, frames: int, seeds: list[int]) -> list[list[bytes]]:
    """Every session's replies, each frame's steps held back until they can all be batched."""
    rngs = [np.random.default_rng(seed) for seed in seeds]
    calls = [getattr(load.stub(channel), load.method)() for _ in seeds]
    for call in calls:
        await call.write(load.open)
        await call.read()
    replies: list[list[bytes]] = [[] for _ in seeds]
    batcher = servicer.batcher
    for index in range(frames):
        gate = threading.Event()
        servicer.engine_thread.submit(gate.wait, 30)
        for call, rng in zip(calls, rngs, strict=True):
            await call.write(load.frame(index, rng))
        await _until(lambda: batcher.running + batcher.queued == len(calls), "the steps to queue")
        gate.set()
        for call, out in zip(calls, replies, strict=True):
            out.append((await call.read()).SerializeToString(deterministic=True))
    for call in calls:
        await call.done_writing()
    return replies


async def run_alone(channel, load, frames: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    call = getattr(load.stub(channel), load.method)()
    await call.write(load.open)
    await call.read()
    out = []
    for index in range(frames):
        await call.write(load.frame(index, rng))
        out.append((await call.read()).SerializeToString(deterministic=True))
    await call.done_writing()
    return out


@pytest.mark.parametrize("precompile", [0, 3], ids=["compiled-on-use", "precompiled"])
@pytest.mark.parametrize("name", ["perception", "llm", "tts", "codec"])
def test_concurrent_sessions_batch_and_each_equals_its_solo_run(tiny_checkpoint, name, precompile):
    config = VoiceChatConfig.load(tiny_checkpoint)
    seeds = [11, 22, 33][:SESSIONS]

    async def scenario():
        async with served(name, tiny_checkpoint, "--precompile-batches", str(precompile)) as (address, servicer):
            if name == "llm":
                assert servicer.engine.live_sessions == 0  # the precompile's sessions are gone
            load = workload(name, config, servicer.engine.prompt_frames if name == "tts" else 0)
            async with grpc.aio.insecure_channel(address) as channel:
                together = await run_together(channel, load, servicer, FRAMES, seeds)
                before = servicer.metrics.value("voicechat_batch_size_count")
                alone = [await run_alone(channel, load, FRAMES, seed) for seed in seeds]
                after = servicer.metrics.value("voicechat_batch_size_count")
            sizes = servicer.metrics.value("voicechat_batch_size_sum"), before, after
        return together, alone, sizes

    together, alone, (size_sum, batches_together, batches_total) = asyncio.run(scenario())
    assert FRAMES <= batches_together <= 2 * FRAMES  # per frame: one or two batches for the three steps
    assert batches_total - batches_together == SESSIONS * FRAMES  # alone: one step per batch
    assert size_sum == 2 * SESSIONS * FRAMES
    for seed, mine, solo in zip(seeds, together, alone, strict=True):
        assert len(set(solo)) == FRAMES, "every frame's reply differs: the comparison has something to catch"
        for index, (a, b) in enumerate(zip(mine, solo, strict=True)):
            assert a == b, f"{name}: session seed {seed}, frame {index}: the batched reply differs from solo"


async def run_ahead(channel, load, frames: int, seed: int) -> list[bytes]:
    """A session that sends all its frames before reading any reply (as a client sending ahead does)."""
    rng = np.random.default_rng(seed)
    call = getattr(load.stub(channel), load.method)()
    await call.write(load.open)
    await call.read()
    for index in range(frames):
        await call.write(load.frame(index, rng))
    await call.done_writing()
    return [(await call.read()).SerializeToString(deterministic=True) for _ in range(frames)]


@pytest.mark.parametrize("name", ["perception", "llm", "tts", "codec"])
def test_streams_read_ahead_keep_each_sessions_replies_in_order_and_equal_to_its_solo_run(tiny_checkpoint, name):
    config = VoiceChatConfig.load(tiny_checkpoint)
    seeds = [11, 22, 33]

    async def scenario():
        async with served(name, tiny_checkpoint, "--read-ahead", "2") as (address, servicer):
            assert servicer.batcher.read_ahead == 2
            load = workload(name, config, servicer.engine.prompt_frames if name == "tts" else 0)
            async with grpc.aio.insecure_channel(address) as channel:
                ahead = await asyncio.gather(*(run_ahead(channel, load, FRAMES, seed) for seed in seeds))
                alone = [await run_alone(channel, load, FRAMES, seed) for seed in seeds]
            return ahead, alone

    ahead, alone = asyncio.run(scenario())
    for seed, mine, solo in zip(seeds, ahead, alone, strict=True):
        assert len(set(solo)) == FRAMES
        assert mine == solo, f"{name}: session seed {seed}: a reply read ahead differs from its solo run's"


def test_max_batch_one_runs_every_step_alone(tiny_checkpoint):
    config = VoiceChatConfig.load(tiny_checkpoint)

    async def scenario():
        async with served("codec", tiny_checkpoint, "--max-batch", "1") as (address, servicer):
            assert servicer.batcher.max_batch == 1
            load = workload("codec", config)
            async with grpc.aio.insecure_channel(address) as channel:
                await asyncio.gather(*(run_alone(channel, load, 4, seed) for seed in (1, 2, 3)))
            return (servicer.metrics.value("voicechat_batch_size_count"),
                    servicer.metrics.value("voicechat_batch_size_sum"))

    assert asyncio.run(scenario()) == (12, 12)


def test_the_step_log_has_a_line_per_batched_step(tiny_checkpoint, tmp_path):
    from services.common.steplog import read_steps

    config = VoiceChatConfig.load(tiny_checkpoint)
    path = tmp_path / "codec-steps.jsonl"

    async def scenario():
        async with served("codec", tiny_checkpoint, "--step-log", str(path)) as (address, servicer):
            load = workload("codec", config)
            async with grpc.aio.insecure_channel(address) as channel:
                await asyncio.gather(*(run_alone(channel, load, 4, seed) for seed in (1, 2, 3)))
            return (servicer.metrics.value("voicechat_batch_size_count"),
                    servicer.metrics.value("voicechat_batch_size_sum"))

    batches, steps = asyncio.run(scenario())
    logged = read_steps(path)
    assert len(logged) == batches and sum(step["size"] for step in logged) == steps == 12
    assert all(a["end"] <= b["start"] for a, b in zip(logged, logged[1:], strict=False))  # one engine thread


def test_bad_batching_flags_are_usage_errors(tiny_checkpoint, capsys):
    parser = build_parser("services.codec", "")
    with pytest.raises(SystemExit):
        parse_args(parser, ["--model", str(tiny_checkpoint), "--max-batch", "0"])
    assert "--max-batch 0: must be at least 1" in capsys.readouterr().err
    for flag, value, message in (("--batch-wait-ms", "-1", "must be at least 0 and under 1000"),
                                 ("--batch-wait-ms", "1000", "must be at least 0 and under 1000"),
                                 ("--precompile-batches", "-2", "must be zero or more"),
                                 ("--read-ahead", "-1", "must be 0..16"), ("--read-ahead", "17", "must be 0..16")):
        with pytest.raises(SystemExit):
            parse_args(parser, ["--model", str(tiny_checkpoint), flag, value])
        assert f"{flag} {float(value) if flag == '--batch-wait-ms' else value}: {message}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(parser, ["--model", str(tiny_checkpoint), "--step-log", "/no/such/dir/steps.jsonl"])
    assert "--step-log /no/such/dir/steps.jsonl: no such directory /no/such/dir" in capsys.readouterr().err
    assert isinstance(parse_args(parser, ["--model", str(tiny_checkpoint)]), argparse.Namespace)


def test_sessions_opening_together_feed_their_prompts_in_shared_batches(tiny_checkpoint):
    """Language prompts and speech prefixes are fed a row (a pad step) per batch, with whatever else is due:
    three sessions opening at once share those batches, and each gets what it gets opening alone (its open
    reply and its first steps' replies, byte for byte). With the language model's prompts kept (its default),
    the sessions opening after the first of each prompt feed nothing and get the same replies."""
    from protos.voicechat.v1 import language_pb2, language_pb2_grpc, speech_pb2, speech_pb2_grpc
    from services.common.tensors import to_proto_np

    config = VoiceChatConfig.load(tiny_checkpoint)
    prompts = [[1, 17, 42, 99, 23, 2], [1, 5, 6, 7, 2], [1, 8, 9, 10, 11, 12, 13, 2]]

    def llm_open(ids):
        return language_pb2.LanguageStreamRequest(open=language_pb2.LanguageOpen(
            prompt_token_ids=ids, prefix_precision=language_pb2.PREFIX_PRECISION_BFLOAT16))

    def batches(servicer):
        return (servicer.metrics.value("voicechat_batch_size_count") or 0,
                servicer.metrics.value("voicechat_batch_size_sum") or 0)

    async def opened_replies(stub_type, method, opens, servicer, together, load):
        """Every reply, and the mean batch size while the sessions opened (None: no batch ran)."""
        before = batches(servicer)
        async with grpc.aio.insecure_channel(address) as channel:
            calls = [getattr(stub_type(channel), method)() for _ in opens]
            gate = threading.Event()
            if together:
                servicer.engine_thread.submit(gate.wait, 30)
            for call, message in zip(calls, opens, strict=True):
                await call.write(message)
                if not together:
                    replies.append((await call.read()).SerializeToString(deterministic=True))
            gate.set()
            if together:
                for call in calls:
                    replies.append((await call.read()).SerializeToString(deterministic=True))
            after = batches(servicer)
            for k, call in enumerate(calls):  # then each session's first steps: its state after the open
                rng = np.random.default_rng(k)
                for index in range(3):
                    await call.write(load.frame(index, rng))
                    replies.append((await call.read()).SerializeToString(deterministic=True))
                await call.done_writing()
        return (after[1] - before[1]) / (after[0] - before[0]) if after[0] != before[0] else None

    async def scenario(name, stub_type, method, make_opens, prompts_kept=True):
        nonlocal address, replies
        out = {}
        async with served(name, tiny_checkpoint) as (address, servicer):
            if not prompts_kept:
                servicer.engine.prompts_kept = 0
            opens = make_opens(servicer)
            load = workload(name, config, servicer.engine.prompt_frames if name == "tts" else 0)
            for together in (False, True):
                replies = []
                mean = await opened_replies(stub_type, method, opens, servicer, together, load)
                out[together] = (replies, mean)
        return out

    address, replies = "", []
    llm = asyncio.run(scenario("llm", language_pb2_grpc.LanguageServiceStub, "Stream",
                               lambda servicer: [llm_open(ids) for ids in prompts], prompts_kept=False))
    assert llm[True][0] == llm[False][0]  # the same open replies (prompt rows, positions) and first steps
    assert llm[False][1] == 1.0 and llm[True][1] > 1.5  # alone: one row per batch; together: shared batches
    kept = asyncio.run(scenario("llm", language_pb2_grpc.LanguageServiceStub, "Stream",
                                lambda servicer: [llm_open(ids) for ids in prompts]))
    assert kept[False][0] == kept[True][0] == llm[False][0]
    assert kept[False][1] == 1.0 and kept[True][1] is None  # the second opening of each prompt fed nothing

    def speech_opens(servicer):
        prompt = np.zeros((servicer.engine.prompt_frames, config.tts_config.num_quantizers), np.int32)
        prompt[[0, -1]] = config.tts_config.codebook_size
        return [speech_pb2.SpeechStreamRequest(open=speech_pb2.SpeechOpen(seed=seed, prompt_codes=to_proto_np(prompt),
                                                                          prefix_steps=steps))
                for seed, steps in ((1, 6), (2, 4), (3, 9))]

    tts = asyncio.run(scenario("tts", speech_pb2_grpc.SpeechServiceStub, "Stream", speech_opens))
    assert tts[True][0] == tts[False][0]
    assert tts[False][1] == 1.0 and tts[True][1] > 1.5


def test_sessions_opening_together_with_one_new_prompt_feed_it_once(tiny_checkpoint):
    """Four language sessions open at once with a prompt the engine has not kept: one feeds it, a row per batch,
    the others wait and take copies of the caches it leaves. Every open reply and first step equals, byte for
    byte, that of a session that fed the prompt alone with prompts not kept. Should the feeding session go away
    before its prompt is fed, the next one feeds its own and the rest take its caches."""
    from protos.voicechat.v1 import language_pb2, language_pb2_grpc

    config = VoiceChatConfig.load(tiny_checkpoint)
    ids = [1, 31, 41, 59, 26, 53, 58, 97, 93, 2]
    opening = language_pb2.LanguageStreamRequest(open=language_pb2.LanguageOpen(
        prompt_token_ids=ids, prefix_precision=language_pb2.PREFIX_PRECISION_BFLOAT16))

    async def replies(call, load) -> list[bytes]:
        got = [(await call.read()).SerializeToString(deterministic=True)]
        rng = np.random.default_rng(0)  # every session the same frames: each must answer as one alone
        for index in range(2):
            await call.write(load.frame(index, rng))
            got.append((await call.read()).SerializeToString(deterministic=True))
        await call.done_writing()
        return got

    async def scenario(kept: bool, sessions: int, leaver: bool = False):
        """Each session's replies, and the prompt rows the engine fed meanwhile (counted at prefill_batch)."""
        async with served("llm", tiny_checkpoint) as (address, servicer):
            engine = servicer.engine
            engine.prompts_kept = 4 if kept else 0
            fed = []
            prefill = engine.prefill_batch
            engine.prefill_batch = lambda batch: (fed.append(len(batch)), prefill(batch))[1]
            load = workload("llm", config)
            async with grpc.aio.insecure_channel(address) as channel:
                stub = language_pb2_grpc.LanguageServiceStub(channel)
                first = stub.Stream() if leaver else None
                if leaver:  # opens first, feeds two rows, then goes away
                    await first.write(opening)
                    await _until(lambda: sum(fed) >= 2, "the first session's rows")
                gate = threading.Event()
                servicer.engine_thread.submit(gate.wait, 30)
                calls = [stub.Stream() for _ in range(sessions)]
                for call in calls:
                    await call.write(opening)
                if leaver:
                    first.cancel()
                await asyncio.sleep(0.2)  # every open reached the service
                gate.set()
                return await asyncio.gather(*(replies(call, load) for call in calls)), fed

    alone, fed_alone = asyncio.run(scenario(kept=False, sessions=1))
    assert sum(fed_alone) == len(ids)
    together, fed = asyncio.run(scenario(kept=True, sessions=4))
    assert sum(fed) == len(ids) and set(fed) == {1}  # one session's rows, one a batch
    assert all(r == alone[0] for r in together)
    unkept, fed_unkept = asyncio.run(scenario(kept=False, sessions=4))
    assert sum(fed_unkept) == 4 * len(ids) and all(r == alone[0] for r in unkept)
    left, fed_left = asyncio.run(scenario(kept=True, sessions=3, leaver=True))
    assert all(r == alone[0] for r in left)
    assert 2 + len(ids) <= sum(fed_left) < 2 * len(ids)  # the leaver's rows, then one session's whole prompt


async def run_snapshotted(channel, load, frames: list, at: int | None) -> tuple[bytes, list, list]:
    """One session sending every frame ahead, a snapshot request after frame `at` (None: none) among them; returns
    its open's reply, its frames' replies and the snapshot's parts."""
    call = getattr(load.stub(channel), load.method)()
    await call.write(load.open)
    opened = (await call.read()).SerializeToString(deterministic=True)
    for index, frame in enumerate(frames):
        await call.write(frame)
        if index == at:
            await call.write(type(load.open)(snapshot=snapshot_pb2.SnapshotRequest()))
    await call.done_writing()
    replies, parts = [], []
    while (reply := await call.read()) is not grpc.aio.EOF:
        if reply.WhichOneof("payload") == "snapshot":
            parts.append(reply.snapshot)
        else:
            replies.append(reply.SerializeToString(deterministic=True))
    return opened, replies, parts


async def run_restored(channel, load, parts: list, frames: list) -> tuple[bytes, list]:
    """A session restored from `parts`, then sent `frames`."""
    call = getattr(load.stub(channel), load.method)()
    opening = type(load.open)()
    opening.CopyFrom(load.open)
    opening.open.restore = True
    for message in (opening, *(type(load.open)(restore=part) for part in parts), *frames):
        await call.write(message)
    await call.done_writing()
    replies = []
    while (reply := await call.read()) is not grpc.aio.EOF:
        replies.append(reply.SerializeToString(deterministic=True))
    return replies[0], replies[1:]


@pytest.mark.parametrize("name", ["perception", "llm", "tts", "codec"])
def test_a_snapshot_among_batched_streams_read_ahead_changes_no_reply_and_restores_the_session(tiny_checkpoint,
                                                                                                name):
    config = VoiceChatConfig.load(tiny_checkpoint)
    at = 2  # the snapshot follows frame 2

    async def scenario():
        async with served(name, tiny_checkpoint, "--read-ahead", "2") as (address, servicer):
            load = workload(name, config, servicer.engine.prompt_frames if name == "tts" else 0)
            frames = {seed: [load.frame(i, rng) for rng in [np.random.default_rng(seed)] for i in range(FRAMES)]
                      for seed in (11, 22)}
            async with grpc.aio.insecure_channel(address) as channel:
                plain = [await run_snapshotted(channel, load, frames[seed], None) for seed in (11, 22)]
                taken = await asyncio.gather(*(run_snapshotted(channel, load, frames[seed], at if seed == 11 else None)
                                               for seed in (11, 22)))
                restored = await run_restored(channel, load, taken[0][2], frames[11][at + 1 :])
            return plain, taken, restored

    plain, taken, (opened, replies) = asyncio.run(scenario())
    assert [t[:2] for t in taken] == [p[:2] for p in plain]  # neither the session nor its neighbour disturbed
    assert taken[0][2][-1].last and not plain[0][2]
    assert opened == plain[0][0] and replies == plain[0][1][at + 1 :]
