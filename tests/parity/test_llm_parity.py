"""The language engine against the reference's goldens: the projected audio embeddings fed one position at a
time must give the reference's text and function ids at every position, and its first logits.

Offline goldens come from the reference's offline turn with the language cache on (prompt rows cast to
float32); online goldens from its streaming session (prompt rows prefilled in bfloat16).
"""

import json

import mlx.core as mx
import numpy as np
import pytest

from services.common.loading import LoadOptions
from services.llm.engine import LanguageEngine
from tests.conftest import GOLDEN

PROMPT = "Be concise and answer in one sentence."
# Cached mode runs the reference's cached ops: reached 0.0 (bit-identical); 1e-5 is the stated bound.
# Full-history mode recomputes with the chunked form (another summation order): reached 1.2e-5, bound 5e-5.
LOGIT_ATOL = {False: 1e-5, True: 5e-5}


@pytest.fixture(scope="module", params=["stored", "float32"])
def engines(request, tiny_checkpoint, tiny4_checkpoint, tinymix_checkpoint):
    """The engines as loaded, and with float32 weights (`--float32-weights`: dense weights, quantized scales and
    biases kept in float32; the bf16 prompt prefix casts them back): both must give the reference's numbers."""
    paths = {"dense": tiny_checkpoint, "4bit": tiny4_checkpoint, "mixed": tinymix_checkpoint}
    wide = request.param == "float32"
    return {name: LanguageEngine.load(path, options=LoadOptions(float32_weights=wide)) for name, path in paths.items()}


def _golden(name):
    z = np.load(GOLDEN / f"{name}.npz")
    return z, json.loads(str(z["meta"]))


def _run(engine, embeds, *, prompt, prefix_dtype, full_history=False, logits=8):
    session = engine.open_session(system_prompt=prompt, prefix_dtype=prefix_dtype, full_history=full_history)
    outs = [session.step(mx.array(row), return_logits=i < logits, frame_index=i) for i, row in enumerate(embeds)]
    engine.close_session(session)
    return session, outs


CASES = [
    # golden, checkpoint, prompt, prefix dtype
    ("offline", "dense", "", "float32"),
    ("offline_prompt", "dense", PROMPT, "float32"),
    ("offline_4bit", "4bit", "", "float32"),
    ("offline_mixed", "mixed", "", "float32"),
    ("offline_prompt_4bit", "4bit", PROMPT, "float32"),
    ("offline_prompt_mixed", "mixed", PROMPT, "float32"),
    ("online", "dense", "", "bfloat16"),
    ("online_prompt", "dense", PROMPT, "bfloat16"),
]


@pytest.mark.parametrize(("golden", "checkpoint", "prompt", "prefix_dtype"), CASES)
@pytest.mark.parametrize("full_history", [False, True], ids=["cached", "full_history"])
def test_ids_match_the_reference_at_every_position(engines, golden, checkpoint, prompt, prefix_dtype, full_history):
    z, meta = _golden(golden)
    if "audio_embeds" in z.files:
        prefix = int(meta["prompt_frames"])
        embeds = z["audio_embeds"][prefix:]  # the service builds the prefix itself
    else:
        prefix, embeds = None, z["stream_audio_embeds"]
    session, outs = _run(engines[checkpoint], embeds, prompt=prompt, prefix_dtype=prefix_dtype,
                         full_history=full_history)
    if prefix is not None:
        assert session.prompt_positions == prefix == len(z["prompt_ids"])
    else:
        assert session.prompt_positions == (15 if prompt else 0)
    text = np.array([o.text_id for o in outs])
    function = np.array([o.function_id for o in outs])
    np.testing.assert_array_equal(text, z["text_tokens"])
    np.testing.assert_array_equal(function, z["function_tokens"])
    assert len(set(text.tolist())) > 10  # a degenerate run (one token everywhere) would prove little
    if "text_logits" in z.files:
        n = z["text_logits"].shape[0]
        got_text = np.stack([np.array(o.text_logits) for o in outs[:n]])
        got_function = np.stack([np.array(o.function_logits) for o in outs[:n]])
        np.testing.assert_allclose(got_text, z["text_logits"], rtol=0, atol=LOGIT_ATOL[full_history])
        np.testing.assert_allclose(got_function, z["function_logits"], rtol=0, atol=LOGIT_ATOL[full_history])


def test_prompt_ids_are_bos_tokens_eos(engines):
    z, _ = _golden("offline_prompt")
    assert engines["dense"].prompt_ids(PROMPT) == z["prompt_ids"].tolist()
    assert engines["dense"].prompt_ids("   ") == []


@pytest.mark.parametrize("float32_weights", [False, True])
def test_bf16_weights_mode_equals_the_reference_on_the_dequantized_checkpoint(tiny4_checkpoint, float32_weights):
    """`--weights-dtype bfloat16` dequantizes at load; the reference ran on the checkpoint dequantized the same way
    (tools/dequantize_checkpoint.py), so ids and logits must agree exactly, also with the dequantized weights
    kept in float32."""
    z, _ = _golden("offline_4bit_bf16")
    engine = LanguageEngine.load(tiny4_checkpoint, options=LoadOptions("bfloat16", float32_weights))
    assert engine.model.embed_tokens.spec is None and engine.model.embed_tokens.weight.dtype == mx.bfloat16
    for layer in (engine.model.lm_head, engine.model.function_head):
        assert layer.spec is None and layer.weight.dtype == (mx.float32 if float32_weights else mx.bfloat16)
    _, outs = _run(engine, z["audio_embeds"], prompt="", prefix_dtype="float32")
    np.testing.assert_array_equal([o.text_id for o in outs], z["text_tokens"])
    np.testing.assert_array_equal([o.function_id for o in outs], z["function_tokens"])
    n = z["text_logits"].shape[0]
    np.testing.assert_array_equal(np.stack([np.array(o.text_logits) for o in outs[:n]]), z["text_logits"])
