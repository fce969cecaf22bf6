"""config.json parsing: the real model's values, the accepted variants, and the errors that name a field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from services.common.config import ConfigError, QuantSpec, VoiceChatConfig

FULL = json.loads((Path(__file__).parents[1] / "fixtures" / "config_full.json").read_text())


def test_real_model_config_parses_to_spec_values():
    cfg = VoiceChatConfig.from_dict(FULL)
    t, a, tts, c = cfg.text_config, cfg.audio_config, cfg.tts_config, cfg.codec_config
    assert (t.hidden_size, t.num_hidden_layers, t.vocab_size, t.attention_head_dim) == (4480, 56, 131072, 128)
    assert [i for i, b in enumerate(t.block_types) if b == "*"] == [14, 21, 30, 39]
    assert t.block_types.count("M") == 27 and t.block_types.count("-") == 25
    assert t.mamba_intermediate == 10240 and t.mamba_conv_dim == 10240 + 2 * 8 * 128
    assert a.preprocessor.win_length == 400 and a.preprocessor.hop_length == 160
    assert a.encoder.att_context_size == ((70, 0),) and a.encoder.left_context == 70
    assert a.encoder.subsampled_features == 17  # 128 -> 65 -> 33 -> 17
    assert a.encoder.conv_padding == (8, 0)
    assert (a.decoder.vocab_size, a.joint.num_classes, cfg.rnnt_blank_id) == (1024, 1024, 1024)
    assert len(cfg.rnnt_vocabulary) == 1024
    assert [tts.is_global_layer(i) for i in range(12)] == [False] * 5 + [True] + [False] * 5 + [True]
    assert tts.character_encoder.attn_logit_softcapping == 50.0 and tts.mog_head.low_rank == 64
    assert c.waveform_to_token_ratio == 1764 and c.stft_channels == 18 and c.stage_channels == [384, 768, 1536]
    assert cfg.input_frame_samples == 1280 and cfg.output_frame_samples == 1764
    assert cfg.special_text_ids == {1, 2, 11, 12}
    assert cfg.quantization.for_module("stt_model.lm_head") == QuantSpec(4, 64)
    assert cfg.quantization.for_module("stt_model.perception.proj") is None


def test_defaults_equal_the_real_model():
    parsed = VoiceChatConfig.from_dict(FULL)
    default = VoiceChatConfig()
    for section in ("text_config", "audio_config", "tts_config", "codec_config"):
        assert getattr(default, section) == getattr(parsed, section), section


def test_att_context_size_accepts_a_pair_or_a_list_of_pairs():
    for value in ([70, 0], [[70, 0]], [[70, 0], [70, 1]]):
        values = {"audio_config": {"encoder": {"att_context_size": value}}}
        assert VoiceChatConfig.from_dict(values).audio_config.encoder.att_context_size[0] == (70, 0)


def test_unknown_keys_are_ignored():
    values = copy.deepcopy(FULL)
    values["audio_config"]["encoder"]["brand_new_option"] = 3
    assert VoiceChatConfig.from_dict(values).audio_config.encoder.d_model == 1024


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"speaker": "Bob"}, "speaker"),
        ({"tts_config": {"top_p": 1.5}}, "tts_config.top_p"),
        ({"text_config": {"hidden_size": "wide"}}, "text_config.hidden_size"),
        ({"text_config": {"hybrid_override_pattern": "M-X"}}, "text_config.hybrid_override_pattern"),
        ({"audio_config": {"encoder": {"att_context_size": [70]}}}, "audio_config.encoder.att_context_size"),
        ({"audio_config": {"encoder": {"n_heads": 7}}}, "audio_config.encoder.n_heads"),
        ({"codec_config": {"latent_dim": 256}}, "codec_config.latent_dim"),
        ({"rnnt_blank_id": 5}, "rnnt_blank_id"),
        ({"quantization": {"group_size": 64, "bits": 7}}, "quantization"),
    ],
)
def test_a_wrong_value_names_its_field(patch, field):
    values = copy.deepcopy(FULL)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            for k, v in value.items():
                if isinstance(v, dict):
                    values[key][k].update(v)
                else:
                    values[key][k] = v
        else:
            values[key] = value
    with pytest.raises(ConfigError) as err:
        VoiceChatConfig.from_dict(values)
    assert f"config.json: {field}:" in str(err.value)


def test_a_folder_without_config_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="--model must point at a converted VoiceChat checkpoint"):
        VoiceChatConfig.load(tmp_path)
