"""What a session's snapshot costs on each network: its state's bytes, from a checkpoint config alone.

    python -m tools.snapshot_cost [--preset full] [--prompt-tokens 200] [--ages 10,60,300,600,3600]
                                  [--max-context 8192] [--intervals 10,60]

The state of each network's session (what `services.common.snapshot` carries; tests/unit/test_snapshot_cost.py
checks these sums against real snapshots of the small presets), and what one interval costs: a snapshot asked
against the last one (a delta) carries each attention cache's keys written since, at most what it holds, and the
fixed-size states whole:

- perception: per encoder layer the attention cache (left context x 2 d_model) and the conv cache (kernel - 1 x
  d_model), the RNNT's LSTM state, the mel stream's sample tail and mel cache, all float32; constant.
- language: per Mamba layer the conv tail (kernel - 1 x conv_dim) and the SSM state (heads x head_dim x state),
  float32; per attention layer keys and values of every position (prompt and frames): grows 2 x kv_heads x
  head_dim x 4 B per layer a frame, up to the services' --max-context positions past the prompt (bfloat16, 2 B,
  while the streaming session's bf16 prompt prefix still fits the cache's first block of 256 positions: its first
  growth by a frame's float32 keys turns it float32, as the reference's does).
- speech: per backbone layer keys and values of two rows (the guided and the unguided) of every position (speaker
  prompt, prefix steps, frames; a local layer at most `sliding_window` of them, a global one at most
  --max-context past the prompt and prefix), float32.
- codec: per decoder block its tail (kernel - 1 x channels) and the spectral context, bfloat16; constant.
"""

from __future__ import annotations

import argparse
import math
import sys

from services.common import cache
from services.common.config import VoiceChatConfig
from services.common.loading import DEFAULT_MAX_CONTEXT
from services.perception.streaming import SUBSAMPLING_MEL_CACHE

F32, BF16 = 4, 2


def perception_bytes(cfg: VoiceChatConfig) -> int:
    enc, audio = cfg.audio_config.encoder, cfg.audio_config
    left, d = enc.att_context_size[0][0], enc.d_model
    caches = enc.n_layers * (left * 2 * d + (enc.conv_kernel_size - 1) * d) * F32
    lstm = 2 * audio.decoder.pred_rnn_layers * audio.decoder.pred_hidden * F32
    pre = audio.preprocessor
    hop = int(pre.window_stride * pre.sample_rate)
    samples = cfg.input_frame_samples + hop  # the frame's samples and the hop kept behind the next frame
    mel = (SUBSAMPLING_MEL_CACHE + enc.subsampling_factor - 1) * pre.features  # the mel cache, at its longest
    return caches + lstm + (samples + mel) * F32


def held(positions: int, keep: int, max_context: int | None) -> int:
    """Positions an attention cache holds: every one, or with a bound the kept ones and `max_context` after."""
    return min(positions, keep + max_context) if max_context else positions


def sent(holds: int, new: int | None) -> int:
    """Positions of a cache holding `holds` that a snapshot sends: all (new None: a whole snapshot), or in a delta
    the `new` ones written since the last (all of them once that passes what it holds)."""
    return holds if new is None else min(new, holds)


