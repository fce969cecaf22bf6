"""Orchestrator pieces without services: audio IO, the timeline over fake clients, text deltas, flags."""

from __future__ import annotations

import os

import numpy as np
import pytest
import soundfile as sf

from orchestrator.audio import AudioError, read_audio, resample, to_pcm16, write_wav
from orchestrator.connect import parse_service_env, parse_service_flags, parse_services, service_envs, service_flags
from orchestrator.text import TokenAccumulator
from orchestrator.timeline import Clients, PerceptionResult, SpeechInfo, append_silence, run_offline

Q = 4
INFO = SpeechInfo(prompt_frames=3, num_quantizers=Q, control_codes=(7, 9), silence_codes=(100, 101, 102, 103))


class FakePerception:
    def encode(self, waveform):
        frames = len(waveform) // 1280
        embeds = np.arange(frames * 2, dtype=np.float32).reshape(frames, 2)
        return PerceptionResult(np.zeros((1, 128), np.float32), embeds, embeds, "hi", np.array([5], np.int32))


class FakeLanguage:
    def __init__(self, prefix):
        self.prefix, self.log = prefix, []

    def open(self, system_prompt):
        outer = self

        class Session:
            prompt_positions = outer.prefix
            prompt_embeds = np.full((outer.prefix, 2), -1.0, np.float32)

            def step(self, embedding):
                outer.log.append(("step", float(embedding[0])))
                return 2 if embedding[0] == 2.0 else 30 + int(embedding[0]), 12

            def close(self):
                outer.log.append(("close",))

        return Session()


class FakeSpeech:
    def __init__(self):
        self.log = []

    def info(self):
        return INFO

    def open(self, seed, prompt_codes, prefix_steps):
        self.log.append(("open", seed, prompt_codes.shape, prefix_steps))
        outer = self

        class Session:
            def step(self, text_id):
                outer.log.append(("step", text_id))
                return np.array([7, text_id, 9, 1], np.int32)

            def close(self):
                outer.log.append(("close",))

        return Session()


class FakeCodec:
    def prompt_codes(self, frames):
        return np.zeros((frames, Q), np.int32)

    def decode(self, codes):
        return np.repeat(codes[:, 1].astype(np.float32), 1764)


@pytest.mark.parametrize("prefix", [0, 3])
def test_timeline_order_and_edges(prefix):
    language, speech = FakeLanguage(prefix), FakeSpeech()
    clients = Clients(FakePerception(), language, speech, FakeCodec())
    result = run_offline(clients, np.zeros(4 * 1280, np.float32), system_prompt="x", seed=5)
    assert speech.log[0] == ("open", 5, (3, Q), max(prefix - 1, 0))
    steps = [entry[1] for entry in speech.log if entry[0] == "step"]
    # no speech step at timeline position 0; every frame after it gets one, in order
    expected = [int(t) for t in result.text_tokens[(1 if prefix == 0 else 0):]]
    assert steps == expected
    assert result.text_tokens.tolist() == [30, 2, 34, 36] and result.function_tokens.tolist() == [12] * 4
    first = result.raw_codes[0].tolist()
    assert first == ([0, 0, 0, 0] if prefix == 0 else [7, 30, 9, 1])
    # control codes 7 and 9 become the codebook's silence code, everywhere
    assert result.audio_codes[1].tolist() == [100, 2, 102, 1]
    assert result.audio.shape == (4 * 1764,)
    assert result.audio_embeds.shape == (prefix + 4, 2)
    assert language.log[-1] == ("close",) and speech.log[-1] == ("close",)


def test_append_silence_rejects_negative_seconds():
    assert append_silence(np.ones(3, np.float32), 0.5, 16).shape == (11,)
    with pytest.raises(ValueError, match="non-negative"):
        append_silence(np.ones(3, np.float32), -1, 16)


def test_read_audio_mixes_down_and_resamples(tmp_path):
    t = np.arange(44_100) / 44_100
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    sf.write(tmp_path / "stereo.wav", np.stack([tone, tone], axis=1), 44_100, subtype="PCM_16")
    out = read_audio(tmp_path / "stereo.wav")
    assert out.dtype == np.float32 and out.shape == (16_000,)
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16_000) / 16_000)
    assert np.abs(out[200:-200] - expected[200:-200]).max() < 2e-3


def test_16k_input_is_read_exactly(tmp_path):
    samples = (np.arange(-800, 800, dtype=np.int16) * 20)
    sf.write(tmp_path / "a.wav", samples, 16_000, subtype="PCM_16")
    assert np.array_equal(read_audio(tmp_path / "a.wav"), samples.astype(np.float32) / 32768)


