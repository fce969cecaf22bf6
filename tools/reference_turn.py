"""One turn of the reference implementation on an input file; run by tools/check_parity.py with the reference's
own Python (mlx-vlm, mlx-audio), never imported by the project.

    .ref/bin/python tools/reference_turn.py {offline,stream} --model DIR --input FILE --out OUT.npz
        [--seed N] [--system-prompt TEXT] [--extra-decoding-seconds S]

offline: `VoiceChatSession.generate` on the file (the language cache on). stream: the streaming session fed the
file (read by the reference's `load_audio`, the decoding silence appended) in 1280-sample pushes, then flushed
with the partial frame padded. OUT.npz holds the text and function ids, the speech codes and samples of the
input's frames, and in `meta` (JSON) the user transcript, the assistant text and the function text.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

FRAME_SAMPLES = 1280


def offline(model, tokenizer, args) -> tuple[dict, dict]:
    session = model.create_session(tokenizer)
    result = session.generate(args.input, system_prompt=args.system_prompt,
                              extra_decoding_seconds=args.extra_decoding_seconds, seed=args.seed,
                              use_language_cache=True)
    arrays = {"text_tokens": np.array(result.text_tokens), "function_tokens": np.array(result.function_tokens),
              "audio_codes": np.array(result.audio_codes), "audio": np.array(result.audio)}
    return arrays, {"transcript": result.user_transcript, "text": result.text,
                    "function_text": session._decode_text(result.function_tokens)}


def stream(model, tokenizer, args) -> tuple[dict, dict]:
    import mlx.core as mx
    from mlx_audio.stt.utils import load_audio

    rate = model.config.input_sample_rate
    session = model.create_session(tokenizer).create_streaming_session(system_prompt=args.system_prompt,
                                                                       seed=args.seed)
    waveform = load_audio(args.input, sr=rate)
    waveform = np.array(mx.pad(waveform, (0, round(args.extra_decoding_seconds * rate))))
    events = []
    for start in range(0, len(waveform), FRAME_SAMPLES):
        events += session.push_audio(waveform[start : start + FRAME_SAMPLES])
    events += session.flush(pad_partial=True)
    audio = [e for e in events if e.kind == "audio"]
    texts = {"user_transcript_delta": "", "assistant_text_delta": "", "function_delta": ""}
    for event in events:
        if event.kind in texts:
            texts[event.kind] = event.text
    frames = len(audio)  # the ids before them are the system prompt's positions
    arrays = {
        "text_tokens": np.array(session._text_tokens[len(session._text_tokens) - frames :]),
        "function_tokens": np.array(session._function_tokens[len(session._function_tokens) - frames :]),
        "audio_codes": np.stack([np.array(e.audio_codes) for e in audio]),
        "audio": np.concatenate([np.array(e.samples) for e in audio]),
    }
    return arrays, {"transcript": texts["user_transcript_delta"], "text": texts["assistant_text_delta"],
                    "function_text": texts["function_delta"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["offline", "stream"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system-prompt", default=None)
    parser.add_argument("--extra-decoding-seconds", type=float, default=3.0)
    args = parser.parse_args()

    from mlx_vlm.utils import load

    model, tokenizer = load(args.model)
    arrays, meta = (offline if args.mode == "offline" else stream)(model, tokenizer, args)
    np.savez(args.out, **arrays, meta=np.array(json.dumps(meta, ensure_ascii=False)))


if __name__ == "__main__":
    main()
