"""Perception against the reference's goldens (tiny random checkpoints, examples/question.wav + 3 s silence).

Offline: log-mel, full-utterance encoder, projection and RNNT ids. Online: the cache-aware streaming encoder,
its projection and the transcript delta events, one 1280-sample push per frame (the last one zero-padded).
On this machine every float matches bit for bit (max-abs 0); the bound asserted is the issue's 1e-4.
"""


import numpy as np
import pytest

from services.common.loading import LoadOptions
from services.perception.engine import PerceptionEngine
from tests.conftest import load_golden

TOL = 1e-4


def _golden(name):
    return load_golden(name)


def _max_abs(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a.astype(np.float64) - b)))


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tiny4_checkpoint, tinymix_checkpoint):
    cache = {}

    def get(kind):
        if kind not in cache:
            path = {"tiny": tiny_checkpoint, "tiny32": tiny_checkpoint, "tiny4": tiny4_checkpoint,
                    "tinymix": tinymix_checkpoint}[kind]
            wide = LoadOptions(float32_weights=kind == "tiny32")  # tiny32: float32 copies
            cache[kind] = PerceptionEngine.load(path, wide)
        return cache[kind]

    return get


@pytest.mark.parametrize(
    "name,kind",
    [("offline", "tiny"), ("offline", "tiny32"), ("offline_prompt", "tiny"), ("offline_4bit", "tiny4"),
     ("offline_mixed", "tinymix")],
)
def test_offline_matches_the_golden(engines, name, kind):
    g, meta = _golden(name)
    result = engines(kind).encode(g["waveform"])
    prefix = len(g["prompt_ids"])  # the LLM prepends prompt embeddings; ours are the audio rows only
    assert _max_abs(np.array(result.mel), g["mel"]) <= TOL
    assert _max_abs(np.array(result.encoder_out), g["encoder"]) <= TOL
    assert _max_abs(np.array(result.audio_embeds), g["audio_embeds"][prefix:]) <= TOL
    assert result.encoder_out.shape[0] == meta["frames"]
    assert result.token_ids == g["transcript_ids"].tolist()
    assert result.transcript == meta["transcript"]


@pytest.mark.parametrize("name,kind", [("online", "tiny"), ("online", "tiny32"), ("online_prompt", "tiny")])
def test_streaming_matches_the_reference_streaming_session(engines, name, kind):
    g, meta = _golden(name)
    engine = engines(kind)
    waveform = g["waveform"]
    n = engine.frame_samples
    frames = -(-waveform.size // n)
    padded = np.pad(waveform, (0, frames * n - waveform.size))
    stream = engine.open_stream()
    encoder, embeds, events = [], [], []
    for i in range(frames):
        out = stream.push(padded[i * n : (i + 1) * n])
        encoder.append(np.array(out.encoder_out))
        embeds.append(np.array(out.audio_embedding))
        if out.transcript_delta:
            events.append({"frame_index": i, "delta": out.transcript_delta, "text": out.transcript})
    assert _max_abs(np.stack(encoder), g["stream_encoder"]) <= TOL
    assert _max_abs(np.stack(embeds), g["stream_audio_embeds"]) <= TOL
    expected = [{k: e[k] for k in ("frame_index", "delta", "text")}
                for e in meta["events"] if e["kind"] == "user_transcript_delta"]
    assert events == expected
    assert stream.transcript == meta["transcript"]
