"""Sessions whose attention caches are bounded (LoadOptions.max_context): the language model's and the speech
backbone's outputs equal an unbounded session's up to the bound, and their caches stop growing after it, solo or
batched (stacked into groups)."""

import mlx.core as mx
import numpy as np
import pytest

from services.common.cache import STACK_ALL, FullCache
from services.common.loading import LoadOptions
from services.llm.engine import LanguageEngine
from services.tts.engine import TTSEngine
from services.tts.prompt import warmup_codes

BOUND = 6  # positions kept past the prompt
FRAMES = 20  # well past the bound: the ring turns over three times
PROMPT_IDS = [1, 17, 42, 99, 2]


def _attention_sizes(caches) -> list[int]:
    return [cache.capacity for cache in caches if isinstance(cache, FullCache)]


@pytest.fixture(scope="module")
def language(tiny_checkpoint):
    full = LanguageEngine.load(tiny_checkpoint, options=LoadOptions(max_context=0))
    return full, LanguageEngine(full.config, full.model, full.tokenizer, max_context=BOUND)


def test_a_bounded_language_session_equals_the_full_one_up_to_the_bound_then_stays_its_size(language):
    full, bounded = language
    audio = np.random.default_rng(0).standard_normal((FRAMES, full.hidden_size)).astype(np.float32)
    sessions = [engine.open_session(prompt_token_ids=PROMPT_IDS) for engine in (full, bounded)]
    logits: list[list[np.ndarray]] = [[], []]
    sizes = []
    for frame in range(FRAMES):
        for i, session in enumerate(sessions):
            out = session.step(mx.array(audio[frame]), return_logits=True)
            logits[i].append(np.array(out.text_logits))
        sizes.append(_attention_sizes(sessions[1].caches))
    for frame in range(BOUND):  # the last of them sees prompt + BOUND keys: all there are
        np.testing.assert_array_equal(logits[0][frame], logits[1][frame])
    assert not np.array_equal(logits[0][-1], logits[1][-1])  # past it the oldest frames are gone
    bound = len(PROMPT_IDS) + BOUND
    assert all(size == [bound] * len(size) for size in sizes[BOUND:]) and sizes[0][0] > 0
    assert _attention_sizes(sessions[0].caches)[0] >= len(PROMPT_IDS) + FRAMES


def test_bounded_language_sessions_batched_in_groups_equal_their_solo_steps(language):
    _, bounded = language
    bounded.stack_up_to = STACK_ALL  # stack every cache into a group, as on a GPU
    try:
        prompts = [PROMPT_IDS, PROMPT_IDS[:2], [1, 5, 9, 2]]
        rng = np.random.default_rng(1)
        solo = [bounded.open_session(prompt_token_ids=p) for p in prompts]
        batched = [bounded.open_session(prompt_token_ids=p) for p in prompts]
        for frame in range(FRAMES):
            members = [0, 1, 2] if frame % 4 else [0, 2]  # some frames a member sits out: a partial group step
            audio = [mx.array(rng.standard_normal(bounded.hidden_size).astype(np.float32)) for _ in members]
            outs = bounded.step_batch([(batched[i], a, False, None) for i, a in zip(members, audio, strict=True)])
            for i, a, out in zip(members, audio, outs, strict=True):
                want = solo[i].step(a)
                assert (out.text_id, out.function_id) == (want.text_id, want.function_id)
        for mine, theirs, prompt in zip(batched, solo, prompts, strict=True):
            for a, b in zip(mine.caches, theirs.caches, strict=True):
                if isinstance(a, FullCache):
                    assert a.group is not None and a.capacity == len(prompt) + BOUND
                    np.testing.assert_array_equal(np.array(a.keys), np.array(b.keys))
    finally:
        bounded.stack_up_to = 0


def test_a_bounded_speech_session_equals_the_full_one_up_to_the_bound_then_stays_its_size(tiny_checkpoint):
    full = TTSEngine.load(tiny_checkpoint, LoadOptions(max_context=0))
    bounded = TTSEngine.load(tiny_checkpoint, LoadOptions(max_context=BOUND))
    k = full.config.tts_config.codebook_size
    encoded = np.random.default_rng(2).integers(0, k, (full.prompt_frames + 1, full.num_quantizers))
    prefix = 3  # the system prompt's prefix steps are kept with the speaker prompt
    sessions = [engine.open_session(7, warmup_codes(encoded, k), prefix) for engine in (full, bounded)]
    text = np.random.default_rng(3).integers(0, full.config.text_config.vocab_size, FRAMES)
    codes: list[list[np.ndarray]] = [[], []]
    for frame in range(FRAMES):
        for i, session in enumerate(sessions):
            codes[i].append(session.step(int(text[frame]))[0])
        if frame >= BOUND:
            assert _attention_sizes(sessions[1].caches) == [full.prompt_frames + prefix + BOUND] * len(
                _attention_sizes(sessions[1].caches))
    np.testing.assert_array_equal(np.array(codes[0][:BOUND]), np.array(codes[1][:BOUND]))
    assert _attention_sizes(sessions[0].caches)[0] >= full.prompt_frames + prefix + FRAMES
