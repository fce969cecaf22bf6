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
from services.common import cache as cache_module
from services.common.batching import SnapshotAsk, raise_first
from services.common.cache import STACK_ALL, Bound, FullCache, RingCache
from services.common.snapshot import Held, Marks, Slices, Snapshot, capture, pack, take_snapshot
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


# ---- deltas ---------------------------------------------------------------------------------------------------


def test_held_merges_a_whole_snapshot_then_deltas_of_hand_built_arrays():
    keys = np.arange(1 * 2 * 3 * 2, dtype=np.float32).reshape(1, 2, 3, 2)
    bits = np.array([[0x3F80, 0xC040]], np.uint16)  # bfloat16 1.0 and -3.0, as bits
    held = Held()
    assert held.apply(pack({"keys": keys, "bf": (bits, True), "n": np.asarray(3), "gone": "x"}, snapshot_id=7))
    assert (held.id, held.nbytes) == (7, keys.nbytes + bits.nbytes + 8 + 1)

    # grown along axis 2 from 3 to 5 positions, slots 3 and 4 written; "bf" and "n" whole; "gone" gone
    new = np.full((1, 2, 2, 2), -1.0, np.float32)
    delta = pack({"keys": Slices(2, 5, [(3, new)]), "bf": (bits[:, ::-1].copy(), True), "n": np.asarray(5)}, 9, 9, 7)
    assert held.apply(delta) and held.id == 9
    state = Snapshot.from_parts(held.parts())
    assert np.array_equal(state.numpy("keys"), np.concatenate([keys, new], axis=2))
    assert state.numpy("bf").tolist() == [[-3.0, 1.0]] and state.int("n") == 5 and not state.has("gone")

    # a ring's wrap: two runs, slot 4 then slots 0-1, the length unchanged; the first slots kept as they were
    a, b = np.full((1, 2, 1, 2), 7.0, np.float32), np.full((1, 2, 2, 2), 8.0, np.float32)
    assert held.apply(pack({"keys": Slices(2, 5, [(0, b), (4, a)]), "bf": (bits, True), "n": np.asarray(6)}, 9, 11, 9))
    got = Snapshot.from_parts(held.parts(part_bytes=16)).numpy("keys")  # parts of 16 B: arrays in pieces
    assert got[0, 0, :, 0].tolist() == [8.0, 8.0, keys[0, 0, 2, 0], -1.0, 7.0]

    # a cut: the array's length along axis 2 down to 2, nothing written
    empty = np.zeros((1, 2, 0, 2), np.float32)
    assert held.apply(pack({"keys": Slices(2, 2, [(2, empty)]), "bf": (bits, True), "n": np.asarray(7)}, 9, 12, 11))
    assert Snapshot.from_parts(held.parts()).numpy("keys").tolist() == b.tolist()


def test_a_delta_that_does_not_fit_changes_nothing():
    held = Held()
    assert held.apply(pack({"keys": np.zeros((1, 2, 3, 2), np.float32), "n": np.asarray(1)}, snapshot_id=7))
    before = [(p.SerializeToString()) for p in held.parts()]
    ok = np.ones((1, 2, 1, 2), np.float32)
    assert not held.apply(pack({"keys": Slices(2, 4, [(3, ok)]), "n": np.asarray(2)}, 9, 8, 6))  # another base
    for bad in (Slices(2, 4, [(3, np.ones((1, 3, 1, 2), np.float32))]),  # another head count
                Slices(2, 4, [(3, ok.astype(np.int32))]),  # another dtype
                Slices(2, 4, [(4, ok)])):  # past its length
        with pytest.raises(ValueError, match="'keys': a slice that does not fit the held array"):
            held.apply(pack({"n": np.asarray(2), "keys": bad}, 9, 8, 7))  # "n" checked first, changed neither
    with pytest.raises(ValueError, match="'new' is a slice of an array the base does not hold"):
        held.apply(pack({"new": Slices(2, 4, [(3, ok)])}, 9, 8, 7))
    assert [p.SerializeToString() for p in held.parts()] == before and held.id == 7
    with pytest.raises(ValueError, match="a restore takes a whole snapshot, not a delta"):
        Snapshot.from_parts(pack({"keys": Slices(2, 4, [(3, ok)])}, 9, 8, 7))


