"""A service's MLX memory around bursts of sessions: what closed sessions held comes back, the buffer cache stays
under --cache-limit-mb, a second burst peaks no higher than the first, --memory-limit-mb lowers a burst's peak,
and `orchestrator serve` has its services batch as many sessions as it admits.

The speech engine stacks every session's attention keys here as it does on a GPU (`STACK_ALL`; on the CPU it
reads them in place), so the grouped path's copies are what is measured.
"""

import mlx.core as mx
import numpy as np
import pytest

from bench.service import BurstMemory, EngineDriver, run_burst
from bench.stages import EvalSplit
from orchestrator import cli as orchestrator_cli
from orchestrator.connect import batch_flags
from services.common import cli
from services.common.batching import DEFAULT_MAX_BATCH
from services.common.cache import STACK_ALL
from services.common.config import VoiceChatConfig
from services.tts.engine import TTSEngine

MIB = 1 << 20
CACHE_LIMIT_MB = 4.0
SESSIONS = 8
FRAMES = 12


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> TTSEngine:
    engine = TTSEngine.load(tiny_checkpoint)
    engine.stack_up_to = STACK_ALL
    engine.precompile(SESSIONS)
    return engine


@pytest.fixture
def limits():
    """MLX's cache and memory limits are the process's: restored after the test."""
    cache, memory = mx.set_cache_limit(1 << 40), mx.set_memory_limit(1 << 40)
    mx.set_cache_limit(cache)
    mx.set_memory_limit(memory)
    yield
    mx.set_cache_limit(cache)
    mx.set_memory_limit(memory)


def _burst(engine: TTSEngine, sessions: int = SESSIONS) -> tuple[BurstMemory, int, int]:
    """`sessions` sessions opened, stepped FRAMES frames as one batch, closed -> (memory, bytes of their attention
    caches at the end, of the largest layer's caches over all sessions)."""
    prompt = np.random.default_rng(0).integers(0, engine.config.tts_config.codebook_size,
                                               (engine.prompt_frames, engine.num_quantizers)).astype(np.int32)
    engine.warmed(prompt, 0)  # the prompt's kept warm-up is the engine's, as a running service's is: held before
    with BurstMemory() as memory:
        live = [engine.open_session(seed, prompt) for seed in range(sessions)]
        for frame in range(FRAMES):
            engine.step_batch([(session, 16 + frame) for session in live])
        memory.stepped()
        layers = [sum(c.keys.nbytes + c.values.nbytes for c in layer)
                  for layer in zip(*(s.caches for s in live), strict=True)]
        del live
    return memory, sum(layers), max(layers)


def test_a_burst_gives_back_what_its_sessions_held_and_keeps_a_bounded_cache(engine, limits):
    cli.apply_cache_limit(CACHE_LIMIT_MB)
    memory, caches, _ = _burst(engine)
    # the sessions held their attention caches (about 0.97 MiB each on the tiny model) and little besides
    assert caches * 0.99 <= memory.held <= caches * 1.05
    assert memory.held > SESSIONS * 0.9 * MIB
    # closed: active back to the idle level (the engine's few kept arrays: text rows, index arrays), cache bounded
    assert abs(memory.left) <= 0.02 * memory.held
    assert memory.cache <= CACHE_LIMIT_MB * MIB


def test_bursts_peak_at_their_caches_and_one_layers_stacking_every_time(engine, limits):
    cli.apply_cache_limit(CACHE_LIMIT_MB)
    for _ in range(3):  # nothing accumulates: every burst peaks under the same bound and gives all back
        memory, caches, layer = _burst(engine)
        # the first batched step stacks each layer's caches into one array (a copy of that layer, then the
        # sessions' own buffers freed): the caches, one layer's copy and a step's activations, not a copy of all.
        # On the CPU the peak varies by ~2 MiB from burst to burst (when a freed buffer returns is asynchronous)
        assert memory.peak <= caches + 1.25 * layer + 2 * MIB
        assert abs(memory.left) <= 0.02 * memory.held


def test_a_memory_limit_holds_a_bursts_peak_under_one_layers_stacking(engine, limits):
    cli.apply_cache_limit(CACHE_LIMIT_MB)
    free, _, _ = _burst(engine)
    cli.apply_memory_limit((mx.get_active_memory() + free.held) / MIB)  # just what the sessions hold
    for _ in range(2):
        bounded, caches, layer = _burst(engine)
        assert bounded.held == pytest.approx(free.held, rel=0.02)
        # evaluation waits for queued work to free its buffers once past the limit: measured caches + 0.75 layer,
        # every time (unbounded: up to caches + 1.35 layers)
        assert bounded.peak <= caches + 0.85 * layer