def test_samples_become_16_bit_integers_as_the_reference_decoder_makes_them(tmp_path):
    # floats: floor((clip(x) + 1) * 32767.5) - 32768, so 0.0 reads as -1 and full scale as 32767 / -32768
    floats = np.array([0.0, 1.0, -1.0, 2.0, -3.0, 0.5, -0.5], np.float32)
    sf.write(tmp_path / "f.wav", floats, 16_000, subtype="FLOAT")
    expected = np.array([-1, 32767, -32768, 32767, -32768, 16383, -16385])
    assert np.array_equal(read_audio(tmp_path / "f.wav") * 32768, expected)
    # 24-bit integers keep their top 16 bits (rounded down); two channels average in integers, rounded down
    ints = np.array([[0x7FFFFF, 255], [256, -1], [-256, -257], [-0x800000, 3 * 256]], np.int32)
    sf.write(tmp_path / "s24.wav", ints * 256, 16_000, subtype="PCM_24")
    top = np.array([[32767, 0], [1, -1], [-1, -2], [-32768, 3]])
    assert np.array_equal(read_audio(tmp_path / "s24.wav") * 32768, top.sum(axis=1) // 2)
    assert np.array_equal(read_audio(tmp_path / "s24.wav") * 32768, [16383, 0, -2, -16383])


def test_channels_mix_as_the_reference_decoder_mixes_them(tmp_path):
    # a 32-bit sum divided as unsigned, its low 16 bits kept: the floor of the mean for 1, 2, 4, 8 channels...
    quad = np.array([[1, 2, 3, -7], [-32768, -32768, -32768, -32768], [32767, 32767, 32767, 32767]], np.int16)
    sf.write(tmp_path / "quad.wav", quad, 16_000, subtype="PCM_16")
    assert np.array_equal(read_audio(tmp_path / "quad.wav") * 32768, [-1, -32768, 32767])
    # ...and for three, a negative sum wraps: (2**32 - 742) // 3 keeps 21598 in its low 16 bits
    three = np.array([[-54, 24, 511], [901, -931, -712]], np.int16)
    sf.write(tmp_path / "three.wav", three, 16_000, subtype="PCM_16")
    assert np.array_equal(read_audio(tmp_path / "three.wav") * 32768, [160, 21598])


def test_pcm16_at_the_input_scale_keeps_every_int16_value_and_full_scale_in_range():
    ints = np.array([-32768, -1, 0, 1, 12345, 32767], np.int16)
    assert np.array_equal(to_pcm16(ints / 32768, 32768.0), ints)
    assert to_pcm16(np.array([1.0, 2.0, -1.0, -2.0]), 32768.0).tolist() == [32767, 32767, -32768, -32768]


def test_non_finite_float_samples_are_refused(tmp_path):
    sf.write(tmp_path / "nan.wav", np.array([0.0, np.nan, 0.1], np.float32), 16_000, subtype="FLOAT")
    with pytest.raises(AudioError, match="non-finite"):
        read_audio(tmp_path / "nan.wav")


def test_the_resampler_holds_the_end_samples_beyond_the_ends():
    # a constant comes out as the constant (the taps sum to one per phase, the ends held, not zero-padded)
    for source, target in ((44_100, 16_000), (8_000, 16_000), (16_000, 48_000)):
        out = resample(np.full(500, 0.25, np.float32), source, target)
        assert np.abs(out - 0.25).max() < 1e-6, (source, target)


def test_resample_identity_and_length():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert resample(x, 16_000, 16_000) is x or np.array_equal(resample(x, 16_000, 16_000), x)
    assert resample(x, 48_000, 16_000).shape == (334,)


def test_audio_errors_are_one_clear_line(tmp_path):
    with pytest.raises(AudioError, match="no such file"):
        read_audio(tmp_path / "absent.wav")
    (tmp_path / "text.wav").write_text("not audio")
    with pytest.raises(AudioError, match="not a readable audio file"):
        read_audio(tmp_path / "text.wav")
    sf.write(tmp_path / "empty.wav", np.zeros(0, np.int16), 16_000, subtype="PCM_16")
    with pytest.raises(AudioError, match="holds no audio"):
        read_audio(tmp_path / "empty.wav")


def test_write_wav_is_atomic_and_pcm16(tmp_path):
    path = write_wav(tmp_path / "out.wav", np.array([0.0, 0.5, -2.0, 1.0], np.float32), 22_050)
    data, rate = sf.read(path, dtype="int16")
    info = sf.info(path)
    assert rate == 22_050 and info.channels == 1 and info.subtype == "PCM_16"
    assert data.tolist() == [0, 16384, -32767, 32767] == to_pcm16(np.array([0, 0.5, -2, 1])).tolist()
    assert [p.name for p in tmp_path.iterdir()] == ["out.wav"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(AudioError, match="no such folder"):
        write_wav(tmp_path / "missing" / "out.wav", np.zeros(3, np.float32), 22_050)


class FakeDecoder:
    hidden = frozenset({12})

    def decode(self, ids):
        pieces = {1: "a", 2: "b", 3: "\ufffd", 4: "é"}
        text = "".join(pieces[i] for i in ids)
        return text.replace("\ufffd" + "é", "é")  # a partial byte sequence revised by the next token


def test_token_accumulator_deltas():
    acc = TokenAccumulator(FakeDecoder())
    assert acc.append(12) is None
    assert acc.append(1) == ("a", "a")
    assert acc.append(2) == ("b", "ab")
    assert acc.append(3) == ("\ufffd", "ab\ufffd")
    assert acc.append(4) == ("é", "abé")  # not an extension: the single-token decode is the delta


def test_parse_services():
    parsed = parse_services("perception=h:1,llm=h:2,tts=h:3,codec=h:4")
    assert parsed == {"perception": "h:1", "llm": "h:2", "tts": "h:3", "codec": "h:4"}
    with pytest.raises(ValueError, match="missing codec"):
        parse_services("perception=h:1,llm=h:2,tts=h:3")
    with pytest.raises(ValueError, match="expected NAME=HOST:PORT"):
        parse_services("vision=h:1")


def test_service_flags_split_like_a_shell_and_all_comes_first():
    entries = [parse_service_flags("llm=--weights-dtype bfloat16 --max-batch 8"),
               parse_service_flags("all=--precompile-batches 16"),
               parse_service_flags("tts= --max-prefix-steps '64'")]
    assert entries[0] == ("llm", ["--weights-dtype", "bfloat16", "--max-batch", "8"])
    assert service_flags(entries) == {
        "perception": ["--precompile-batches", "16"],
        "llm": ["--precompile-batches", "16", "--weights-dtype", "bfloat16", "--max-batch", "8"],
        "tts": ["--precompile-batches", "16", "--max-prefix-steps", "64"],
        "codec": ["--precompile-batches", "16"],
    }
    assert service_flags(None) == {"perception": [], "llm": [], "tts": [], "codec": []}
    for bad, needle in (("orchestrator=--x", "NAME one of"), ("llm", "NAME=FLAGS"), ("llm='--x", "quotation")):
        with pytest.raises(ValueError, match=needle):
            parse_service_flags(bad)


def test_service_env_takes_a_name_a_variable_and_a_value_and_a_services_own_setting_wins():
    entries = [parse_service_env("perception=MLX_USE_CUDA_GRAPHS=0"), parse_service_env("all=MLX_USE_CUDA_GRAPHS=1"),
               parse_service_env("all=CUDA_MPS_CLIENT_PRIORITY=1"), parse_service_env("llm=OPTS=a=b c")]
    assert entries[3] == ("llm", {"OPTS": "a=b c"})
    assert service_envs(entries) == {
        "perception": {"MLX_USE_CUDA_GRAPHS": "0", "CUDA_MPS_CLIENT_PRIORITY": "1"},
        "llm": {"MLX_USE_CUDA_GRAPHS": "1", "CUDA_MPS_CLIENT_PRIORITY": "1", "OPTS": "a=b c"},
        "tts": {"MLX_USE_CUDA_GRAPHS": "1", "CUDA_MPS_CLIENT_PRIORITY": "1"},
        "codec": {"MLX_USE_CUDA_GRAPHS": "1", "CUDA_MPS_CLIENT_PRIORITY": "1"},
    }
    assert parse_service_env("tts=EMPTY=") == ("tts", {"EMPTY": ""})
    assert service_envs(None) == {"perception": {}, "llm": {}, "tts": {}, "codec": {}}
    for bad in ("vision=A=1", "llm=A", "llm", "llm==1", "llm=1A=2", "llm=A-B=1"):
        with pytest.raises(ValueError, match="expected NAME=VAR=VALUE"):
            parse_service_env(bad)