class Keeper:
    """What a client holds of one session's snapshots, each asked against the last one it holds (as a
    ReplayStream does): the merged state, and each snapshot's parts as they crossed."""

    def __init__(self):
        self.held, self.marks, self.taken = Held(), Marks(), []

    def take(self, session) -> list:
        taken = take_snapshot(session, SnapshotAsk(self.held.id, self.marks))
        parts = [type(p).FromString(p.SerializeToString()) for p in pack(taken.held, PART, taken.id, taken.base)]
        assert self.held.apply(parts)
        self.taken.append(parts)
        return parts

    def snapshot(self) -> Snapshot:
        return Snapshot.from_parts(self.held.parts(PART))


def sliced_bytes(parts) -> tuple[int, int]:
    """(array bytes sent as slices, array bytes sent whole) of a snapshot's parts."""
    sliced = sum(len(e.tensor.data) for p in parts for e in p.entries if e.HasField("slice"))
    return sliced, sum(len(e.tensor.data) for p in parts for e in p.entries) - sliced


def _state_bits(state: Snapshot, names) -> list[bytes]:
    return [state.numpy(name).tobytes() for name in names]


@pytest.mark.parametrize("make, prompt, every", [
    (lambda: FullCache(), 5, 37),  # grows at 256 and 512 keys
    (lambda: FullCache(), 5, 1),  # a snapshot every key
    (lambda: FullCache(Bound(keep=5, window=40)), 5, 7),  # past the bound, its ring wrapping
    (lambda: FullCache(Bound(keep=5, window=40)), 5, 45),  # more keys than the ring holds: whole
    (lambda: RingCache(window=30), 10, 7),  # growing, then wrapping
    (lambda: RingCache(window=30), 40, 7),  # a prompt longer than the window: the first key trims (keys move)
], ids=["full", "full-each-key", "bounded", "bounded-past-the-ring", "ring", "ring-trimmed"])
def test_a_cache_merged_from_deltas_equals_its_whole_snapshot_and_each_delta_is_the_keys_since(make, prompt, every):
    cache, keeper = make(), Keeper()
    per_key = 2 * (1 * 2 * 1 * 3) * 4  # keys and values, (1, 2, 1, 3) float32
    kv = mx.array(np.random.default_rng(0).standard_normal((1, 2, prompt, 3)).astype(np.float32))
    cache.update(kv, kv * 2)
    offset, moves = cache.offset, cache.moves
    for t in range(600 if isinstance(cache, FullCache) and cache.bound is None else 200):
        kv = mx.full((1, 2, 1, 3), float(t))
        cache.update(kv, -kv)
        if t % every:
            continue
        parts = keeper.take(cache)
        whole = Snapshot.from_parts(pack(capture(cache.snapshot()), PART))
        names = ("keys", "values", "offset", "capacity")
        assert _state_bits(keeper.snapshot(), names) == _state_bits(whole, names)
        written, held = cache.offset - offset, cache.held()
        sliced, _ = sliced_bytes(parts)
        if len(keeper.taken) > 1 and written < held and cache.moves == moves:
            assert parts[0].base and sliced == written * per_key
        else:  # the first, past a trim, or a ring passed whole
            assert sliced == 0
        offset, moves = cache.offset, cache.moves
    assert sum(bool(parts[0].base) for parts in keeper.taken) >= (len(keeper.taken) - 2 if every < 45 else 0)


DELTA_STEPS, EVERY, RESTORE_AT = 64, 8, 56
SMALL_GROW = 64  # caches grow 64 keys at a time here (256 on the services), so a few steps cross a growth


