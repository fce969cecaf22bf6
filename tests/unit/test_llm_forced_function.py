"""A forced function token (a tool response read back): the step returns it as its function token and the next
step fuses it, exactly as if the head had picked it, alone or in a batch; without one nothing changes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from services.llm.engine import LanguageEngine
from tests.conftest import GOLDEN

FORCED = 400


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LanguageEngine.load(tiny_checkpoint)


@pytest.fixture(scope="module")
def rows():
    z = np.load(GOLDEN / "offline_prompt.npz")
    return [mx.array(row) for row in z["audio_embeds"][len(z["prompt_ids"]):][:3]]


def _open(engine):
    return engine.open_session("Be brief.", prefix_dtype="bfloat16")


def test_forced_token_is_returned_and_fused_as_the_heads_pick_would_be(engine, rows):
    plain, forced, edited = _open(engine), _open(engine), _open(engine)
    first = plain.step(rows[0])
    assert first.function_id != FORCED  # else the test shows nothing
    forced.force_function(FORCED)
    assert forced.step(rows[0]).function_id == FORCED
    assert forced.forced_function is None  # used once
    edited.step(rows[0])
    edited.prev_function = FORCED  # the state a head that picked FORCED would leave
    after_forced, after_edit = forced.step(rows[1], True), edited.step(rows[1], True)
    after_plain = plain.step(rows[1], True)
    assert mx.array_equal(after_forced.function_logits, after_edit.function_logits)
    assert mx.array_equal(after_forced.text_logits, after_edit.text_logits)
    assert not mx.array_equal(after_forced.function_logits, after_plain.function_logits)
    for session in (plain, forced, edited):
        engine.close_session(session)


def test_forced_token_in_a_batch(engine, rows):
    solo, plain, a, b = _open(engine), _open(engine), _open(engine), _open(engine)
    for session in (solo, plain, a, b):
        session.step(rows[0])  # caches hold a position: the next steps batch
    solo.force_function(FORCED)
    expected = [solo.step(rows[1]).function_id, solo.step(rows[2], True)]
    unforced = plain.step(rows[1]).function_id
    a.force_function(FORCED)
    first = engine.step_batch([(a, rows[1], False, None), (b, rows[1], False, None)])
    assert first[0].function_id == expected[0] == FORCED
    assert first[1].function_id == unforced  # b's is its own pick
    second = engine.step_batch([(a, rows[2], True, None), (b, rows[2], True, None)])
    assert second[0].function_id == expected[1].function_id
    np.testing.assert_allclose(np.array(second[0].function_logits), np.array(expected[1].function_logits),
                               atol=1e-4)
    for session in (solo, plain, a, b):
        engine.close_session(session)


def test_a_forced_token_outside_the_vocabulary_is_refused(engine):
    session = _open(engine)
    with pytest.raises(ValueError, match=r"forced function token 1024 is outside the vocabulary \[0, 1024\)"):
        session.force_function(1024)
    assert session.forced_function is None
    engine.close_session(session)
