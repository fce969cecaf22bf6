"""Times the reference implementation; run by bench/rtf.py with the reference's own Python, never imported.

    .ref/bin/python bench/reference_driver.py offline --model DIR --seconds S [--cached] [--repeat N]
    .ref/bin/python bench/reference_driver.py online --model DIR --seconds S [--drop N]

Prints one JSON object. offline: wall seconds per run of `VoiceChatSession.generate` on examples/question.wav
padded with silence to S seconds (the same input bench/rtf.py gives our stack) and the frame count. online: the
streaming session's own profile summary on the same input, first-audio latency and peak memory.
"""

from __future__ import annotations

import argparse
import json
import time
import wave
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def question_padded(seconds: float) -> np.ndarray:
    with wave.open(str(ROOT / "examples" / "question.wav")) as wav:
        speech = np.frombuffer(wav.readframes(wav.getnframes()), "<i2").astype(np.float32) / 32768
    total = max(len(speech), round(seconds * 16_000))
    return np.concatenate([speech, np.zeros(total - len(speech), np.float32)])


def offline(model: str, seconds: float, cached: bool, repeat: int) -> dict:
    from mlx_vlm.utils import load

    loaded, tokenizer = load(model)
    session = loaded.create_session(tokenizer)
    audio = mx.array(question_padded(seconds))
    runs, frames = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        result = session.generate(audio, extra_decoding_seconds=0.0, seed=0, use_language_cache=cached)
        runs.append(time.perf_counter() - start)
        frames = int(result.text_tokens.shape[0])
    return {"runs_s": runs, "frames": frames, "device": str(mx.default_device())}


def online(model: str, seconds: float, drop: int) -> dict:
    """The reference's streaming session fed 1280-sample pushes as fast as it takes them, then flushed."""
    import resource

    from mlx_vlm.utils import load

    loaded, tokenizer = load(model)
    audio = question_padded(seconds)
    warm = loaded.create_session(tokenizer).create_streaming_session(seed=0)
    for offset in range(0, 16_000, 1280):  # one second first: kernels compile on first use
        warm.push_audio(audio[offset : offset + 1280])
    warm.flush()
    session = loaded.create_session(tokenizer).create_streaming_session(seed=0, profile=True)
    start = time.perf_counter()
    first_audio = None
    for offset in range(0, len(audio), 1280):
        events = session.push_audio(audio[offset : offset + 1280])
        if first_audio is None and any(e.kind == "audio" for e in events):
            first_audio = (time.perf_counter() - start) * 1000.0
    session.flush()
    summary = session.profile.summary(drop_first=drop)
    return {
        "summary": summary,
        "intervals_ms": [f.total_ms for f in session.profile.frames[drop:]],
        "first_audio_ms": first_audio,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_device_mb": mx.get_peak_memory() / 2**20,
        "device": str(mx.default_device()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["offline", "online"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--cached", action="store_true")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--drop", type=int, default=5)
    args = parser.parse_args()
    if args.mode == "online":
        print(json.dumps(online(args.model, args.seconds, args.drop)))
    else:
        print(json.dumps(offline(args.model, args.seconds, args.cached, args.repeat)))


if __name__ == "__main__":
    main()