@pytest.mark.parametrize("grouped", [False, True], ids=["in-place", "layer-group"])
def test_a_speech_session_restored_from_merged_deltas_goes_on_exactly_and_each_delta_is_the_interval(
        tts, grouped, monkeypatch):
    """Snapshots of A every EVERY steps, each against the last: the ring layers wrap (48 keys), the global layer's
    buffer grows past 64 keys and then wraps past its bound (the prompt and the last 40 positions); restored from
    the merged state on a fresh engine, A's session answers as the undisturbed one."""
    engine, fresh = tts
    monkeypatch.setattr(cache_module, "GROW", SMALL_GROW)
    engine.stack_up_to = STACK_ALL if grouped else 0
    before, engine.max_context = engine.max_context, 40
    prompt = _speech_prompt(engine)
    ids = np.random.default_rng(0).integers(0, engine.config.text_config.vocab_size, (DELTA_STEPS, 2))
    try:
        runs = {}
        for keep in (False, True):
            a, b = engine.open_session(1, prompt, 2), engine.open_session(2, prompt, 0)
            keeper, codes, restored = Keeper(), [], None
            for t in range(DELTA_STEPS):
                if keep and t % EVERY == 0:
                    keeper.take(a)
                if keep and t == RESTORE_AT:
                    restored = TTSSession.restored(fresh, keeper.snapshot())
                results = engine.step_batch([(a, int(ids[t, 0])), (b, int(ids[t, 1]))])
                codes.append(np.stack(results[0]).tobytes())
                if restored is not None:
                    assert np.stack(restored.step(int(ids[t, 0]))).tobytes() == codes[-1], t
            runs[keep] = codes
    finally:
        engine.stack_up_to, engine.max_context = 0, before
    assert runs[True] == runs[False]  # the snapshots disturbed nothing
    global_layer = a.caches[-1]
    assert isinstance(global_layer, FullCache) and global_layer.bound.size < global_layer.offset  # wrapped
    assert global_layer.capacity > SMALL_GROW  # grown past its first block on the way
    # every delta: EVERY positions of keys and values (two rows, 4 heads of 32 float32) in each of the 6 layers,
    # whatever the session's age; the rest (counters, the random key, the codes fed back) the same each time
    tts_config = engine.config.tts_config
    per_position = 2 * 2 * tts_config.num_key_value_heads * tts_config.head_dim * 4 * tts_config.num_hidden_layers
    sizes = {sliced_bytes(parts) for parts in keeper.taken[1:]}
    assert all(parts[0].base for parts in keeper.taken[1:]) and len(keeper.taken) == DELTA_STEPS // EVERY
    assert len(sizes) == 1 and next(iter(sizes))[0] == EVERY * per_position
    assert next(iter(sizes))[1] < per_position  # the whole values: less than one position's keys
    # the state it completes: the ring layers' 48 positions, the global layer's 39 kept and 40 last, and the rest
    layer_positions = 5 * 48 + 39 + 40
    assert keeper.held.nbytes == layer_positions * per_position // tts_config.num_hidden_layers + next(iter(sizes))[1]


