"""The codec against the reference's goldens (tests/parity/golden, made by make_goldens.py from the tiny
checkpoints): warm-up prompt codes exactly, whole and streaming decode within 1e-5, the round trip's codes."""

from pathlib import Path

import numpy as np
import pytest

from services.codec.engine import CodecEngine
from tests.conftest import load_golden

GOLDEN = Path(__file__).resolve().parent / "golden"
TOLERANCE = 1e-5
# Golden file -> the checkpoint fixture it was made from.
OFFLINE = {
    "offline": "tiny_checkpoint",
    "offline_prompt": "tiny_checkpoint",
    "offline_seed7": "tiny_checkpoint",
    "offline_4bit": "tiny4_checkpoint",
    "offline_mixed": "tinymix_checkpoint",
}
ONLINE = ["online", "online_prompt"]


def golden(name: str):
    return load_golden(name)[0]


@pytest.fixture(scope="module")
def engine_for(request):
    """engine_for("tiny_checkpoint") -> a CodecEngine on that checkpoint, loaded once per module."""
    engines: dict[str, CodecEngine] = {}

    def get(fixture: str) -> CodecEngine:
        if fixture not in engines:
            engines[fixture] = CodecEngine.load(request.getfixturevalue(fixture))
        return engines[fixture]

    return get


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    return float(np.max(np.abs(a - b)))


@pytest.mark.parametrize("name", OFFLINE)
def test_warmup_prompt_codes_equal_the_reference(engine_for, name):
    z = golden(name)
    engine = engine_for(OFFLINE[name])
    frames = z["prompt_codes"].shape[0]
    np.testing.assert_array_equal(engine.encode_prompt_codes(frames), z["prompt_codes"])
    silence = engine.encode(np.zeros(z["silence_codes"].shape[0] * engine.samples_per_frame, np.float32))
    np.testing.assert_array_equal(silence, z["silence_codes"])


@pytest.mark.parametrize("name", OFFLINE)
def test_whole_decode_matches_the_reference(engine_for, name):
    z = golden(name)
    audio = engine_for(OFFLINE[name]).decode(z["audio_codes"])
    assert max_abs(audio, z["audio"]) <= TOLERANCE


@pytest.mark.parametrize("name", ONLINE)
def test_streaming_decode_matches_the_reference_frame_by_frame(engine_for, name):
    z = golden(name)
    engine = engine_for("tiny_checkpoint")
    stream, step = engine.open_stream(), engine.samples_per_frame
    for index, codes in enumerate(z["audio_codes"]):
        samples = stream.decode_frame(index, codes)
        assert max_abs(samples, z["audio"][index * step : (index + 1) * step]) <= TOLERANCE, f"frame {index}"


def test_round_trip_matches_the_reference(engine_for):
    z = golden("codec_roundtrip")
    engine = engine_for("tiny_checkpoint")
    decoded = engine.decode(z["codes_in"])
    assert max_abs(decoded, z["decoded"]) <= TOLERANCE
    stream = engine.open_stream()
    streamed = np.concatenate([stream.decode_frame(i, codes) for i, codes in enumerate(z["codes_in"])])
    assert max_abs(streamed, z["stream_decoded"]) <= TOLERANCE
    # The codec is lossy on random weights: compare the re-encode with the reference's, not with codes_in.
    np.testing.assert_array_equal(engine.encode(z["decoded"]), z["codes_out"])
    np.testing.assert_array_equal(engine.encode(decoded), z["codes_out"])
    # Where the reference's stream and whole decode agree (after its 8-sample delay and 6 edge samples), ours do.
    reference_agrees = np.abs(z["stream_decoded"][8:] - z["decoded"][:-8]) <= TOLERANCE
    ours_agree = np.abs(streamed[8:] - decoded[:-8]) <= TOLERANCE
    assert reference_agrees[6:].all()
    np.testing.assert_array_equal(ours_agree, reference_agrees)
