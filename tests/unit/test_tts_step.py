"""The compiled frame step (services/tts/step.py) against the plain path it compiles, bit for bit.

The engine runs every frame, solo or batched, through `CompiledStep`; `EarTts.step` is the plain, uncompiled
path of one session. Twin sessions opened alike, one through each, must give equal codes and equal caches.
"""

import mlx.core as mx
import numpy as np
import pytest

import services.tts.engine as engine_module
from services.tts.engine import TTSEngine
from services.tts.prompt import warmup_codes


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> TTSEngine:
    return TTSEngine.load(tiny_checkpoint)


def _open(engine: TTSEngine, seed: int, prefix: int = 0):
    k = engine.config.tts_config.codebook_size
    encoded = np.random.default_rng(seed).integers(0, k, (engine.prompt_frames + 1, engine.num_quantizers))
    return engine.open_session(seed, warmup_codes(encoded, k), prefix)


def _plain_step(engine: TTSEngine, session, text_id: int) -> tuple[np.ndarray, np.ndarray]:
    """`TTSSession.step` through the uncompiled model path."""
    if text_id == engine.config.eos_token_id:
        session.previous = engine.silence_codes[None, None, :]
    codes = engine.model.step(session.previous, text_id, engine.table, session.caches, session.rng)
    clean = engine.clean(codes)
    mx.eval(codes, clean)
    session.previous = codes
    session.steps += 1
    return np.array(codes[0, 0]), np.array(clean[0, 0])


def _assert_caches_equal(mine, theirs) -> None:
    for a, b in zip(mine.caches, theirs.caches, strict=True):
        assert (a.offset, getattr(a, "slot", None)) == (b.offset, getattr(b, "slot", None))
        np.testing.assert_array_equal(np.array(a.keys), np.array(b.keys))
        np.testing.assert_array_equal(np.array(a.values), np.array(b.values))


def _ids(engine: TTSEngine, count: int, seed: int) -> list[int]:
    ids = [int(t) for t in np.random.default_rng(seed).integers(0, engine.config.text_config.vocab_size, count)]
    ids[5] = ids[9] = engine.config.eos_token_id
    for n in range(12, min(count, 20)):  # repeated ids reuse their kept text rows
        ids[n] = engine.config.pad_token_id
    return ids


def test_compiled_frames_equal_the_plain_step_past_the_ring_window(engine):
    window = engine.config.tts_config.sliding_window
    compiled, plain = _open(engine, 3), _open(engine, 3)
    steps = window + 20 - compiled.caches[0].offset  # the sliding rings wrap
    for text_id in _ids(engine, steps, 0):
        got, want = compiled.step(text_id), _plain_step(engine, plain, text_id)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert compiled.caches[0].offset > window and compiled.caches[0].slot < window
    np.testing.assert_array_equal(np.array(compiled.previous), np.array(plain.previous))
    np.testing.assert_array_equal(np.array(compiled.rng.next_key()), np.array(plain.rng.next_key()))
    _assert_caches_equal(compiled, plain)


@pytest.mark.parametrize("stack_up_to", [0, 60, 10**9])
def test_compiled_batches_equal_plain_solo_steps(engine, monkeypatch, stack_up_to):
    """Three sessions of different lengths batched (caches read in place, some stacked, all stacked), one
    sitting frames out: each equals its plain solo twin."""
    monkeypatch.setattr(engine, "stack_up_to", stack_up_to)
    prefixes = [0, 8, 20]
    batched = [_open(engine, 40 + i, p) for i, p in enumerate(prefixes)]
    plain = [_open(engine, 40 + i, p) for i, p in enumerate(prefixes)]
    ids = [_ids(engine, 24, i) for i in range(3)]
    done = [0, 0, 0]
    for frame in range(26):
        due = [i for i in range(3) if done[i] < 24 and not (i == 1 and frame in (3, 4))]
        results = engine.step_batch([(batched[i], ids[i][done[i]]) for i in due])
        for i, result in zip(due, results, strict=True):
            want = _plain_step(engine, plain[i], ids[i][done[i]])
            np.testing.assert_array_equal(result[0], want[0])
            np.testing.assert_array_equal(result[1], want[1])
            done[i] += 1
    for mine, theirs in zip(batched, plain, strict=True):
        _assert_caches_equal(mine, theirs)


