"""The language engine without gRPC: cached vs full-history, session independence, bad input."""

import mlx.core as mx
import numpy as np
import pytest

from services.llm.engine import LanguageEngine
from tests.conftest import GOLDEN

PROMPT = "Be concise and answer in one sentence."


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LanguageEngine.load(tiny_checkpoint, max_prompt_tokens=32)


@pytest.fixture(scope="module")
def embeds():
    z = np.load(GOLDEN / "offline_prompt.npz")
    return z["audio_embeds"][len(z["prompt_ids"]) :]


def _ids(engine, embeds, **open_kwargs):
    session = engine.open_session(**open_kwargs)
    ids = [(o.text_id, o.function_id) for o in (session.step(mx.array(row)) for row in embeds)]
    engine.close_session(session)
    return ids


@pytest.mark.parametrize("prompt", ["", PROMPT])
def test_cached_and_full_history_give_identical_ids_over_the_golden_timeline(engine, embeds, prompt):
    cached = _ids(engine, embeds, system_prompt=prompt)
    full = _ids(engine, embeds, system_prompt=prompt, full_history=True)
    assert len(cached) == len(embeds) == 66
    assert cached == full
    assert len(set(cached)) > 10


def test_the_prompt_changes_the_answer_and_reports_its_positions(engine, embeds):
    session = engine.open_session(system_prompt=PROMPT)
    assert session.prompt_positions == len(engine.prompt_ids(PROMPT)) == 15
    assert engine.prompt_ids(PROMPT)[0] == engine.model.bos_id and engine.prompt_ids(PROMPT)[-1] == engine.model.eos_id
    engine.close_session(session)
    assert _ids(engine, embeds[:20], system_prompt=PROMPT) != _ids(engine, embeds[:20])
    # Explicit ids are used as given instead of the text.
    assert _ids(engine, embeds[:20], prompt_token_ids=engine.prompt_ids(PROMPT), system_prompt="ignored") == \
        _ids(engine, embeds[:20], system_prompt=PROMPT)


def test_interleaved_sessions_do_not_disturb_each_other(engine, embeds):
    prompts = ["", PROMPT, "", "Hello there."]
    alone = [_ids(engine, embeds[:12], system_prompt=p) for p in prompts]
    sessions = [engine.open_session(system_prompt=p) for p in prompts]
    assert engine.live_sessions == 4
    together = [[] for _ in prompts]
    for row in embeds[:12]:
        for i, s in enumerate(sessions):
            out = s.step(mx.array(row))
            together[i].append((out.text_id, out.function_id))
    for s in sessions:
        engine.close_session(s)
    assert engine.live_sessions == 0
    assert together == alone


def test_close_frees_the_caches(engine, embeds):
    session = engine.open_session()
    session.step(mx.array(embeds[0]))
    assert any(c is not None and c.arrays() for c in session.caches)
    engine.close_session(session)
    engine.close_session(session)  # twice is harmless
    assert session.caches == [] and engine.live_sessions == 0
    with pytest.raises(ValueError, match="is closed"):
        session.step(mx.array(embeds[1]))


@pytest.mark.parametrize(
    ("audio", "message"),
    [
        (np.zeros(127, np.float32), r"float32 of shape \(128,\); got float32 of shape \(127,\)"),
        (np.zeros((1, 128), np.float32), r"float32 of shape \(128,\); got float32 of shape \(1, 128\)"),
        (np.zeros(128, np.float16), r"float32 of shape \(128,\); got float16"),
        (np.zeros(128, np.int32), r"float32 of shape \(128,\); got int32"),
    ],
)
def test_bad_audio_embeddings_are_value_errors(engine, audio, message):
    session = engine.open_session()
    with pytest.raises(ValueError, match=message):
        session.step(mx.array(audio))
    assert session.frames == 0  # nothing advanced
    engine.close_session(session)


def test_bad_prompts_and_order_are_value_errors(engine):
    with pytest.raises(ValueError, match="system prompt is 40 tokens .* the limit is 32"):
        engine.open_session(prompt_token_ids=[5] * 40)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 1024\)"):
        engine.open_session(prompt_token_ids=[1, 5000, 2])
    with pytest.raises(ValueError, match="prefix_dtype"):
        engine.open_session(system_prompt=PROMPT, prefix_dtype="float16")
    assert engine.live_sessions == 0
    session = engine.open_session()
    with pytest.raises(ValueError, match="frame_index 3 is out of order; expected 0"):
        session.step(mx.zeros(128), frame_index=3)
    engine.close_session(session)


def test_full_history_sessions_are_bounded(engine, embeds, monkeypatch):
    from services.common.errors import LimitExceeded
    from services.llm import engine as engine_module

    monkeypatch.setattr(engine_module, "MAX_FULL_HISTORY_POSITIONS", 3)
    session = engine.open_session(full_history=True)
    for row in embeds[:3]:
        session.step(mx.array(row))
    with pytest.raises(LimitExceeded, match="limited to 3 positions"):
        session.step(mx.array(embeds[3]))
    engine.close_session(session)
