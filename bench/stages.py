"""Per-stage cost of one 80 ms frame, each network's engine called in this process.

    python -m bench.stages --model DIR [--frames N] [--warmup W] [--json]

Drives each engine's streaming path the way an online session does (perception push of 1280 samples, one
language step, one speech step, one codec frame decode) on the bundled question plus silence, one stage at a
time, and prints per-stage p50/p95/mean in ms, the sum, and the real-time factor that sum implies for a
sequential frame loop. Each timing ends after the stage's outputs are evaluated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import wave
from pathlib import Path

import mlx.core as mx
import numpy as np

from orchestrator.profile import percentile
from services.codec.engine import CodecEngine
from services.llm.engine import LanguageEngine
from services.perception.engine import PerceptionEngine
from services.tts.engine import TTSEngine

ROOT = Path(__file__).resolve().parents[1]
FRAME_MS = 80.0


def summarize(values: list[float]) -> dict[str, float]:
    return {"p50_ms": percentile(values, 0.5), "p95_ms": percentile(values, 0.95), "mean_ms": statistics.fmean(values)}


def read_question() -> np.ndarray:
    """The bundled 16 kHz PCM16 question, read with the standard library (no soundfile on GPU hosts)."""
    with wave.open(str(ROOT / "examples" / "question.wav")) as wav:
        return np.frombuffer(wav.readframes(wav.getnframes()), "<i2").astype(np.float32) / 32768


def frames_of(frames: int) -> np.ndarray:
    speech = read_question()
    total = np.zeros(frames * 1280, np.float32)
    total[: min(len(speech), len(total))] = speech[: len(total)]
    return total.reshape(frames, 1280)


def run(model: Path, frames: int, warmup: int) -> dict:
    t0 = time.perf_counter()
    perception, language = PerceptionEngine.load(model), LanguageEngine.load(model)
    speech, codec = TTSEngine.load(model), CodecEngine.load(model)
    load_s = time.perf_counter() - t0
    audio = frames_of(frames + warmup)
    stream = perception.open_stream()
    session = language.open_session("", prefix_dtype="bfloat16")
    voice = speech.open_session(0, codec.encode_prompt_codes(speech.prompt_frames), 0)
    decoder = codec.open_stream()
    times: dict[str, list[float]] = {"perception": [], "language": [], "tts": [], "codec": []}
    for index, chunk in enumerate(audio):
        marks = [time.perf_counter()]
        frame = stream.push(chunk)
        marks.append(time.perf_counter())
        step = session.step(frame.audio_embedding)
        marks.append(time.perf_counter())
        _, clean = voice.step(step.text_id)
        marks.append(time.perf_counter())
        samples = decoder.decode_frame(index, clean)
        mx.eval(mx.array(samples))
        marks.append(time.perf_counter())
        if index >= warmup:
            for stage, start, end in zip(times, marks, marks[1:], strict=False):
                times[stage].append((end - start) * 1000.0)
    stages = {name: summarize(values) for name, values in times.items()}
    total = [sum(values) for values in zip(*times.values(), strict=True)]
    return {
        "model": str(model),
        "device": str(mx.default_device()),
        "frames": frames,
        "warmup_frames": warmup,
        "load_s": round(load_s, 2),
        "stages": stages,
        "frame": summarize(total),
        "realtime_factor": statistics.fmean(total) / FRAME_MS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = run(args.model, args.frames, args.warmup)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['model']} on {report['device']}: {args.frames} frames after {args.warmup} warm-up, "
          f"load {report['load_s']} s")
    for name, row in {**report["stages"], "frame": report["frame"]}.items():
        print(f"  {name:<11} p50 {row['p50_ms']:8.2f} ms   p95 {row['p95_ms']:8.2f} ms   mean {row['mean_ms']:8.2f} ms")
    print(f"  real-time factor of a sequential frame loop: {report['realtime_factor']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
