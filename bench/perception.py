"""Perception's one-session frame taken apart: where a push's time goes.

    python -m bench.perception --model DIR [--frames N] [--warmup W] [--float32-weights] [--count-kernels] [--json]

Two streams take the same audio (the bundled question, then silence). One pushes each frame as the online
session does and is timed whole. The other runs the same push in parts with an evaluation after each, and times
each part on its own:

    mel       the frame's 1280 samples through the streaming log-mel front end
    encoder   the cache-aware conformer step over the new mel frames
    rnnt      the projection and the RNNT's greedy decoding (its rounds of steps, one host read each)

The parts' sum exceeds the whole push by what the extra evaluations cost. Also reported: the RNNT's symbols and
the whole push's host reads per frame. `--count-kernels` counts each part's operations instead (see
`bench.stages.KernelCounter`; its timings are not worth reading).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import mlx.core as mx

from bench.stages import KernelCounter, SyncCounter, frames_of, summarize
from services.common.loading import LoadOptions, process_settings
from services.perception.engine import PerceptionEngine, PerceptionStream

PARTS = ("mel", "encoder", "rnnt")


def push_in_parts(stream: PerceptionStream, samples, clock) -> None:
    """`stream.push(samples)` with an evaluation after each part, `clock(name)` called as part `name` ends."""
    mel = stream.mel.push(stream.check_frame(samples))
    mx.eval(mel, *stream.mel.arrays())
    clock("mel")
    chunks = stream.encoder.push(mel[None])
    mx.eval(*chunks, *stream.encoder.arrays())
    clock("encoder")
    stream.emit(chunks)
    clock("rnnt")


class Clock:
    """Marks the end of each part of a parted push: its time, and with a counter its kernels."""

    def __init__(self, counter: KernelCounter | None) -> None:
        self.counter = counter
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.kernels: collections.Counter[str] = collections.Counter()
        self.timed = False
        self._first = self._last = 0.0

    def start(self, timed: bool) -> None:
        self.timed = timed
        self._first = self._last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        if self.timed:
            self.times[name].append((now - self._last) * 1000.0)
        if self.counter is not None:
            if self.timed:
                self.kernels[name] += sum(self.counter.counts.values())
            self.counter.counts.clear()
        self._last = now

    def total(self) -> None:
        if self.timed:
            self.times["parts"].append((self._last - self._first) * 1000.0)


def run(model: Path, frames: int, warmup: int, float32_weights: bool, count_kernels: bool) -> dict:
    engine = PerceptionEngine.load(model, LoadOptions(float32_weights=float32_weights))
    audio = frames_of(warmup + frames)
    whole, parted = engine.open_stream(), engine.open_stream()
    counter = KernelCounter() if count_kernels else None
    clock = Clock(counter)
    reads, symbols, pushes = [], [], []
    for n, samples in enumerate(audio):
        timed = n >= warmup
        with SyncCounter() as syncs:
            start = time.perf_counter()
            out = whole.push(samples)
            elapsed = time.perf_counter() - start
        if timed:
            pushes.append(elapsed * 1000.0)
            symbols.append(len(out.token_ids))
            reads.append(syncs.take()["read"])
        clock.start(timed)
        if counter is not None:
            with counter:
                push_in_parts(parted, samples, clock)
        else:
            push_in_parts(parted, samples, clock)
        clock.total()
    report = {"push": summarize(pushes), **{name: summarize(values) for name, values in clock.times.items()}}
    report["symbols_per_frame"] = sum(symbols) / len(symbols)
    report["reads_per_frame"] = sum(reads) / len(reads)
    if count_kernels:
        report["kernels_per_frame"] = {name: clock.kernels[name] / frames for name in PARTS}
    return report


def main(argv: list[str] | None = None) -> int:
    process_settings()  # before this process's engines (or the services it starts) run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=80, help="frames left out (the attention caches fill in 70)")
    parser.add_argument("--float32-weights", action="store_true")
    parser.add_argument("--count-kernels", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = run(args.model, args.frames, args.warmup, args.float32_weights, args.count_kernels)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'part':<9} {'p50 ms':>8} {'p95 ms':>8} {'mean ms':>8}")
    for name in ("push", "parts", *PARTS):
        row = report[name]
        print(f"{name:<9} {row['p50_ms']:8.2f} {row['p95_ms']:8.2f} {row['mean_ms']:8.2f}")
    print(f"RNNT symbols per frame {report['symbols_per_frame']:.2f}, host reads per frame "
          f"{report['reads_per_frame']:.2f}")
    if args.count_kernels:
        print("kernels per frame: " + ", ".join(f"{k} {v:.0f}" for k, v in report["kernels_per_frame"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
