"""TTSEngine.step_batch: several sessions' frame steps as one forward, each session's codes and state its own.

Expected codes come from the reference's goldens (the solo path matches them exactly) or from solo runs of
identically opened sessions. Codes must be equal; float state (cache keys and the backbone's hidden states)
within FLOAT_ATOL of solo (on the CPU the measured difference is 0).
"""

import mlx.core as mx
import numpy as np
import pytest

from services.tts.engine import TTSEngine
from services.tts.prompt import warmup_codes
from services.tts.rng import BatchKeySequence, SessionKey, take_batch
from tests.conftest import load_golden

FLOAT_ATOL = 1e-5  # batched matmuls may round differently from 1-row ones; CPU measures 0.0


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> TTSEngine:
    return TTSEngine.load(tiny_checkpoint)


@pytest.fixture(scope="module")
def mixed_engine(tinymix_checkpoint) -> TTSEngine:
    return TTSEngine.load(tinymix_checkpoint)


def _prompt(engine: TTSEngine, seed: int) -> np.ndarray:
    k = engine.config.tts_config.codebook_size
    encoded = np.random.default_rng(seed).integers(0, k, (engine.prompt_frames + 1, engine.num_quantizers))
    return warmup_codes(encoded, k)


def _assert_same_state(got, want) -> None:
    """Two sessions opened alike and stepped alike (one batched, one solo) hold the same state."""
    assert got.steps == want.steps
    np.testing.assert_array_equal(np.array(got.previous), np.array(want.previous))
    np.testing.assert_array_equal(np.array(got.rng.next_key()), np.array(want.rng.next_key()))
    for mine, theirs in zip(got.caches, want.caches, strict=True):
        assert (mine.offset, getattr(mine, "slot", None)) == (theirs.offset, getattr(theirs, "slot", None))
        assert mine.keys.shape == theirs.keys.shape
        np.testing.assert_allclose(np.array(mine.keys), np.array(theirs.keys), rtol=0, atol=FLOAT_ATOL)
        np.testing.assert_allclose(np.array(mine.values), np.array(theirs.values), rtol=0, atol=FLOAT_ATOL)


def test_staggered_batches_reproduce_the_reference_goldens(engine):
    """Four golden timelines (seeds 0 and 7, a 15-frame prompt prefix, the online text) run together: starts
    staggered, a session skipping frames, one stepping solo for a while, one leaving early, batches of one."""
    names = ["offline", "offline_seed7", "offline_prompt", "online"]
    goldens = [load_golden(name) for name in names]
    prompt_codes = goldens[0][0]["prompt_codes"]
    starts = [0, 0, 3, 9]
    stop_after = [None, None, None, 30]  # the online session leaves early
    sessions: list = [None] * 4
    queues: list[list[int]] = []
    for data, meta in goldens:
        skip_first = meta["prompt_frames"] == 0  # position 0 has no step without a prefix
        queues.append([int(t) for t in data["text_tokens"][1 if skip_first else 0 :]])
    stop = [len(q) if n is None else n for q, n in zip(queues, stop_after, strict=True)]
    got: list[list] = [[] for _ in names]
    sizes = set()
    frame = 0
    while any(s is None or len(g) < n for s, g, n in zip(sessions, got, stop, strict=True)):
        for i, (_, meta) in enumerate(goldens):
            if frame == starts[i]:
                sessions[i] = engine.open_session(meta["seed"], prompt_codes, max(meta["prompt_frames"] - 1, 0))
        due = [i for i in range(4) if sessions[i] is not None and len(got[i]) < stop[i]
               and (frame + i) % 5 != 0 and not (i == 1 and 20 <= frame < 24)]
        if 20 <= frame < 24:  # session 1 steps solo between batched steps
            got[1].append(sessions[1].step(queues[1][len(got[1])]))
        results = engine.step_batch([(sessions[i], queues[i][len(got[i])]) for i in due])
        sizes.add(len(due))
        for i, result in zip(due, results, strict=True):
            assert not isinstance(result, Exception), result
            got[i].append(result)
        frame += 1
    assert {1, 2, 3, 4} <= sizes
    for (data, meta), codes, n in zip(goldens, got, stop, strict=True):
        first = 1 if meta["prompt_frames"] == 0 else 0
        clean = np.stack([c for _, c in codes])
        np.testing.assert_array_equal(clean, data["audio_codes"][first : first + n])
        if "audio_codes_raw" in data:
            np.testing.assert_array_equal(np.stack([r for r, _ in codes]), data["audio_codes_raw"][first : first + n])