def test_the_memory_limit_flag_is_checked_and_applied(tmp_path, limits):
    parser = cli.build_parser("svc", "test")
    assert cli.parse_args(parser, ["--model", str(tmp_path)]).memory_limit_mb is None
    args = cli.parse_args(cli.build_parser("svc", "test"), ["--model", str(tmp_path), "--memory-limit-mb", "512"])
    assert args.memory_limit_mb == 512
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            cli.parse_args(cli.build_parser("svc", "test"), ["--model", str(tmp_path), "--memory-limit-mb", bad])
    cli.apply_memory_limit(512.0)
    assert mx.set_memory_limit(1 << 40) == 512 * MIB  # set_memory_limit returns the limit it replaces
    cli.apply_memory_limit(None)
    assert mx.set_memory_limit(1 << 40) == 1 << 40


def test_the_services_max_batch_follows_the_sessions_a_server_admits():
    flags = {"tts": ["--max-batch", "8"], "llm": [], "codec": []}
    got = batch_flags(flags, 64, {"tts": 1, "llm": 2, "codec": 3})
    assert got == {"tts": ["--max-batch", "64", "--max-batch", "8"],  # its own flag comes last: it wins
                   "llm": ["--max-batch", "32"], "codec": ["--max-batch", "22"]}  # a replica's share, rounded up
    assert batch_flags({"codec": []}, 4, {"codec": 1}) == {"codec": ["--max-batch", str(DEFAULT_MAX_BATCH)]}


def test_serve_starts_its_services_with_a_max_batch_of_every_session_it_admits(tiny_checkpoint, monkeypatch):
    started = {}

    class Started(Exception):
        pass

    def connect_streams(model, **connection):
        started.update(connection)
        raise Started

    monkeypatch.setattr(orchestrator_cli, "connect_streams", connect_streams)
    with pytest.raises(Started):
        orchestrator_cli.serve(orchestrator_cli.build_parser().parse_args(
            ["serve", "--model", str(tiny_checkpoint), "--max-sessions", "32", "--realtime-max-sessions", "8",
             "--service-flags", "codec=--max-batch=4"]))
    flags = started["flags"]
    assert flags["tts"] == ["--max-batch", "40"] and flags["llm"] == ["--max-batch", "40"]
    assert flags["codec"] == ["--max-batch", "40", "--max-batch=4"]
    assert cli.parse_args(cli.build_parser("codec", "test"), ["--model", str(tiny_checkpoint), *flags["codec"]]
                          ).max_batch == 4
    assert cli.parse_args(cli.build_parser("tts", "test"), ["--model", str(tiny_checkpoint), *flags["tts"]]
                          ).max_batch == 40


def test_opened_sessions_hold_their_caches_and_no_projection_behind_them(engine):
    prompt = np.zeros((engine.prompt_frames, engine.num_quantizers), np.int32)
    engine.warmed(prompt, 0)  # the engine's kept warm-up of the prompt, made before
    with BurstMemory() as memory:
        live = [engine.open_session(seed, prompt) for seed in range(SESSIONS)]
        mx.eval([a for s in live for c in s.caches for a in (c.keys, c.values)] + [s.previous for s in live])
        memory.stepped()
        caches = sum(c.keys.nbytes + c.values.nbytes for s in live for c in s.caches)
        del live
    # a ring cache filled by the prompt kept its values as a view of the fused q, k, v projection: 1.42 x caches
    assert caches <= memory.held <= caches * 1.01


@pytest.mark.parametrize("name", ["perception", "codec", "tts"])
def test_closed_sessions_leave_nothing_behind_before_any_next_step(tiny_checkpoint, name, limits):
    """The engines keep each session's rows of the last batch (`RowSources`) to gather the next without copies;
    once the sessions are gone, so is that batch (it was kept until the next step: 0.6 MiB for 16 codec streams)."""
    driver = EngineDriver(name, tiny_checkpoint, VoiceChatConfig.load(tiny_checkpoint))
    driver.precompile(SESSIONS)
    for _ in range(2):
        with BurstMemory() as memory:
            run_burst(driver, SESSIONS, 4, 0, 0, False, 0, None, EvalSplit(), memory)
        assert memory.held > 0.1 * MIB
        assert abs(memory.left) <= 0.01 * memory.held
