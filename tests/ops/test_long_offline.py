"""Long offline inputs: the turn decodes its audio in bounded chunks (the codec's memory does not grow with the
turn, and no call meets its --max-frames), giving the whole decode's samples, and a length one turn cannot carry
over gRPC is refused before any work, saying the limit and what to do."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from orchestrator import cli, timeline
from orchestrator.audio import read_audio
from orchestrator.cli import offline_max_seconds
from orchestrator.local import local_clients
from orchestrator.timeline import DECODE_LEFT_FRAMES, DECODE_RIGHT_FRAMES, decode_chunked, run_offline
from services.codec.engine import CodecEngine
from services.common.config import VoiceChatConfig
from tests.conftest import QUESTION_WAV


@pytest.fixture(scope="module")
def codec(tiny_checkpoint):
    return CodecEngine.load(tiny_checkpoint)


class Recording:
    """A codec client that records the frames of every Decode call."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[int] = []

    def decode(self, codes):
        self.calls.append(codes.shape[0])
        return self.engine.decode(codes)

    def prompt_codes(self, frames):
        return self.engine.encode_prompt_codes(frames)


@pytest.mark.parametrize("chunk", [3, 32, 119, 120, 121])
def test_chunked_decode_is_the_whole_decode_bit_for_bit(codec, chunk):
    codes = np.random.default_rng(chunk).integers(0, codec.codebook_size, (120, codec.num_quantizers), np.int32)
    recording = Recording(codec)
    got = decode_chunked(recording, codes, chunk)
    assert np.array_equal(got, codec.decode(codes))
    assert max(recording.calls) <= chunk + DECODE_LEFT_FRAMES + DECODE_RIGHT_FRAMES
    assert len(recording.calls) == -(-120 // chunk)


def test_the_offline_turn_decodes_in_bounded_calls(tiny_checkpoint, codec, monkeypatch):
    monkeypatch.setattr(timeline, "DECODE_CHUNK_FRAMES", 16)
    clients = local_clients(tiny_checkpoint)
    recording = Recording(codec)
    clients.codec = recording
    wave = timeline.append_silence(read_audio(QUESTION_WAV, 16_000), 1.0, 16_000)  # 41 frames
    result = run_offline(clients, wave)
    frames = result.audio_codes.shape[0]
    assert frames > 16 and len(recording.calls) == -(-frames // 16)
    assert max(recording.calls) <= 16 + DECODE_LEFT_FRAMES + DECODE_RIGHT_FRAMES
    assert np.array_equal(result.audio, codec.decode(result.audio_codes))


def test_the_longest_offline_input_follows_from_the_message_limit():
    config = VoiceChatConfig()  # the full model: a frame's reply is 1024 + 4480 floats and 8 mel rows of 128
    reply = (1024 + 4480 + 8 * 128) * 4
    assert offline_max_seconds(config, 64 << 20) == pytest.approx(0.95 * (64 << 20) / reply * 0.08)
    assert 190 < offline_max_seconds(config) < 200  # about 3.3 minutes


def test_an_input_past_the_limit_is_refused_before_any_work(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    def no_work(*args, **kwargs):
        raise AssertionError("the turn started although its input is past the limit")

    monkeypatch.setattr(cli, "connect", no_work)
    limit = offline_max_seconds(VoiceChatConfig.load(tiny_checkpoint))
    long_wav = tmp_path / "long.wav"
    sf.write(long_wav, np.zeros(int((limit + 1) * 16_000), np.int16), 16_000, subtype="PCM_16")
    code = cli.main(["offline", str(long_wav), "--model", str(tiny_checkpoint), "--output-audio",
                     str(tmp_path / "answer.wav")])
    assert code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {long_wav}: {(limit + 1 + 3) / 60:.1f} min of audio (with the decoding silence) is past the "
        f"{limit / 60:.1f} min one offline turn carries over gRPC with this checkpoint (its perception call would "
        "pass the 64 MiB message limit); use `orchestrator stream` for longer audio, split the input, or pass "
        "--in-process"]
