"""A load run's client timeline beside its services' engine steps: where the frame intervals come from.

    python -m bench.timeline TIMELINE.json [--steps NAME=PATH ...] [--settle-seconds S] [--json]

TIMELINE.json is `bench.load --timeline`'s; each PATH a service's `--step-log` (all share the host's monotonic
clock). For the run's window (its start to its end), prints the clients' frame intervals (p50/p95, how many
over 80 ms) and, per service, its steps in the window: how many, their mean size, how long each ran on the
engine (p50/p95/max), how long a formed batch waited for the engine thread, the gaps between one step's end and
the next one's start, and the share of the window the engine was busy. A service busy nearly all the window
bounds the run; step times that spread widely at one batch size point at the device being shared. Then, per
service, its partial steps (fewer sessions than it holds): how many, and the median step of a full batch, of a
partial one and of a full batch right after a partial one. A partial step or the full one after it much slower
than a full batch means a change of the batch's sessions costs the engine (caches re-stacked). A service holds
every conversation, except replicas: names NAME-0, NAME-1, ... (as `bench/gpu_suite.sh` gives them) are the
replicas of NAME, and round robin gives each its share of the conversations (`replica_shares`).

`--opening S` prints the run's first S seconds from its first chunk sent instead, step by step: when the
conversations sent their first chunk and got their first audio, and each service's every step (when it began,
its size, how long it queued and ran). Many conversations opening together wait on what these first steps do
that later ones do not.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

from bench.load import intervals_ms
from orchestrator.profile import percentile
from services.common.steplog import read_steps

FRAME_MS = 80.0


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "max": None}
    return {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95), "max": max(values)}


def service_row(steps: list[dict], start: float, end: float, full: int | None = None) -> dict:
    """The steps that began inside [start, end], summarised (times in ms); with `full` (the batch of every
    conversation) also its partial steps, and the full ones, apart."""
    mine = [s for s in steps if start <= s["start"] <= end]
    window_ms = (end - start) * 1000.0
    durations = [(s["end"] - s["start"]) * 1000.0 for s in mine]
    row = {
        "steps": len(mine),
        "mean_size": sum(s["size"] for s in mine) / len(mine) if mine else None,
        "step_ms": _spread(durations),
        "queued_ms": _spread([(s["start"] - s["formed"]) * 1000.0 for s in mine]),
        "gap_ms": _spread([(b["start"] - a["end"]) * 1000.0 for a, b in zip(mine, mine[1:], strict=False)]),
        "busy": sum(durations) / window_ms if window_ms > 0 else None,
    }
    if full is not None:
        partial = [s["size"] < full for s in mine]
        row["partial"] = sum(partial)
        row["full_step_ms"] = _spread([d for d, p in zip(durations, partial, strict=True) if not p])
        row["partial_step_ms"] = _spread([d for d, p in zip(durations, partial, strict=True) if p])
        row["after_partial_ms"] = _spread([durations[i] for i in range(1, len(mine))
                                           if partial[i - 1] and not partial[i]])
    return row


_REPLICA = re.compile(r"^(.+)-(\d+)$")


def replica_shares(steps: dict[str, list[dict]], conversations: int) -> dict[str, int]:
    """The sessions each service holds: every conversation, or for replicas (two or more names NAME-R of one
    NAME) its round-robin share, conversations // replicas or one more. Which replicas took the extra ones is not
    known beforehand: a replica whose largest step held the larger share holds it."""
    bases = collections.Counter(m.group(1) for name in steps if (m := _REPLICA.match(name)))
    shares = {}
    for name, rows in steps.items():
        m = _REPLICA.match(name)
        count = bases[m.group(1)] if m else 1
        if count < 2:
            shares[name] = conversations
            continue
        low, high = conversations // count, -(-conversations // count)
        shares[name] = high if max((s["size"] for s in rows), default=0) >= high else low
    return shares


def report(timeline: dict, steps: dict[str, list[dict]], settle_frames: int = 0) -> dict:
    start = timeline["start_monotonic"]
    end = start + timeline["wall_s"]
    intervals = intervals_ms([c["arrivals_s"] for c in timeline["conversations"]], settle_frames)
    shares = replica_shares(steps, len(timeline["conversations"]))
    return {
        "window_s": timeline["wall_s"],
        "clients": {"conversations": len(timeline["conversations"]), "intervals": len(intervals),
                    "interval_ms": _spread(intervals),
                    "over_frame": sum(1 for i in intervals if i > FRAME_MS)},
        "services": {name: {**service_row(rows, start, end, shares[name]), "holds": shares[name]}
                     for name, rows in steps.items()},
    }


def opening(timeline: dict, steps: dict[str, list[dict]], seconds: float) -> dict:
    """The run's first `seconds` from its first chunk sent (its conversations opened): each conversation's first
    chunk and first audio, the frames that arrived inside it, and every step each service began inside it (times
    in ms from the run's start)."""
    start = timeline["start_monotonic"]
    sent = [c["first_sent_s"] for c in timeline["conversations"] if c["first_sent_s"] is not None]
    first = [c["arrivals_s"][0] - c["first_sent_s"] for c in timeline["conversations"]
             if c["first_sent_s"] is not None and c["arrivals_s"]]
    begin = min(sent, default=0.0)  # the window's start, seconds from the run's
    arrived = sum(1 for c in timeline["conversations"] for t in c["arrivals_s"] if t <= begin + seconds)

    def ms(t: float) -> float:
        return round(t * 1000.0, 2)

    return {
        "seconds": seconds,
        "first_sent_ms": {"min": ms(min(sent)) if sent else None, "max": ms(max(sent)) if sent else None},
        "first_audio_ms": {k: None if v is None else round(v, 2) for k, v in _spread([ms(f) for f in first]).items()},
        "frames_arrived": arrived,
        "services": {name: [{"at_ms": ms(s["start"] - start), "size": s["size"],
                             "queued_ms": ms(s["start"] - s["formed"]), "step_ms": ms(s["end"] - s["start"])}
                            for s in rows if start + begin <= s["start"] <= start + begin + seconds]
                     for name, rows in steps.items()},
    }


def print_opening(r: dict) -> None:
    sent, first = r["first_sent_ms"], r["first_audio_ms"]
    print(f"{r['seconds']:g} s from the first chunk: first chunks sent {_ms(sent['min'])}-{_ms(sent['max'])} ms, "
          f"first audio p50 {_ms(first['p50'])} / p95 {_ms(first['p95'])} / max {_ms(first['max'])} ms after it, "
          f"{r['frames_arrived']} frames arrived")
    print("each step: began at ms, size, queued ms, ran ms")
    for name, rows in r["services"].items():
        print(f"{name}: " + ", ".join(f"{s['at_ms']:.0f} {s['size']}x q{s['queued_ms']:.1f} {s['step_ms']:.1f}"
                                      for s in rows))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_report(r: dict) -> None:
    c = r["clients"]
    i = c["interval_ms"]
    print(f"window {r['window_s']:.1f} s, {c['conversations']} conversations: {c['intervals']} frame intervals, "
          f"p50 {_ms(i['p50'])} / p95 {_ms(i['p95'])} ms, {c['over_frame']} over {FRAME_MS:.0f} ms")
    print("| service | steps | mean size | step p50 / p95 / max ms | queued p50 / p95 ms | gap p50 / p95 ms | busy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in r["services"].items():
        s, q, g = row["step_ms"], row["queued_ms"], row["gap_ms"]
        size = "-" if row["mean_size"] is None else f"{row['mean_size']:.1f}"
        busy = "-" if row["busy"] is None else f"{row['busy']:.0%}"
        print(f"| {name} | {row['steps']} | {size} | {_ms(s['p50'])} / {_ms(s['p95'])} / {_ms(s['max'])} | "
              f"{_ms(q['p50'])} / {_ms(q['p95'])} | {_ms(g['p50'])} / {_ms(g['p95'])} | {busy} |")
    print()
    print("| service | partial steps (under the sessions it holds) | step p50 ms: full / partial / full after a "
          "partial |")
    print("| --- | --- | --- |")
    for name, row in r["services"].items():
        print(f"| {name} | {row['partial']} (under {row['holds']}) | {_ms(row['full_step_ms']['p50'])} / "
              f"{_ms(row['partial_step_ms']['p50'])} / {_ms(row['after_partial_ms']['p50'])} |")


def _named(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH, e.g. tts=/tmp/tts-steps.jsonl")
    return name, Path(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("timeline", type=Path, help="bench.load --timeline output")
    parser.add_argument("--steps", type=_named, action="append", default=[], metavar="NAME=PATH",
                        help="a service's --step-log (repeat per service)")
    parser.add_argument("--settle-seconds", type=float, default=0.0,
                        help="leave each conversation's first S seconds of intervals out (as bench.load does)")
    parser.add_argument("--opening", type=float, metavar="S",
                        help="print the S seconds from the first chunk sent step by step instead (every step of every "
                             "service)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.opening is not None and not args.opening > 0:
        parser.error("--opening must be positive")
    try:
        timeline = json.loads(args.timeline.read_text())
        steps = {name: read_steps(path) for name, path in args.steps}
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if "start_monotonic" not in timeline:
        print(f"error: {args.timeline} has no start_monotonic: write it with this version's bench.load --timeline",
              file=sys.stderr)
        return 1
    if args.opening is not None:
        r, show = opening(timeline, steps, args.opening), print_opening
    else:
        r, show = report(timeline, steps, round(args.settle_seconds * 1000.0 / FRAME_MS)), print_report
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        show(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
