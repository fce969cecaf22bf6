"""Where a failover's restore spends its time: each phase of moving a held session state into a new replica's arrays.

    python -m bench.restore [--layers 28] [--positions 500] [--deltas 4] [--every 125] [--repeat 2] [--json]

A speech-like state (`--layers` layers of (2, 16, T, 72) float32 keys and values, the full model's speech backbone)
is held as the orchestrator holds it (`snapshot.Held`): a whole snapshot at `--positions` positions, then `--deltas`
deltas of `--every` positions each, merged in. Then the restore's phases run one after the other in this process,
each timed: the orchestrator's `Held.parts()` (the merged state as whole-snapshot parts, each built inside a speech
stream request as a failover sends it) and their serialization (what gRPC sends), the service's parse of those
bytes, `Snapshot.from_parts` and each layer's cache restored as the engine restores it (`FullCache.restore`: the
keys and values read into MLX buffers of the cache's capacity, zeros past the held positions). On a host the two
sides run in two processes and gRPC streams the parts between them, so the real pause overlaps the sender's phases
with the receiver's; the sum here is what each side costs.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from protos.voicechat.v1 import snapshot_pb2, speech_pb2
from services.common.cache import GROW, FullCache
from services.common.snapshot import Held, Slices, Snapshot, capture, pack

HEADS, HEAD_DIM, ROWS = 16, 72, 2  # the full model's speech backbone: 16 KV heads of 72, guided and unguided rows


def held_state(layers: int, positions: int, deltas: int, every: int) -> tuple[Held, int]:
    """A Held state merged from a whole snapshot and `deltas` deltas -> (it, the positions it holds)."""
    def state(length: int, since: int | None) -> dict:
        values = {}
        for layer in range(layers):
            counters = {"offset": length, "capacity": capacity(length), "keep": -1, "window": -1}
            values.update({f"caches.{layer}.{name}": value for name, value in counters.items()})
            for name in ("keys", "values"):
                if since is None:
                    values[f"caches.{layer}.{name}"] = mx.random.normal((ROWS, HEADS, length, HEAD_DIM))
                else:
                    new = mx.random.normal((ROWS, HEADS, length - since, HEAD_DIM))
                    values[f"caches.{layer}.{name}"] = Slices(2, length, [(since, new)])
        return values

    held = Held()
    if not held.apply(pack(capture(state(positions, None)), snapshot_id=1)):
        raise RuntimeError("the whole snapshot was not taken")
    length = positions
    for delta in range(deltas):
        if not held.apply(pack(capture(state(length + every, length)), snapshot_id=delta + 2, base=held.id)):
            raise RuntimeError("a delta was not taken")
        length += every
    return held, length


def capacity(length: int) -> int:
    """The buffer size of a cache holding `length` positions: whole blocks of GROW, with room for the next."""
    return -(-(length + 1) // GROW) * GROW


def restore_phases(held: Held, layers: int) -> dict[str, float]:
    """Each phase's seconds, in order."""
    phases = {}
    start = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal start
        now = time.perf_counter()
        phases[name] = now - start
        start = now

    def request() -> tuple[speech_pb2.SpeechStreamRequest, snapshot_pb2.SnapshotPart]:
        message = speech_pb2.SpeechStreamRequest()
        return message, message.restore

    requests = list(held.parts(into=request))  # as the orchestrator sends them: each part inside a stream request
    lap("parts")
    wire = [message.SerializeToString() for message in requests]
    lap("serialize")
    received = [speech_pb2.SpeechStreamRequest.FromString(data).restore for data in wire]
    lap("parse")
    snapshot = Snapshot.from_parts(received)
    lap("from_parts")
    caches = [FullCache() for _ in range(layers)]
    for layer, cache in enumerate(caches):
        cache.restore(snapshot.scope(f"caches.{layer}"))
    mx.eval([array for cache in caches for array in (cache.keys, cache.values)])
    lap("arrays")
    return phases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--positions", type=int, default=500, help="positions of the whole snapshot")
    parser.add_argument("--deltas", type=int, default=4, help="deltas merged into it")
    parser.add_argument("--every", type=int, default=125, help="positions each delta adds (125: a 10 s interval)")
    parser.add_argument("--repeat", type=int, default=2, help="restores timed, the state built once")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if min(args.layers, args.positions, args.every, args.repeat) < 1 or args.deltas < 0:
        parser.error("--layers, --positions, --every and --repeat must be at least 1, --deltas at least 0")
    held, length = held_state(args.layers, args.positions, args.deltas, args.every)
    runs = [restore_phases(held, args.layers) for _ in range(args.repeat)]
    report = {"held_mb": held.nbytes / 1e6, "positions": length, "runs": runs}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"held {report['held_mb']:.0f} MB ({args.layers} layers, {length} positions)")
    for run in runs:
        total = sum(run.values())
        print("  " + "  ".join(f"{name} {seconds:.2f}" for name, seconds in run.items())
              + f"  | total {total:.2f} s, {report['held_mb'] / total:.0f} MB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