def test_text_rows_are_each_ids_own_embedding_and_stay_bounded(engine, monkeypatch):
    monkeypatch.setattr(engine_module, "TEXT_ROWS_KEPT", 3)
    monkeypatch.setattr(engine, "_text_rows", type(engine._text_rows)())
    encoder = engine.model.embed_subword

    def own(text_id: int) -> np.ndarray:
        return np.array(encoder.embed_known(mx.array([[text_id]]), [text_id], [True], engine.table).astype(mx.float32))

    ids = [7, 300, 7, engine.config.eos_token_id]
    got = engine.text_rows(ids)
    assert got.shape == (4, 1, engine.config.tts_config.hidden_size)
    for n, text_id in enumerate(ids):
        np.testing.assert_array_equal(np.array(got[n : n + 1].astype(mx.float32)), own(text_id))
    assert list(engine._text_rows) == [300, 7, engine.config.eos_token_id]  # least recently used first
    engine.text_rows([5, 5])
    assert list(engine._text_rows) == [7, engine.config.eos_token_id, 5]
    np.testing.assert_array_equal(np.array(engine.text_rows([5]).astype(mx.float32)), own(5))


def test_grouped_caches_equal_plain_solo_steps_through_wraps_regroups_and_solo_steps(engine, monkeypatch):
    """Sessions stepping together keep each layer's caches as rows of one group (one write per layer, no
    copies). Through their sliding rings wrapping inside the group, a session sitting two frames out (the others
    step as some of the group's members, the group kept), a solo step between batches (one member stepping) and
    a new session joining (the group re-formed), every code and, at the end, every cache equals each session's
    plain solo twin."""
    from services.common import cache as backbone

    monkeypatch.setattr(engine, "stack_up_to", 10**9)
    counts = {"formed": 0, "stepped": 0, "some": 0}
    form, step = backbone.LayerGroup.__init__, backbone.LayerGroup.step

    def formed(self, *args):
        counts["formed"] += 1
        form(self, *args)

    def stepped(self, q, k, v, plans, scale, index=None):
        counts["stepped"] += 1
        counts["some"] += index is not None and len(plans) < len(self.members)
        return step(self, q, k, v, plans, scale, index)

    monkeypatch.setattr(backbone.LayerGroup, "__init__", formed)
    monkeypatch.setattr(backbone.LayerGroup, "step", stepped)
    window = engine.config.tts_config.sliding_window
    batched = [_open(engine, 60 + i, 4 * i) for i in range(3)]
    plain = [_open(engine, 60 + i, 4 * i) for i in range(3)]
    frames = window + 12
    ids = [_ids(engine, frames + 4, 10 + i) for i in range(4)]
    done = [0, 0, 0]
    for frame in range(frames):
        if frame == frames - 8:  # a new session joins the batch
            batched.append(_open(engine, 63, 0))
            plain.append(_open(engine, 63, 0))
            done.append(0)
        due = [i for i in range(len(batched)) if not (i == 1 and frame in (7, 8))]
        if frame == 20:  # session 2 steps alone, then rejoins
            got = batched[2].step(ids[2][done[2]])
            want = _plain_step(engine, plain[2], ids[2][done[2]])
            np.testing.assert_array_equal(got[0], want[0])
            done[2] += 1
        results = engine.step_batch([(batched[i], ids[i][done[i]]) for i in reversed(due)])  # any order
        for i, result in zip(reversed(due), results, strict=True):
            want = _plain_step(engine, plain[i], ids[i][done[i]])
            np.testing.assert_array_equal(result[0], want[0])
            np.testing.assert_array_equal(result[1], want[1])
            done[i] += 1
    layers = len(engine.model.backbone.layers)
    assert counts["stepped"] > (frames - 12) * layers  # most frames wrote every layer's group in place
    # formed at the start and when the new session joined: the session sitting out two frames and the solo step
    # left the group as it was, the others (or the one) stepping as some of its members
    assert counts["formed"] == 2 * layers
    assert counts["some"] == 3 * layers
    assert batched[0].caches[0].offset > window and batched[0].caches[0].group is not None
    for mine, theirs in zip(batched, plain, strict=True):
        _assert_caches_equal(mine, theirs)