def test_a_language_session_restored_from_merged_deltas_goes_on_exactly_and_each_delta_is_the_interval(
        llm, monkeypatch):
    """Both sessions snapshotted every EVERY steps, each against the last, across the attention cache's growth past
    64 keys and its bound's wrap (the prompt and the last 70 positions); restored from the merged states on a fresh
    engine, they answer as the undisturbed ones (logits bit for bit), forced tool ids included."""
    engine, fresh = llm
    monkeypatch.setattr(cache_module, "GROW", SMALL_GROW)
    steps, restore_at = 88, 80
    forced = {7: 77, restore_at + 2: 78}
    before, engine.max_context = engine.max_context, 70
    hidden = engine.hidden_size
    audio = mx.array(np.random.default_rng(5).standard_normal((steps, 2, hidden)).astype(np.float32))
    try:
        runs = {}
        for keep in (False, True):
            sessions = [engine.open_session(prompt_token_ids=PROMPT, prefix_dtype="bfloat16", prefill=False)
                        for _ in range(2)]
            while sessions[0].prompt_pending:
                raise_first(engine.prefill_batch(sessions))
            keepers, out, restored = [Keeper(), Keeper()], [], []
            for t in range(steps):
                if keep and t % EVERY == 0:
                    for keeper, session in zip(keepers, sessions, strict=True):
                        keeper.take(session)
                if keep and t == restore_at:
                    restored = [fresh.open_session(prompt_token_ids=PROMPT, prefix_dtype="bfloat16", prefill=False,
                                                   restore=keeper.snapshot()) for keeper in keepers]
                for session in (sessions[0], *restored[:1]):
                    if t in forced:
                        session.force_function(forced[t])
                r = engine.step_batch([(s, audio[t, i], True, t) for i, s in enumerate(sessions)])[0]
                out.append((r.text_id, r.function_id, np.array(r.text_logits).tobytes()))
                if restored:
                    again = fresh.step_batch([(s, audio[t, i], True, t) for i, s in enumerate(restored)])[0]
                    assert (again.text_id, again.function_id, np.array(again.text_logits).tobytes()) == out[-1], t
            runs[keep] = out
            attention = next(c for c in sessions[0].caches if isinstance(c, FullCache))
            for session in (*sessions, *restored):
                session.model is engine.model and engine.close_session(session)
    finally:
        engine.max_context = before
    assert runs[True] == runs[False] and [runs[True][t][1] for t in forced] == list(forced.values())
    assert attention.bound.size < attention.offset and attention.capacity > SMALL_GROW  # grown, then wrapped
    text = engine.config.text_config
    per_position = 2 * text.num_key_value_heads * text.head_dim  # keys and values, elements
    sizes = [sliced_bytes(parts) for parts in keepers[0].taken]
    # bf16 keys (the bf16 prompt's buffer) until it grew past 64 keys and turned float32 (as the reference's does):
    # that snapshot sends the layer whole; every other delta EVERY positions, the Mamba states whole each time
    mamba = sizes[1][1]
    assert sizes[1:8] == [(EVERY * per_position * 2, mamba)] * 7 and sizes[8][0] == 0 and sizes[8][1] > mamba
    assert sizes[9:] == [(EVERY * per_position * 4, mamba)] * 2


def test_a_stream_answers_a_delta_only_against_the_last_snapshot_it_gave():
    cache, marks = FullCache(), Marks()
    for t in range(3):
        cache.update(mx.full((1, 1, 1, 2), float(t)), mx.full((1, 1, 1, 2), float(t)))
    first = take_snapshot(cache, SnapshotAsk(0, marks))
    assert first.base == 0 and first.id == marks.id != 0 and not isinstance(first.held["keys"], Slices)
    cache.update(mx.full((1, 1, 1, 2), 3.0), mx.full((1, 1, 1, 2), 3.0))
    assert take_snapshot(cache, SnapshotAsk(first.id + 1, marks)).base == 0  # another base: whole
    second = take_snapshot(cache, SnapshotAsk(marks.id, marks))
    # nothing written since the whole one before it: the keys as one empty run at their end
    assert second.base != 0 and second.held["keys"].length == 4 and second.held["keys"].runs[0][0] == 4
    assert [tuple(pin[0].shape) for _, pin in second.held["keys"].runs] == [(1, 1, 0, 2)]

    class Failing:  # a session whose snapshot fails midway, after its cache gave its mark
        def snapshot(self, since):
            cache.snapshot(since)
            raise ValueError("closed")

    with pytest.raises(ValueError, match="closed"):
        take_snapshot(Failing(), SnapshotAsk(second.id, marks))
    assert take_snapshot(cache, SnapshotAsk(second.id, marks)).base == 0  # no base after a failed one