def test_batched_quantized_sessions_equal_their_solo_runs_codes_and_state(mixed_engine):
    """Mixed-bit weights; eos resets the fed-back code per session; every session's state equals solo's."""
    engine = mixed_engine
    eos = engine.config.eos_token_id
    rng = np.random.default_rng(3)
    ids = [[int(t) for t in rng.integers(0, engine.config.text_config.vocab_size, 10)] for _ in range(3)]
    ids[0][4] = eos
    ids[2][1] = eos
    opened = [(11, 0), (12, 2), (13, 5)]  # (seed, prefix steps)

    def open_all():
        return [engine.open_session(seed, _prompt(engine, seed), prefix) for seed, prefix in opened]

    solo = open_all()
    want = [[session.step(t) for t in row] for session, row in zip(solo, ids, strict=True)]
    batched = open_all()
    got = [[] for _ in batched]
    for frame in range(12):
        due = [i for i in range(3) if frame >= i and len(got[i]) < len(ids[i])]
        for i, result in zip(due, engine.step_batch([(batched[i], ids[i][len(got[i])]) for i in due]), strict=True):
            got[i].append(result)
    for mine, theirs in zip(got, want, strict=True):
        assert len(mine) == len(theirs) == 10
        for (raw, clean), (raw_solo, clean_solo) in zip(mine, theirs, strict=True):
            assert raw.dtype == np.int32 and raw.shape == (engine.num_quantizers,)
            np.testing.assert_array_equal(raw, raw_solo)
            np.testing.assert_array_equal(clean, clean_solo)
    for mine, theirs in zip(batched, solo, strict=True):
        _assert_same_state(mine, theirs)


def test_a_batch_of_one_equals_the_sessions_own_step(engine):
    a, b = (engine.open_session(5, _prompt(engine, 5), 1) for _ in range(2))
    for text_id in (40, 41, engine.config.eos_token_id, 42):
        [(raw, clean)] = engine.step_batch([(a, text_id)])
        raw_solo, clean_solo = b.step(text_id)
        np.testing.assert_array_equal(raw, raw_solo)
        np.testing.assert_array_equal(clean, clean_solo)
    _assert_same_state(a, b)
    [error] = engine.step_batch([(a, -1)])
    assert isinstance(error, ValueError)


def test_a_bad_entry_gets_its_error_and_leaves_the_others_and_itself_intact(engine):
    vocab = engine.config.text_config.vocab_size

    def open_all():
        return [engine.open_session(seed, _prompt(engine, seed), 2) for seed in (21, 22, 23)]

    solo, batched = open_all(), open_all()
    for session in solo + batched:
        session.step(50)
    before = (batched[1].steps, np.array(batched[1].previous), [c.offset for c in batched[1].caches])
    results = engine.step_batch([(batched[0], 60), (batched[1], vocab), (batched[2], 61), (batched[0], 62)])
    assert isinstance(results[1], ValueError) and str(vocab) in str(results[1])
    assert isinstance(results[3], ValueError)  # the same session twice: the second is refused
    for result, session, text_id in ((results[0], solo[0], 60), (results[2], solo[2], 61)):
        for got, want in zip(result, session.step(text_id), strict=True):
            np.testing.assert_array_equal(got, want)
    assert batched[1].steps == before[0]
    np.testing.assert_array_equal(np.array(batched[1].previous), before[1])
    assert [c.offset for c in batched[1].caches] == before[2]
    _assert_same_state(batched[1], solo[1])  # untouched: the key was not advanced either
    # the refused session continues in later batches exactly as solo
    results = engine.step_batch([(session, 70 + i) for i, session in enumerate(batched)])
    for result, session, text_id in zip(results, solo, (70, 71, 72), strict=True):
        for got, want in zip(result, session.step(text_id), strict=True):
            np.testing.assert_array_equal(got, want)
    for mine, theirs in zip(batched, solo, strict=True):
        _assert_same_state(mine, theirs)


