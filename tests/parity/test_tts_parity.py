"""EAR-TTS against the reference's goldens: fed the goldens' prompt codes and text ids, every frame's 31 codes
(raw and after control-code replacement) equal the reference's exactly, offline and online, seeds 0 and 7."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from services.common.loading import LoadOptions
from services.tts.engine import TTSEngine
from services.tts.prompt import warmup_codes
from tests.conftest import load_golden

GOLDEN = Path(__file__).resolve().parent / "golden"
# Golden file -> the checkpoint fixture it was made from.
OFFLINE = {
    "offline": "tiny_checkpoint",
    "offline_prompt": "tiny_checkpoint",
    "offline_seed7": "tiny_checkpoint",
    "offline_4bit": "tiny4_checkpoint",
    "offline_mixed": "tinymix_checkpoint",
    "offline_prompt_4bit": "tiny4_checkpoint",
    "offline_prompt_mixed": "tinymix_checkpoint",
    "offline_4bit_bf16": "tiny4_checkpoint",  # the speech weights are dense in every variant
}
ONLINE = ["online", "online_prompt"]

_engines: dict[str, TTSEngine] = {}


def golden(name: str):
    return load_golden(name)


def engine_for(request, fixture: str) -> TTSEngine:
    """`fixture` names a checkpoint fixture; a `:float32` suffix loads it with float32 weight copies."""
    if fixture not in _engines:
        name, _, mode = fixture.partition(":")
        wide = LoadOptions(float32_weights=mode == "float32")
        _engines[fixture] = TTSEngine.load(request.getfixturevalue(name), wide)
    return _engines[fixture]


def run_timeline(engine: TTSEngine, seed: int, prompt_codes, prompt_frames: int, text_tokens):
    """The reference's timeline for TTS: position 0 has no step; a prompt prefix adds pad steps before frame 0.

    Returns the (raw, clean) codes per output frame; frame 0 without a prefix is None.
    """
    session = engine.open_session(seed, prompt_codes, max(prompt_frames - 1, 0))
    out = []
    for frame, text_id in enumerate(text_tokens):
        out.append(None if prompt_frames == 0 and frame == 0 else session.step(int(text_id)))
    return out


@pytest.mark.parametrize("name", list(OFFLINE))
def test_offline_codes_equal_the_reference(request, name):
    data, meta = golden(name)
    engine = engine_for(request, OFFLINE[name])
    np.testing.assert_array_equal(warmup_codes(data["silence_codes"], engine.config.tts_config.codebook_size),
                                  data["prompt_codes"])
    assert np.array(engine.silence_codes).tolist() == meta["codec_silence_tokens"]
    assert np.array(engine.control_codes).tolist() == meta["control_codes"]
    frames = run_timeline(engine, meta["seed"], data["prompt_codes"], meta["prompt_frames"], data["text_tokens"])
    raw = np.stack([np.zeros(31, np.int32) if f is None else f[0] for f in frames])
    clean = np.stack([np.array(engine.clean(mx.zeros((31,), mx.int32))) if f is None else f[1] for f in frames])
    np.testing.assert_array_equal(raw, data["audio_codes_raw"])
    np.testing.assert_array_equal(clean, data["audio_codes"])
    assert len(np.unique(raw[1:], axis=0)) > len(raw) // 2  # really varied speech codes, not a constant
    assert (raw != clean).any()  # the control-code replacement path ran


@pytest.mark.parametrize("name,fixture", [("online", "tiny_checkpoint"), ("online", "tiny_checkpoint:float32"),
                                          ("online_prompt", "tiny_checkpoint")])
def test_online_codes_equal_the_reference(request, name, fixture):
    data, meta = golden(name)
    prompt_codes = golden("offline")[0]["prompt_codes"]
    engine = engine_for(request, fixture)
    frames = run_timeline(engine, meta["seed"], prompt_codes, meta["prompt_frames"], data["text_tokens"])
    silence = np.array(engine.silence_codes)
    clean = np.stack([silence if f is None else f[1] for f in frames])
    np.testing.assert_array_equal(clean, data["audio_codes"])