def language_bytes(cfg: VoiceChatConfig, positions: int, prompt: int = 0,
                   max_context: int | None = DEFAULT_MAX_CONTEXT, new: int | None = None) -> int:
    text = cfg.text_config
    pattern = text.hybrid_override_pattern
    conv_dim = text.mamba_num_heads * text.mamba_head_dim + 2 * text.n_groups * text.ssm_state_size
    mamba = ((text.conv_kernel - 1) * conv_dim + text.mamba_num_heads * text.mamba_head_dim * text.ssm_state_size)
    first_block = -(-prompt // cache.GROW) * cache.GROW  # a bf16 prompt's buffer, until a frame grows it
    attention = 2 * text.num_key_value_heads * text.head_dim * (BF16 if positions <= first_block else F32)
    return pattern.count("M") * mamba * F32 + pattern.count("*") * attention * sent(
        held(positions, prompt, max_context), new)


def speech_bytes(cfg: VoiceChatConfig, positions: int, keep: int = 0,
                 max_context: int | None = DEFAULT_MAX_CONTEXT, new: int | None = None) -> int:
    tts = cfg.tts_config
    per_layer = 2 * 2 * tts.num_key_value_heads * tts.head_dim * F32  # two rows, keys and values
    layers = [held(positions, keep, max_context) if cfg.tts_config.is_global_layer(i)
              else min(positions, tts.sliding_window) for i in range(tts.num_hidden_layers)]
    # and the random key, the codes fed back
    return per_layer * sum(sent(n, new) for n in layers) + 2 * 4 + tts.num_quantizers * 4


def codec_bytes(cfg: VoiceChatConfig) -> int:
    codec = cfg.codec_config
    tails = sum(codec.blocks_per_stage * (codec.block_kernel_size - 1) * codec.base_channels * m
                for m in codec.channel_multipliers)
    context = 2 * math.ceil((codec.n_fft - codec.hop_length) / 2 / codec.hop_length)
    return (tails + 2 * context * (codec.n_fft // 2 + 1)) * BF16


def state_bytes(cfg: VoiceChatConfig, frames: int, prompt_tokens: int = 0,
                max_context: int | None = DEFAULT_MAX_CONTEXT, since: int | None = None) -> dict[str, int]:
    """Each network's session state after `frames` frames behind a system prompt of `prompt_tokens` ids, the
    services' attention caches bounded to `max_context` positions past the prompt (None: unbounded); with `since`,
    the arrays of a delta against a snapshot taken `since` frames before."""
    prompt_frames = int(cfg.tts_config.audio_prompt_duration / cfg.frame_duration)  # the speaker prompt, 37
    prefix = max(prompt_tokens - 1, 0)
    return {"perception": perception_bytes(cfg),
            "llm": language_bytes(cfg, prompt_tokens + frames, prompt_tokens, max_context, since),
            "tts": speech_bytes(cfg, prompt_frames + prefix + frames, prompt_frames + prefix, max_context, since),
            "codec": codec_bytes(cfg)}


def main(argv: list[str] | None = None) -> int:
    from tools.make_checkpoint import PRESETS, preset_config

    parser = argparse.ArgumentParser(prog="python -m tools.snapshot_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="system prompt ids, bos and eos included")
    parser.add_argument("--ages", default="10,60,300,600,3600", help="session ages, seconds")
    parser.add_argument("--max-context", type=int, default=DEFAULT_MAX_CONTEXT,
                        help=f"the services' --max-context (default {DEFAULT_MAX_CONTEXT}; 0: unbounded)")
    parser.add_argument("--intervals", default="10,60",
                        help="--snapshot-seconds values: each adds a column, a delta's bytes (all networks)")
    args = parser.parse_args(argv)
    cfg = VoiceChatConfig.from_dict(preset_config(args.preset))
    intervals = [float(s) for s in args.intervals.split(",")] if args.intervals else []
    names = ("perception", "llm", "tts", "codec", "all", *(f"delta {s:g}s" for s in intervals))
    print(f"{'age':>6}  " + "  ".join(f"{name:>12}" for name in names))
    for age in (float(a) for a in args.ages.split(",")):
        frames = round(age / cfg.frame_duration)
        sizes = state_bytes(cfg, frames, args.prompt_tokens, args.max_context)
        deltas = [sum(state_bytes(cfg, frames, args.prompt_tokens, args.max_context,
                                  round(s / cfg.frame_duration)).values()) for s in intervals]
        print(f"{age:5g}s  " + "  ".join(f"{b / 1e6:9.2f} MB" for b in (*sizes.values(), sum(sizes.values()), *deltas)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