@pytest.mark.parametrize("stack_up_to", [10**9, 100, 0])
def test_backbone_step_batch_pads_and_masks_caches_of_different_lengths(engine, stack_up_to):
    """Prompts of 10, 40 and 254 frames: sliding rings shorter than and at the window, a full cache crossing
    its 256-key growth while the others do not. Every cache stacked (every padding case runs), caches over 100
    keys read in place next to the stacked others, or every cache in place: hidden states equal solo."""
    backbone = engine.model.backbone
    dim = engine.config.tts_config.hidden_size
    rng = np.random.default_rng(0)
    lengths = [10, 40, 254]
    solo = [backbone.make_caches() for _ in lengths]
    batched = [backbone.make_caches() for _ in lengths]
    for n, mine, theirs in zip(lengths, batched, solo, strict=True):
        x = mx.array(rng.standard_normal((2, n, dim)).astype(np.float32))
        backbone(x, mine)
        backbone(x, theirs)
    for _ in range(4):
        xs = [mx.array(rng.standard_normal((2, 1, dim)).astype(np.float32)) for _ in lengths]
        want = mx.concatenate([backbone(x, caches) for x, caches in zip(xs, solo, strict=True)], axis=0)
        got = backbone.step_batch(mx.concatenate(xs, axis=0), batched, stack_up_to)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=FLOAT_ATOL)
    full = next(i for i in range(len(backbone.layers)) if engine.config.tts_config.is_global_layer(i))
    assert [c[full].offset for c in batched] == [14, 44, 258]
    assert [c[full].capacity for c in batched] == [256, 256, 512]  # as their own buffers (a group holds fewer)
    assert [c[0].keys.shape[2] for c in batched] == [48, 48, 48]  # sliding rings, window 48
    for mine, theirs in zip(batched, solo, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            whole = a.copy()  # read out at its buffer size, as its own would be
            assert whole.keys.shape == b.keys.shape and a.capacity == b.capacity and a.offset == b.offset
            np.testing.assert_allclose(np.array(whole.keys), np.array(b.keys), rtol=0, atol=FLOAT_ATOL)


@pytest.mark.parametrize("stack_up_to", [None, 64])
def test_long_and_young_sessions_batched_equal_solo(engine, monkeypatch, stack_up_to):
    """A session whose caches hold 300+ keys (its full caches grown past 256 keys, its rings at the window)
    batched with a young one and a middle one: caches read in place (the CPU default), or the sliding rings
    stacked and the full caches over 64 keys in place next to the young one's, stacked alone. Codes equal
    solo's, and so does every session's state."""
    if stack_up_to is not None:
        monkeypatch.setattr(engine, "stack_up_to", stack_up_to)
    backbone = engine.model.backbone
    dim = engine.config.tts_config.hidden_size
    grown = [270, 0, 20]  # positions appended after the 37-frame prompt

    def open_all():
        sessions = []
        for seed, n in zip((31, 32, 33), grown, strict=True):
            session = engine.open_session(seed, _prompt(engine, seed))
            if n:  # stand-in for n earlier frames: the same random embeddings for both twins
                backbone(mx.array(np.random.default_rng(seed).standard_normal((2, n, dim)).astype(np.float32)),
                         session.caches)
            sessions.append(session)
        return sessions

    solo, batched = open_all(), open_all()
    full = next(i for i in range(len(backbone.layers)) if engine.config.tts_config.is_global_layer(i))
    assert [s.caches[full].offset for s in batched] == [307, 37, 57]
    ids = np.random.default_rng(4).integers(0, engine.config.text_config.vocab_size, (3, 6))
    for frame in range(6):
        due = [i for i in range(3) if not (i == 1 and frame == 2)]  # the young one sits one frame out
        results = engine.step_batch([(batched[i], int(ids[i, frame])) for i in due])
        for i, result in zip(due, results, strict=True):
            for got, want in zip(result, solo[i].step(int(ids[i, frame])), strict=True):
                np.testing.assert_array_equal(got, want)
        if 1 not in due:
            engine.step_batch([(batched[1], int(ids[1, frame]))])
            solo[1].step(int(ids[1, frame]))
    assert [s.caches[full].offset for s in batched] == [313, 43, 63]
    for mine, theirs in zip(batched, solo, strict=True):
        _assert_same_state(mine, theirs)


def test_batched_keys_and_draws_are_each_sessions_own():
    seeds = [0, 7, 2**40 + 3]
    solo = [SessionKey(s) for s in seeds]
    batched = [SessionKey(s) for s in seeds]
    solo[1].take(3)
    batched[1].take(3)  # keys at different positions
    want = mx.stack([key.take(4) for key in solo])
    keys = take_batch(batched, 4)
    np.testing.assert_array_equal(np.array(keys), np.array(want))
    for mine, theirs in zip(batched, solo, strict=True):
        np.testing.assert_array_equal(np.array(mine.next_key()), np.array(theirs.next_key()))
    draws = BatchKeySequence(keys)
    uniform, normal = draws.uniform((3, 1, 5)), draws.normal((3, 1, 4))
    for i in range(3):
        row_uniform = mx.random.uniform(shape=(1, 1, 5), key=want[i, 0])
        row_normal = mx.random.normal((1, 1, 4), key=want[i, 1])
        np.testing.assert_array_equal(np.array(uniform[i : i + 1]), np.array(row_uniform))
        np.testing.assert_array_equal(np.array(normal[i : i + 1]), np.array(row_normal))
    with pytest.raises(ValueError, match="one row per session"):
        BatchKeySequence(keys).uniform((2, 1, 5))


def test_embed_rows_equals_each_ids_own_embedding(engine):
    encoder, table = engine.model.embed_subword, engine.table
    lengths = {}
    for token_id in range(engine.config.text_config.vocab_size):
        lengths.setdefault(len(table.subword_chars.get(token_id, ())), token_id)
    ids = sorted(lengths.values())[:6] + [engine.config.eos_token_id, engine.config.pad_token_id, 5000]
    assert len({len(table.subword_chars.get(i, ())) for i in ids}) >= 3  # several character-length groups
    got = encoder.embed_rows(ids, table)
    want = mx.concatenate([encoder.embed_known(mx.array([[i]]), [i], [True], table) for i in ids], axis=0)
    assert got.shape == want.shape == (len(ids), 1, encoder.proj_embedding.out_features)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_the_same_sessions_next_step_gathers_their_codes_and_keys_without_a_copy(engine):
    """After a batched step every session's previous codes and random key are rows of that step's arrays, so
    the next step of the same sessions in the same order gathers them back as those very arrays (no copy, on a
    GPU no kernel); another order or a subset is one take of the same values."""
    sessions = [engine.open_session(seed, _prompt(engine, seed)) for seed in range(3)]
    pad = engine.config.pad_token_id
    for _ in range(2):
        engine.step_batch([(s, pad) for s in sessions])
    rows = engine._rows
    codes = rows.gather([s.previous for s in sessions])
    keys = rows.gather([s.rng.key for s in sessions], squeeze=True)
    assert codes.shape == (3, 1, engine.num_quantizers) and keys.shape == (3, 2)
    assert rows.gather([s.previous for s in sessions]) is codes  # the batched array itself, not a new one
    assert rows.gather([s.rng.key for s in sessions], squeeze=True) is keys
    picked = rows.gather([sessions[2].previous, sessions[0].previous])
    np.testing.assert_array_equal(np.array(picked), np.array(codes)[[2, 0]])
    for s, row in zip(sessions, np.array(keys), strict=True):
        np.testing.assert_array_equal(np.array(s.rng.key), row)


def test_text_rows_of_repeated_ids_equal_each_ids_own_row(engine):
    pad, eos = engine.config.pad_token_id, engine.config.eos_token_id
    for ids in ([pad] * 5, [pad, eos, pad, pad], [eos, pad]):
        got = np.array(engine.text_rows(ids).astype(mx.float32))
        assert got.shape == (len(ids), 1, engine.config.tts_config.hidden_size)
        for n, text_id in enumerate(ids):
            np.testing.assert_array_equal(got[n], np.array(engine.text_rows([text_id]).astype(mx.float32))[0])


def test_sessions_opened_on_one_prompt_share_its_warm_up_and_step_as_if_each_had_run_it(engine, monkeypatch):
    """The speaker prompt's warm-up runs once per distinct prompt; each session gets caches of its own, bit for
    bit what its own warm-up gives, which its steps change without touching the others'."""
    from services.common.cache import context_bound

    warmups = []
    warmup = engine.model.warmup
    monkeypatch.setattr(engine.model, "warmup", lambda *args: (warmups.append(1), warmup(*args))[1])
    engine._warmups.clear()
    prompt, other = _prompt(engine, 11), _prompt(engine, 12)
    a, b = engine.open_session(0, prompt), engine.open_session(1, prompt)
    c = engine.open_session(2, other)
    assert len(warmups) == 2  # one per prompt, not per session
    # what a session's own warm-up gives: its caches made and warmed directly
    own = engine.model.backbone.make_caches(context_bound(engine.prompt_frames, engine.max_context))
    warmup(mx.array(prompt.astype(np.int32))[None], engine.prompt_latent, engine.config.pad_token_id, engine.table,
           own)
    for session in (a, b):
        for mine, theirs in zip(session.caches, own, strict=True):
            assert (mine.offset, mine.capacity) == (theirs.offset, theirs.capacity)
            assert np.array(mine.keys).tobytes() == np.array(theirs.keys).tobytes()
            assert np.array(mine.values).tobytes() == np.array(theirs.values).tobytes()
    pad = engine.config.pad_token_id
    for _ in range(3):
        engine.step_batch([(a, pad), (c, pad)])  # b stays at its prompt
    assert a.caches[0].offset == b.caches[0].offset + 3
    for mine, theirs in zip(b.caches, own, strict=True):  # a's steps wrote nothing of b's or the template's
        assert np.array(mine.keys).tobytes() == np.array(theirs.keys).tobytes()
    d, e = engine.open_session(5, prompt), engine.open_session(5, prompt)
    e.caches = engine.model.backbone.make_caches(context_bound(engine.prompt_frames, engine.max_context))
    warmup(mx.array(prompt.astype(np.int32))[None], engine.prompt_latent, engine.config.pad_token_id, engine.table,
           e.caches)  # e warmed up on its own, as if nothing were shared
    for text_id in (pad, 7, 19):
        assert np.stack(d.step(text_id)).tobytes() == np.stack(e.step(text_id)).tobytes()
    assert len(warmups) == 2  # d and e opened on the kept warm-up
