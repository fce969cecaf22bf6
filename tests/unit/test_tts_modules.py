"""EAR-TTS building blocks: norms, top-p, the mask schedule, depth-sum, per-session randomness, char table."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from services.common.config import TTSConfig
from services.common.loading import LoadOptions
from services.tts.blocks import GemmaRMSNorm, OffsetRMSNorm
from services.tts.model import EarTts, mask_schedule
from services.tts.mog import top_p_mask
from services.tts.prompt import prompt_samples, warmup_codes
from services.tts.rng import SessionKey
from services.tts.subword import CharTable


def _rms_norm_np(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("norm_cls", [OffsetRMSNorm.of, GemmaRMSNorm.of])
def test_offset_rms_norm_equals_rms_norm_with_weight_plus_one(norm_cls):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32) * 0.1
    out = norm_cls(mx.array(w), 1e-6)(mx.array(x))
    plain = mx.fast.rms_norm(mx.array(x), mx.array(w + 1.0), 1e-6)
    np.testing.assert_allclose(np.array(out), np.array(plain), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(out), _rms_norm_np(x, w + 1.0, 1e-6), rtol=1e-5, atol=1e-5)


def test_offset_rms_norm_keeps_the_input_dtype_and_computes_in_float32():
    x = mx.array([[1.0, 2.0, 3.0, 4.0]], dtype=mx.bfloat16)
    out = OffsetRMSNorm.of(mx.zeros((4,), dtype=mx.bfloat16), 1e-6)(x)
    assert out.dtype == mx.bfloat16
    expected = _rms_norm_np(np.array([[1.0, 2.0, 3.0, 4.0]]), 1.0, 1e-6)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, rtol=1e-2)


def test_top_p_keeps_the_nucleus_and_always_the_largest_logit():
    logits = mx.log(mx.array([[0.2, 0.5, 0.3]]))
    # mass strictly above: 0.5 -> 0, 0.3 -> 0.5, 0.2 -> 0.8; top_p 0.6 keeps the first two
    kept = np.isfinite(np.array(top_p_mask(logits, 0.6)))
    assert kept.tolist() == [[False, True, True]]
    for top_p in (1e-9, 1e-3, 0.1):
        out = np.array(top_p_mask(mx.array([[3.0, 1.0, 2.0, -1.0]]), top_p))
        assert np.isfinite(out).tolist() == [[True, False, False, False]]
        assert out[0, 0] == 3.0
    assert np.isfinite(np.array(top_p_mask(logits, 1.0))).all()


def test_mask_schedule_fills_all_31_codebooks_in_8_iterations():
    counts = mask_schedule(31, 8, 3.0)
    assert counts == [0, 0, 0, 1, 1, 3, 4, 22]
    assert sum(counts) == 31
    assert sum(mask_schedule(8, 4, 2.0)) == 8


def _depth_sum_model(q=3, k=4, latent=5):
    rvq = mx.array(np.random.default_rng(1).standard_normal((q, k, latent)).astype(np.float32))
    table = mx.concatenate([rvq, mx.zeros((q, 1, latent))], axis=1)
    config = TTSConfig(num_quantizers=q, codebook_size=k, latent_size=latent)
    starts = mx.arange(0, q * (k + 1), k + 1, dtype=mx.int32)
    return SimpleNamespace(config=config, code_rows=table.reshape(-1, latent), code_starts=starts), np.array(rvq)


def test_depth_sum_adds_one_row_per_codebook_and_ignores_the_mask_index():
    model, rvq = _depth_sum_model()
    codes = mx.array([[[1, 4, 2], [4, 4, 4], [0, 3, 4]]], dtype=mx.int32)  # 4 = mask
    out = np.array(EarTts.depth_sum(model, codes))
    np.testing.assert_allclose(out[0, 0], rvq[0, 1] + rvq[2, 2], rtol=1e-6)
    np.testing.assert_array_equal(out[0, 1], np.zeros(5, np.float32))
    np.testing.assert_allclose(out[0, 2], rvq[0, 0] + rvq[1, 3], rtol=1e-6)


def test_depth_sum_adds_the_codebooks_in_order():
    """The sum is the left fold over codebooks 0, 1, ..., Q-1 in float32 (the order decides the last bit)."""
    model, rvq = _depth_sum_model(q=31, k=16, latent=8)
    codes = np.random.default_rng(2).integers(0, 17, (2, 3, 31)).astype(np.int32)  # 16 = mask
    padded = np.concatenate([rvq, np.zeros((31, 1, 8), np.float32)], axis=1)
    want = np.zeros((2, 3, 8), np.float32)
    for q in range(31):
        want = want + padded[q, codes[..., q]]
    np.testing.assert_array_equal(np.array(EarTts.depth_sum(model, mx.array(codes))), want)


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_session_key_replays_the_global_generator(seed):
    shapes = [("uniform", (1, 1, 64)), ("normal", (1, 1, 8)), ("uniform", (2, 3)), ("normal", (5,))]
    mx.random.seed(seed)
    expected = [mx.random.uniform(shape=s) if kind == "uniform" else mx.random.normal(s) for kind, s in shapes]
    key = SessionKey(seed)
    got = [key.uniform(s) if kind == "uniform" else key.normal(s) for kind, s in shapes]
    for e, g in zip(expected, got, strict=True):
        assert e.dtype == g.dtype == mx.float32
        assert mx.array_equal(e, g).item()


def test_session_keys_are_independent_of_each_other_and_of_the_global_generator():
    mx.random.seed(0)
    alone = [mx.random.uniform(shape=(4,)) for _ in range(3)]
    a, b = SessionKey(0), SessionKey(1)
    mx.random.seed(123)
    interleaved = []
    for _ in range(3):
        interleaved.append(a.uniform((4,)))
        b.normal((4,))
        mx.random.uniform(shape=(2,))  # global draws must not disturb a session
    for x, y in zip(alone, interleaved, strict=True):
        assert mx.array_equal(x, y).item()


def _vocab(n_single):
    singles = {chr(0x100 + i): 1000 - i for i in range(n_single)}  # ids descending: table order reverses
    return {**singles, "ab": 5, "<S>": 6}


def test_char_table_orders_characters_by_token_id_and_spells_out_subwords():
    vocab = _vocab(256)
    vocab.update({"a": 2000, "b": 1999})  # a 258-character vocabulary would fail; swap two in
    del vocab[chr(0x100)], vocab[chr(0x101)]
    table = CharTable.from_vocabulary(vocab, 257)
    assert table.padding == 256
    # sorted by id: lowest id first; "b" (1999) before "a" (2000) at the end
    assert table.subword_chars[vocab["b"]] == (254,)
    assert table.subword_chars[vocab["a"]] == (255,)
    assert table.subword_chars[5] == (255, 254)
    assert table.subword_chars[6] == ()  # '<', 'S', '>' are not single-character tokens here
    chars, lengths = table.batch([5, 2000])
    assert chars.tolist() == [[255, 254], [255, 256]]
    assert lengths.tolist() == [2, 1]
    assert table.batch([6, 424242]) is None


@pytest.mark.parametrize("n_single", [255, 257])
def test_char_table_fails_unless_the_vocabulary_has_exactly_256_characters(n_single):
    with pytest.raises(ValueError, match=f"{n_single} single-character tokens"):
        CharTable.from_vocabulary(_vocab(n_single), 257)


def test_warmup_codes_mask_the_first_and_last_kept_frames():
    encoded = np.arange(5 * 3, dtype=np.int32).reshape(5, 3)
    codes = warmup_codes(encoded, 1024)
    assert codes.shape == (4, 3) and codes.dtype == np.int32
    assert codes[0].tolist() == [1024] * 3 and codes[3].tolist() == [1024] * 3
    np.testing.assert_array_equal(codes[1:3], encoded[1:3])
    assert prompt_samples(37, 1764) == 38 * 1764
    with pytest.raises(ValueError):
        warmup_codes(np.zeros((2, 3)), 1024)


def test_taken_keys_are_the_next_draw_keys():
    a, b = SessionKey(3), SessionKey(3)
    taken = a.take(4)
    assert mx.array_equal(taken, mx.stack([b.next_key() for _ in range(4)])).item()
    assert mx.array_equal(a.next_key(), b.next_key()).item()  # both streams continue in step


@pytest.mark.parametrize("seed", [0, 7])
def test_compiled_refinement_equals_the_plain_one(tiny_checkpoint, seed):
    from services.tts.engine import TTSEngine

    model = TTSEngine.load(tiny_checkpoint).model
    for trial in range(3):
        hidden = mx.random.normal((2, 1, model.config.hidden_size), key=mx.random.key(100 + trial))
        plain = model.generate_codes_with(hidden, SessionKey(seed + trial))
        compiled = model.generate_codes(hidden, SessionKey(seed + trial))
        assert mx.array_equal(plain, compiled).item()
        assert (np.array(compiled) < model.config.codebook_size).all()


def test_widened_refinement_converts_no_gathered_row_nor_code_and_draws_the_same(tiny_checkpoint):
    """With float32 weights the MoG head's per-component projections are stored in float32, and the masked
    codes are argmin's uint32: a frame's compiled refinement converts neither a gathered projection row nor its
    stacks of codes (28 conversions before on this checkpoint; those left convert the random draws' bits)."""
    from bench.stages import KernelCounter
    from services.tts.engine import TTSEngine

    plain = TTSEngine.load(tiny_checkpoint).model
    wide = TTSEngine.load(tiny_checkpoint, LoadOptions(float32_weights=True)).model
    assert wide.mog_head.proj_mus.dtype == wide.mog_head.low_mat.dtype == mx.float32
    assert plain.mog_head.proj_mus.dtype == mx.bfloat16  # as stored without the flag
    hidden = mx.random.normal((2, 1, wide.config.hidden_size), key=mx.random.key(5))
    mx.eval(hidden, wide.generate_codes(hidden, SessionKey(0)))  # traced before counting
    with KernelCounter() as counter:
        codes = wide.generate_codes(hidden, SessionKey(3))
        mx.eval(codes)
    assert counter.counts["AsType"] <= 7 and codes.dtype == mx.int32
    assert mx.array_equal(codes, plain.generate_codes_with(hidden, SessionKey(3))).item()
