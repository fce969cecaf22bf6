"""Session snapshots: a session snapshotted mid-conversation and restored on a fresh engine answers every later step
exactly as the uninterrupted session does, and taking the snapshot changes nothing for it or its batch neighbours.

Each network runs two sessions batched together (A and B), A snapshotted after `AT` steps; the snapshot crosses as
parts of a few KiB (so its arrays span several parts) and is restored on an engine loaded afresh.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from protos.voicechat.v1 import tensor_pb2
from services.codec.engine import CodecEngine, DecodeStream
from services.common.batching import raise_first
from services.common.cache import STACK_ALL, Bound, FullCache, RingCache
from services.common.snapshot import Snapshot, capture, pack
from services.llm.engine import LanguageEngine
from services.perception.engine import PerceptionEngine, PerceptionStream
from services.tts.engine import TTSEngine, TTSSession
from services.tts.prompt import warmup_codes

STEPS, AT = 24, 14
PART = 4096  # small parts: arrays split over several


def crossed(session) -> Snapshot:
    """The session's snapshot as the wire carries it."""
    parts = pack(capture(session.snapshot()), PART)
    assert len(parts) > 1 and parts[-1].last
    return Snapshot.from_parts([type(p).FromString(p.SerializeToString()) for p in parts])


def test_parts_round_trip_every_dtype_bit_for_bit():
    arrays = {"f32": mx.array([1.5, -0.0, float("nan")]), "bf16": mx.array([[0.1, -3.0]], mx.bfloat16),
              "i32": mx.arange(3000, dtype=mx.int32), "u32": mx.array([2**32 - 1], mx.uint32)}
    state = {**arrays, "n": 7, "ids": [3, 1, 2], "text": "héllo"}
    parts = pack(capture(state), part_bytes=1000)  # the int32 array spans 12 parts
    assert len(parts) >= 12 and [p.last for p in parts].count(True) == 1
    snapshot = Snapshot.from_parts(parts)
    for name, want in arrays.items():
        got = snapshot.array(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array(got.view(mx.uint16) if want.dtype == mx.bfloat16 else got).tobytes() == \
            np.array(want.view(mx.uint16) if want.dtype == mx.bfloat16 else want).tobytes()
    assert (snapshot.int("n"), snapshot.ints("ids"), snapshot.text("text")) == (7, [3, 1, 2], "héllo")
    assert snapshot.scope("x").has("n") is False
    with pytest.raises(ValueError, match="'missing' is missing: it was not taken by this service"):
        snapshot.int("missing")
    with pytest.raises(ValueError, match="sent whole"):
        Snapshot.from_parts(parts[:-1])
    assert parts[0].entries[0].tensor.dtype == tensor_pb2.DTYPE_FLOAT32


def test_an_attention_cache_keeps_only_the_keys_it_holds_and_its_counters():
    full, ring = FullCache(), RingCache(window=4)
    for t in range(6):
        kv = mx.full((1, 2, 1, 3), float(t))
        full.update(kv, kv)
        ring.update(kv, kv)
    assert full.capacity == 256 and full.snapshot()["keys"].shape == (1, 2, 6, 3)
    state = ring.snapshot()
    assert (state["offset"], state["slot"], state["capacity"], state["keys"].shape) == (6, 2, 4, (1, 2, 4, 3))
    assert np.array(state["keys"])[0, 0, :, 0].tolist() == [4.0, 5.0, 2.0, 3.0]  # the ring's own slot order
    restored = RingCache(window=4)
    restored.restore(Snapshot.from_parts(pack(capture(state))))
    for cache in (ring, restored):
        cache.update(mx.full((1, 2, 1, 3), 6.0), mx.full((1, 2, 1, 3), 6.0))
    assert np.array_equal(np.array(ring.keys), np.array(restored.keys)) and restored.slot == ring.slot == 3


def test_a_bounded_cache_past_its_bound_restores_its_bound_and_ring_slots():
    bounded = FullCache(Bound(keep=2, window=3))
    for t in range(8):
        kv = mx.full((1, 1, 1, 2), float(t))
        bounded.update(kv, kv)
    state = bounded.snapshot()
    assert (state["offset"], state["keep"], state["window"], state["keys"].shape) == (8, 2, 3, (1, 1, 5, 2))
    restored = FullCache()  # the bound comes with the snapshot
    restored.restore(Snapshot.from_parts(pack(capture(state))))
    assert restored.bound == Bound(2, 3)
    for cache in (bounded, restored):
        seen = cache.update(mx.full((1, 1, 1, 2), 8.0), mx.full((1, 1, 1, 2), 8.0))[0]
    assert np.array(seen)[0, 0, :, 0].tolist() == [0.0, 1.0, 8.0, 6.0, 7.0]  # the kept prompt, the ring in slot order
    assert np.array_equal(np.array(bounded.keys), np.array(restored.keys))
    assert FullCache().snapshot() == {"offset": 0, "capacity": 0, "keep": -1, "window": -1}


# ---- speech ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tts(tiny_checkpoint):
    return TTSEngine.load(tiny_checkpoint), TTSEngine.load(tiny_checkpoint)


def _speech_prompt(engine: TTSEngine) -> np.ndarray:
    k = engine.config.tts_config.codebook_size
    encoded = np.random.default_rng(3).integers(0, k, (engine.prompt_frames + 1, engine.num_quantizers))
    return warmup_codes(encoded, k)


def _speech_run(engine: TTSEngine, fresh: TTSEngine, snapshot_at: int | None):
    """Codes of A and B stepped together; A's snapshot (taken after `snapshot_at` steps) restored on `fresh` and
    stepped alone from there. Returns (A's codes, B's codes, the restored session's codes)."""
    prompt = _speech_prompt(engine)
    a, b = engine.open_session(1, prompt, 2), engine.open_session(2, prompt, 0)
    ids = np.random.default_rng(0).integers(0, engine.config.text_config.vocab_size, (STEPS, 2))
    codes: dict[str, list] = {"a": [], "b": [], "restored": []}
    restored = None
    for t in range(STEPS):
        if t == snapshot_at:
            restored = TTSSession.restored(fresh, crossed(a))
        for name, result in zip("ab", engine.step_batch([(a, int(ids[t, 0])), (b, int(ids[t, 1]))]), strict=True):
            codes[name].append(np.stack(result).tobytes())
        if restored is not None:
            codes["restored"].append(np.stack(restored.step(int(ids[t, 0]))).tobytes())
    return codes


@pytest.mark.parametrize("grouped", [False, True], ids=["in-place", "layer-group"])
def test_a_speech_session_restored_from_a_snapshot_goes_on_exactly(tts, grouped):
    engine, fresh = tts
    engine.stack_up_to = STACK_ALL if grouped else 0  # grouped: the snapshot reads the caches' group rows
    try:
        plain = _speech_run(engine, fresh, None)
        taken = _speech_run(engine, fresh, AT)
    finally:
        engine.stack_up_to = 0
    assert taken["a"] == plain["a"] and taken["b"] == plain["b"]  # the snapshot disturbed no one
    assert taken["restored"] == plain["a"][AT:]


# ---- language -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LanguageEngine.load(tiny_checkpoint), LanguageEngine.load(tiny_checkpoint)


PROMPT = [1, 40, 41, 42, 2]
FORCED = {3: 77, 15: 78, 16: 79}  # tool responses read back on the function channel, around the snapshot


def _language_run(engine: LanguageEngine, fresh: LanguageEngine, snapshot_at: int | None):
    hidden = engine.hidden_size
    audio = mx.array(np.random.default_rng(5).standard_normal((STEPS, 2, hidden)).astype(np.float32))
    sessions = [engine.open_session(prompt_token_ids=PROMPT, prefix_dtype="bfloat16", prefill=False)
                for _ in range(2)]
    while sessions[0].prompt_pending:
        raise_first(engine.prefill_batch(sessions))
    out: dict[str, list] = {"a": [], "b": [], "restored": []}
    restored: list = []  # both restored, stepping batched as the originals do (batched logits may round apart)
    for t in range(STEPS):
        if t == snapshot_at:
            restored = [fresh.open_session(prompt_token_ids=PROMPT, prefix_dtype="bfloat16", prefill=False,
                                           restore=crossed(s)) for s in sessions]
        if t in FORCED:
            for session in (sessions[0], *restored[:1]):
                session.force_function(FORCED[t])
        results = engine.step_batch([(s, audio[t, i], True, t) for i, s in enumerate(sessions)])
        for name, r in zip("ab", results, strict=True):
            out[name].append((r.text_id, r.function_id, np.array(r.text_logits).tobytes()))
        if restored:
            r = fresh.step_batch([(s, audio[t, i], True, t) for i, s in enumerate(restored)])[0]
            out["restored"].append((r.text_id, r.function_id, np.array(r.text_logits).tobytes()))
    for session in (*sessions, *restored):
        session.model is engine.model and engine.close_session(session)
    return out


@pytest.mark.parametrize("max_context", [None, 6], ids=["unbounded", "past-its-bound"])
def test_a_language_session_with_forced_tool_ids_restored_from_a_snapshot_goes_on_exactly(llm, max_context):
    engine, fresh = llm
    before, engine.max_context = engine.max_context, max_context  # bounded: the prompt and the last 6 positions
    try:
        plain = _language_run(engine, fresh, None)
        taken = _language_run(engine, fresh, AT)
    finally:
        engine.max_context = before
    assert taken["a"] == plain["a"] and taken["b"] == plain["b"]
    assert taken["restored"] == plain["a"][AT:]
    assert [plain["a"][t][1] for t in FORCED] == list(FORCED.values())


def test_a_language_snapshot_refuses_another_prompt(llm):
    engine, fresh = llm
    session = engine.open_session(prompt_token_ids=PROMPT)
    session.step(mx.zeros((engine.hidden_size,), mx.float32))
    with pytest.raises(ValueError, match="prompt of 5 positions, but the open message's prompt has 3"):
        fresh.open_session(prompt_token_ids=[1, 40, 2], restore=crossed(session))
    engine.close_session(session)


# ---- perception -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def perception(tiny_checkpoint):
    return PerceptionEngine.load(tiny_checkpoint), PerceptionEngine.load(tiny_checkpoint)


@pytest.mark.parametrize("at", [5, AT], ids=["caches-filling", "caches-full"])
def test_a_perception_session_restored_from_a_snapshot_goes_on_exactly(perception, at):
    engine, fresh = perception
    wave = np.random.default_rng(9).standard_normal((STEPS, 2, engine.frame_samples)).astype(np.float32) * 0.1

    def run(snapshot_at):
        a, b = engine.open_stream(), engine.open_stream()
        out: dict[str, list] = {"a": [], "b": [], "restored": []}
        restored = None
        for t in range(STEPS):
            if t == snapshot_at:
                restored = PerceptionStream.restored(fresh, crossed(a))
            for name, f in zip("ab", engine.push_batch([(a, wave[t, 0]), (b, wave[t, 1])]), strict=True):
                out[name].append(_frame(f))
            if restored is not None:
                out["restored"].append(_frame(restored.push(wave[t, 0])))
        return out

    plain, taken = run(None), run(at)
    assert taken["a"] == plain["a"] and taken["b"] == plain["b"]
    assert taken["restored"] == plain["a"][at:]


def _frame(f) -> tuple:
    return (f.frame_index, np.array(f.audio_embedding).tobytes(), np.array(f.encoder_out).tobytes(), f.transcript,
            f.transcript_delta, tuple(f.token_ids))


# ---- codec ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def codec(tiny_checkpoint):
    return CodecEngine.load(tiny_checkpoint), CodecEngine.load(tiny_checkpoint)


def test_a_codec_stream_restored_from_a_snapshot_goes_on_exactly(codec):
    engine, fresh = codec
    codes = np.random.default_rng(4).integers(0, engine.codebook_size, (STEPS, 2, engine.num_quantizers))

    def run(snapshot_at):
        a, b = engine.open_stream(), engine.open_stream()
        out: dict[str, list] = {"a": [], "b": [], "restored": []}
        restored = None
        for t in range(STEPS):
            if t == snapshot_at:
                restored = DecodeStream.restored(fresh, crossed(a))
            for name, s in zip("ab", engine.decode_batch([(a, t, codes[t, 0]), (b, t, codes[t, 1])]), strict=True):
                out[name].append(s.tobytes())
            if restored is not None:
                out["restored"].append(restored.decode_frame(t, codes[t, 0]).tobytes())
        return out

    plain, taken = run(None), run(AT)
    assert taken["a"] == plain["a"] and taken["b"] == plain["b"]
    assert taken["restored"] == plain["a"][AT:]