def test_precompile_steps_some_of_a_group_at_each_smaller_size(engine, monkeypatch):
    """At load, after full batches of every size, some of the last batch's sessions step at each size below it
    with their group kept: the partial steps' kernels are built before a client's frame needs them."""
    from services.common import cache as backbone

    monkeypatch.setattr(engine, "stack_up_to", 10**9)
    sizes = []
    step = backbone.LayerGroup.step

    def stepped(self, q, k, v, plans, scale, index=None):
        if index is not None and len(plans) < len(self.members):
            sizes.append(len(plans))
        return step(self, q, k, v, plans, scale, index)

    monkeypatch.setattr(backbone.LayerGroup, "step", stepped)
    engine.precompile(4, steps=2)
    layers = len(engine.model.backbone.layers)
    assert sizes == [3] * layers + [2] * layers + [1] * layers


def test_precompile_steps_words_of_every_character_count(engine, monkeypatch):
    """A precompile of pads alone encodes one id's characters (the pad's) and gives every session the same row:
    a client's first words would then run the character encoder at other lengths and gather distinct rows by
    id while its frame waits. A step of words ends the precompile: each character count's word encoded, one
    word twice (rows gathered by id), their rows kept as any step's are."""
    from services.common import cache
    from services.tts.subword import CharAwareSubwordEncoder

    encoded, gathered = [], []
    encode = CharAwareSubwordEncoder.encode_chars

    def counted(self, chars, lengths):
        encoded.append(tuple(chars.shape))
        return encode(self, chars, lengths)

    def take_index(index):
        gathered.append(index)
        return cache.take_index(index)

    monkeypatch.setattr(CharAwareSubwordEncoder, "encode_chars", counted)
    monkeypatch.setattr(engine_module, "take_index", take_index)
    monkeypatch.setattr(engine, "_text_rows", type(engine._text_rows)())
    engine.precompile(4, steps=1)
    words = engine._words(3)
    lengths = [len(engine.table.subword_chars[i]) for i in words]
    assert len(set(lengths)) == 3 and lengths == sorted(lengths)  # the tiny vocabulary has three counts at least
    assert {(1, n) for n in lengths} <= set(encoded)
    assert gathered == [(0, 1, 2, 0)]  # the only step whose ids differ: the four sessions' words, the first twice
    assert set(words) <= set(engine._text_rows)
    for text_id in words:  # the rows kept are each id's own
        want = engine.model.embed_subword.embed_rows([text_id], engine.table)
        assert mx.array_equal(engine._text_rows[text_id], want).item()


def test_precompile_stacks_sessions_opening_together_at_each_size(engine, monkeypatch):
    """Sessions opening in the same tick stack their fresh caches into a group at their first batched step, and
    a second wave's sessions join the first wave's group a step later: precompile forms both at every size (the
    group's concatenations of that many caches) before a client's first frame does."""
    from services.common import cache

    monkeypatch.setattr(engine, "stack_up_to", 10**9)
    formed = []
    init = cache.LayerGroup.__init__

    def counted(self, caches, per):
        formed.append((len(caches), all(cache.copied_from() is not None for cache in caches)))
        return init(self, caches, per)

    monkeypatch.setattr(cache.LayerGroup, "__init__", counted)
    engine.precompile(4, steps=1)
    layers = len(engine.model.backbone.layers)
    # the sizes grown one at a time; then at each size all fresh, and half of them with the other half joining
    assert [size for size, _ in formed[::layers]] == [2, 3, 4] + [2, 2] + [3, 3] + [4, 2, 4]
    assert len(formed) == 10 * layers
    # fresh sessions only (copies of one warm-up, stacked as it tiled), then groups joined by others
    assert [tiled for _, tiled in formed[::layers]] == [False] * 3 + [True, False] * 2 + [True, True, False]
