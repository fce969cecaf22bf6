"""Input files read as the reference reads them (goldens audio_read.npz, offline_44k_stereo.npz).

`read_audio` must give the reference's `load_audio` samples bit for bit for every case of `audio_inputs`: 8-, 16-,
24- and 32-bit integer and 32- and 64-bit float WAVs, one, two, three, four and six channels, 8 to 48 kHz. A
whole offline turn on the bundled question at 44.1 kHz in stereo must give the reference's ids and codes.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from orchestrator import cli
from orchestrator.audio import read_audio
from tests.conftest import load_golden
from tests.parity.audio_inputs import cases, wav_bytes

CASES = cases()
FILES = [name for name in CASES if not name.startswith("question")]


def write_case(name: str, folder) -> object:
    path = folder / f"{name}.wav"
    path.write_bytes(wav_bytes(*CASES[name]))
    return path


@pytest.mark.parametrize("name", FILES)
def test_every_encoding_rate_and_channel_count_reads_as_the_reference_reads_it(name, tmp_path):
    golden, meta = load_golden("audio_read")
    path = write_case(name, tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == meta[name]["sha256"]  # the golden's very file
    got = read_audio(path)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, golden[name])


def test_the_goldens_cover_every_case():
    assert set(load_golden("audio_read")[1]) == set(FILES)


def test_a_turn_on_a_44k_stereo_file_equals_the_references(tiny_checkpoint, tmp_path):
    golden, meta = load_golden("offline_44k_stereo")
    path = write_case("question_44k_stereo", tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == meta["sha256"]
    dump = tmp_path / "turn.npz"
    assert cli.main(["offline", str(path), "--model", str(tiny_checkpoint), "--in-process", "-p", "",
                     "--output-audio", str(tmp_path / "out.wav"), "--dump", str(dump)]) == 0
    got = np.load(dump)
    for key in ("text_tokens", "function_tokens", "audio_codes", "prompt_codes"):
        np.testing.assert_array_equal(got[key], golden[key], err_msg=key)
    assert np.abs(got["audio_embeds"] - golden["audio_embeds"]).max() <= 1e-4
    ours = json.loads(str(got["meta"]))
    assert (ours["transcript"], ours["text"]) == (meta["transcript"], meta["text"])
