"""Per-stage cost of one 80 ms frame, each network's engine called in this process.

    python -m bench.stages --model DIR [--frames N] [--warmup W] [--count-syncs | --count-kernels | --split-eval]
                           [--float32-weights] [--json]

Drives each engine's streaming path the way an online session does (perception push of 1280 samples, one
language step, one speech step, one codec frame decode) on the bundled question plus silence, one stage at a
time, and prints per-stage p50/p95/mean in ms, the sum, and the real-time factor that sum implies for a
sequential frame loop. Each timing ends after the stage's outputs are evaluated.

`--count-syncs` also counts each stage's host synchronisations per frame (see `SyncCounter`); the counting
wrappers cost a little Python time, so compare timings only between runs that both count or both don't.
`--split-eval` splits each stage's time into the part inside evaluations and host reads and the rest (see
`EvalTimer`). `--count-kernels` counts the operations each stage's `mx.eval` calls run per frame (see
`KernelCounter`); it writes every graph out, so its timings are not worth reading.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import re
import statistics
import tempfile
import time
import wave
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from orchestrator.profile import percentile
from services.codec.engine import CodecEngine
from services.common.loading import LoadOptions, process_settings
from services.llm.engine import LanguageEngine
from services.perception.engine import PerceptionEngine
from services.tts.engine import TTSEngine

ROOT = Path(__file__).resolve().parents[1]
FRAME_MS = 80.0


class _Patches:
    """Functions wrapped while installed (`with ...:`), the originals put back on exit."""

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner: object, name: str, wrapper) -> None:
        """Replace owner.name by wrapper(original)."""
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper(original))

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


# the host reads of an array's value: each evaluates what no earlier evaluation covered, and waits for it
READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


def _is_read(args: tuple, only_mlx: bool) -> bool:
    return not only_mlx or bool(args and isinstance(args[0], mx.array))


class GraphNodes(_Patches):
    """Counts the operations of the graphs `mx.eval` evaluates while installed (`with GraphNodes() as nodes:`), as
    `mx.export_to_dot` draws them: every operation an evaluation reaches that no earlier one computed (a compiled
    function's call is one; the arrays computed before are inputs, not counted). On a GPU each operation outside a
    compiled function launches a kernel or more, so a step's count says, on any machine, how much it launches
    beside another step's. `take()` gives the count since the last take."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __enter__(self) -> GraphNodes:
        def wrapper(original):
            def counted(*args):
                arrays = [a for _, a in tree_flatten(list(args)) if isinstance(a, mx.array)]
                drawn = io.StringIO()
                mx.export_to_dot(drawn, *arrays)
                self.count += sum(1 for line in drawn.getvalue().splitlines() if "[" in line and "->" not in line)
                return original(*args)
            return counted

        self._wrap(mx, "eval", wrapper)
        return self

    def take(self) -> int:
        """The nodes counted since the last take, then reset."""
        count, self.count = self.count, 0
        return count


class EvalSplit(_Patches):
    """Splits the time of every `mx.eval` made while it is installed (`with EvalSplit() as split:`) in two: the
    `mx.async_eval` of its arrays (the graph walked and, on a GPU, every kernel launched: host work) and the wait
    for the device after it. `take()` gives the seconds of each since the last take. What a step spends outside
    both is its graph's building in Python (and host reads of arrays already evaluated)."""

    def __init__(self) -> None:
        super().__init__()
        self.launch_s = self.wait_s = 0.0

    def __enter__(self) -> EvalSplit:
        def wrapper(original):
            launch = mx.async_eval

            def split(*args):
                start = time.perf_counter()
                launch(*args)
                launched = time.perf_counter()
                original(*args)
                self.launch_s += launched - start
                self.wait_s += time.perf_counter() - launched
            return split

        self._wrap(mx, "eval", wrapper)
        return self

    def take(self) -> tuple[float, float]:
        """(launch seconds, wait seconds) since the last take, then reset."""
        taken = (self.launch_s, self.wait_s)
        self.launch_s = self.wait_s = 0.0
        return taken


class SyncCounter(_Patches):
    """Counts the host synchronisations made while it is installed (`with SyncCounter() as counter:`).

    `eval` counts `mx.eval` calls; `read` counts host reads of an array's value (`item`, `tolist`, `int`,
    `float`, `bool` or index conversion, `np.array`/`np.asarray` of an mx.array). A read of an array that no
    earlier `mx.eval` covered evaluates its graph and waits for it, like an `mx.eval`; a read after one only
    copies. `counts` holds the totals by name (`eval`, `item`, `tolist`, `__int__`, ..., `numpy`).
    """

    READS = READS

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def _count(self, owner: object, name: str, kind: str, only_mlx: bool = False) -> None:
        def wrapper(original):
            def counted(*args, **kwargs):
                if _is_read(args, only_mlx):
                    self.counts[kind] += 1
                return original(*args, **kwargs)
            return counted

        self._wrap(owner, name, wrapper)

    def __enter__(self) -> SyncCounter:
        self._count(mx, "eval", "eval")
        for name in self.READS:
            self._count(mx.array, name, name)
        for name in ("array", "asarray"):
            self._count(np, name, "numpy", only_mlx=True)
        return self

    def take(self) -> dict[str, int]:
        """The counts since the last take: {"eval": n, "read": m, "total": n + m}, then reset."""
        evals = self.counts["eval"]
        reads = sum(n for kind, n in self.counts.items() if kind != "eval")
        self.counts.clear()
        return {"eval": evals, "read": reads, "total": evals + reads}


class EvalTimer(_Patches):
    """Splits a stage's time while it is installed (`with EvalTimer() as timer:`): the time spent inside
    `mx.eval`, `mx.async_eval` and host reads of array values (on a GPU: MLX encoding and launching the
    kernels, then waiting for them) against the rest (Python building the graph, and the engine's own host
    work). A stage whose time is mostly outside is bound by Python; mostly inside, by MLX's dispatch or the
    device."""

    def __init__(self) -> None:
        super().__init__()
        self.inside_s = 0.0
        self._depth = 0

    def _time(self, owner: object, name: str, only_mlx: bool = False) -> None:
        def wrapper(original):
            def timed(*args, **kwargs):
                if self._depth or not _is_read(args, only_mlx):
                    return original(*args, **kwargs)
                self._depth += 1
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.inside_s += time.perf_counter() - start
                    self._depth -= 1
            return timed

        self._wrap(owner, name, wrapper)

    def __enter__(self) -> EvalTimer:
        self._time(mx, "eval")
        self._time(mx, "async_eval")
        for name in READS:
            self._time(mx.array, name)
        for name in ("array", "asarray"):
            self._time(np, name, only_mlx=True)
        return self

    def take(self) -> dict[str, float]:
        """{"inside_ms": ...} since the last take, then reset."""
        inside, self.inside_s = self.inside_s * 1000.0, 0.0
        return {"inside_ms": inside}


class KernelCounter:
    """Counts the operations the `mx.eval` calls run while it is installed (`with KernelCounter() as counter:`).

    Before each evaluation the graph of the arrays evaluated is exported (`mx.export_to_dot`) and its primitives
    counted by name; views (reshapes, slices, transposes, broadcasts, ...) are left out, since they launch no
    kernel of their own. Arrays already evaluated are not in the graph, so each primitive is counted once. A
    compiled function's fused elementwise chain is one primitive (`Compiled...`). Host reads that evaluate an
    array themselves (`item`, `tolist`, ...) are not seen: the engines read only what an `mx.eval` covered.
    """

    VIEWS = frozenset({"Squeeze", "Reshape", "Broadcast", "Slice", "Split", "Transpose", "ExpandDims", "Flatten",
                       "Unflatten", "AsStrided", "StopGradient", "Depends"})
    _LABEL = re.compile(r'label ="([A-Za-z_0-9]+)"')

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._original = None

    def __enter__(self) -> KernelCounter:
        self._original = original = mx.eval

        def counted(*args):
            arrays = [a for a in _flatten(args) if isinstance(a, mx.array)]
            if arrays:
                with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
                    mx.export_to_dot(dot.name, *arrays)
                    self.counts.update(name for name in self._LABEL.findall(dot.read()) if name not in self.VIEWS)
            return original(*args)

        mx.eval = counted
        return self

    def __exit__(self, *exc: object) -> None:
        mx.eval = self._original

    def take(self) -> dict[str, int]:
        """{"kernels": n, "top": every primitive's count, most frequent first} since the last take, then reset."""
        report = {"kernels": sum(self.counts.values()), "top": dict(self.counts.most_common())}
        self.counts.clear()
        return report


def _flatten(tree):
    if isinstance(tree, list | tuple):
        for item in tree:
            yield from _flatten(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _flatten(item)
    else:
        yield tree


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


def run(model: Path, frames: int, warmup: int, count_syncs: bool = False, count_kernels: bool = False,
        split_eval: bool = False, float32_weights: bool = False) -> dict:
    t0 = time.perf_counter()
    wide = LoadOptions(float32_weights=float32_weights)
    perception, language = PerceptionEngine.load(model, wide), LanguageEngine.load(model, options=wide)
    speech, codec = TTSEngine.load(model, wide), CodecEngine.load(model)
    load_s = time.perf_counter() - t0
    audio = frames_of(frames + warmup)
    stream = perception.open_stream()
    session = language.open_session("", prefix_dtype="bfloat16")
    voice = speech.open_session(0, codec.encode_prompt_codes(speech.prompt_frames), 0)
    decoder = codec.open_stream()
    times: dict[str, list[float]] = {"perception": [], "language": [], "tts": [], "codec": []}
    syncs: dict[str, list[dict[str, int]]] = {name: [] for name in times}
    counter = KernelCounter() if count_kernels else EvalTimer() if split_eval else SyncCounter()
    for index, chunk in enumerate(audio):
        counted = (count_syncs or count_kernels or split_eval) and index >= warmup
        with counter if counted else contextlib.nullcontext():
            marks, counts = [time.perf_counter()], []
            frame = stream.push(chunk)
            marks.append(time.perf_counter())
            counts.append(counter.take())
            step = session.step(frame.audio_embedding)
            marks.append(time.perf_counter())
            counts.append(counter.take())
            _, clean = voice.step(step.text_id)
            marks.append(time.perf_counter())
            counts.append(counter.take())
            samples = decoder.decode_frame(index, clean)
            marks.append(time.perf_counter())
            counts.append(counter.take())
        mx.eval(mx.array(samples))
        marks[-1] = time.perf_counter()
        if index >= warmup:
            for stage, start, end, count in zip(times, marks[:-1], marks[1:], counts, strict=True):
                times[stage].append((end - start) * 1000.0)
                syncs[stage].append(count)
    stages = {name: summarize(values) for name, values in times.items()}
    if count_kernels:
        for name, rows in syncs.items():
            top: collections.Counter[str] = collections.Counter()
            for row in rows:
                top.update(row["top"])
            stages[name]["kernels"] = {"mean": statistics.fmean(row["kernels"] for row in rows),
                                       "max": max(row["kernels"] for row in rows),
                                       "top": [name for name, _ in top.most_common(5)],
                                       "per_frame": {name: count / len(rows) for name, count in top.most_common()}}
    elif split_eval:
        for name, rows in syncs.items():
            inside = [row["inside_ms"] for row in rows]
            stages[name]["inside_eval"] = summarize(inside)
            stages[name]["outside_eval"] = summarize([t - i for t, i in zip(times[name], inside, strict=True)])
    elif count_syncs:
        for name, rows in syncs.items():
            stages[name]["syncs"] = {
                kind: {"mean": statistics.fmean(row[kind] for row in rows),
                       "max": max(row[kind] for row in rows)} for kind in ("eval", "read", "total")
            }
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
    process_settings()  # before this process's engines (or the services it starts) run
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--count-syncs", action="store_true",
                        help="also count each stage's host synchronisations per frame (mx.eval calls, host reads)")
    parser.add_argument("--count-kernels", action="store_true",
                        help="count the operations each stage's evaluations run per frame (views left out)")
    parser.add_argument("--split-eval", action="store_true",
                        help="split each stage's time into inside evaluations and host reads (MLX dispatch and "
                             "device waits) and outside them (Python building the graph)")
    parser.add_argument("--float32-weights", action="store_true",
                        help="load perception, language and speech as their services' --float32-weights does")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.count_syncs + args.count_kernels + args.split_eval > 1:
        parser.error("--count-syncs, --count-kernels and --split-eval: choose one (each wraps mx.eval)")
    report = run(args.model, args.frames, args.warmup, args.count_syncs, args.count_kernels, args.split_eval,
                 args.float32_weights)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['model']} on {report['device']}: {args.frames} frames after {args.warmup} warm-up, "
          f"load {report['load_s']} s")
    for name, row in {**report["stages"], "frame": report["frame"]}.items():
        line = f"  {name:<11} p50 {row['p50_ms']:8.2f} ms   p95 {row['p95_ms']:8.2f} ms   mean {row['mean_ms']:8.2f} ms"
        if "syncs" in row:
            s = row["syncs"]
            line += (f"   syncs/frame {s['total']['mean']:5.2f} (max {s['total']['max']}): "
                     f"eval {s['eval']['mean']:.2f}, read {s['read']['mean']:.2f}")
        if "inside_eval" in row:
            line += (f"   inside eval p50 {row['inside_eval']['p50_ms']:7.2f} ms, outside "
                     f"{row['outside_eval']['p50_ms']:7.2f} ms")
        if "kernels" in row:
            k = row["kernels"]
            line += f"   kernels/frame {k['mean']:7.1f} (max {k['max']}): {', '.join(k['top'])}"
        print(line)
    print(f"  real-time factor of a sequential frame loop: {report['realtime_factor']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
