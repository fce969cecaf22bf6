"""A session's state as named values, and those values as `SnapshotPart` messages (protos/voicechat/v1/snapshot.proto).

An engine's session gives its state as a flat dict (`State`): names like "caches.3.keys" to MLX arrays (any dtype,
bfloat16 included), ints, texts or lists of ints. Taking a snapshot runs in three steps, only the first on the
engine thread (it must not hold the other sessions' steps up for a copy of every array):

    held = capture(session.snapshot())          # engine thread: each array pinned as it is now, evaluated
    parts = pack(held)                          # any thread: the bytes, split into parts of PART_BYTES at most
    state = Snapshot.from_parts(parts)          # any thread: the values again, the arrays as Tensors
    session = engine.restore(state)             # engine thread: `state.array(name)` is the MLX array, bit for bit

Every array crosses in its own dtype (tensors.py): a restored session holds exactly what the snapshot's did.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from protos.voicechat.v1 import snapshot_pb2, tensor_pb2
from services.common.tensors import from_proto, from_proto_np, to_proto_np

if TYPE_CHECKING:
    import mlx.core as mx

State = dict[str, Any]  # name -> mx.array | int | str | list[int]
PART_BYTES = 8 << 20  # array bytes per part: far below the 64 MiB gRPC message limit


def capture(state: State) -> State:
    """On the engine thread: each array as a new array of its current value (bfloat16 as its uint16 bits),
    evaluated, so that `pack` may read it from another thread while the session steps on."""
    import mlx.core as mx

    held: State = {}
    for name, value in state.items():
        if isinstance(value, mx.array):
            bits = value.view(mx.uint16) if value.dtype == mx.bfloat16 else value
            held[name] = (mx.contiguous(bits), value.dtype == mx.bfloat16)
        elif isinstance(value, (list, tuple)):
            held[name] = np.asarray(value, dtype=np.int64).reshape(-1)
        elif isinstance(value, (bool, int, np.integer)):
            held[name] = np.asarray(int(value), dtype=np.int64)
        elif isinstance(value, str):
            held[name] = value
        else:
            raise TypeError(f"snapshot value {name!r} is a {type(value).__name__}; expected an array, int or text")
    mx.eval([value[0] for value in held.values() if isinstance(value, tuple)])
    return held


def pack(held: State, part_bytes: int = PART_BYTES) -> list[snapshot_pb2.SnapshotPart]:
    """`capture`'s values as parts of at most `part_bytes` array bytes each (a larger array spans several), the
    last marked `last`."""
    parts = [snapshot_pb2.SnapshotPart()]
    room = part_bytes

    def add(entry: snapshot_pb2.SnapshotEntry, size: int) -> None:
        nonlocal room
        if size > room and len(parts[-1].entries):
            parts.append(snapshot_pb2.SnapshotPart())
            room = part_bytes
        parts[-1].entries.append(entry)
        room -= size

    for name, value in held.items():
        if isinstance(value, str):
            add(snapshot_pb2.SnapshotEntry(name=name, text=value), len(value))
            continue
        tensor = _tensor(value)
        data = tensor.data
        for offset in range(0, max(len(data), 1), part_bytes):
            piece = tensor_pb2.Tensor(shape=tensor.shape, dtype=tensor.dtype, data=data[offset : offset + part_bytes])
            add(snapshot_pb2.SnapshotEntry(name=name, tensor=piece, offset=offset), len(piece.data))
    parts[-1].last = True
    return parts


def _tensor(value) -> tensor_pb2.Tensor:
    if isinstance(value, tuple):  # an MLX array from `capture`, maybe bfloat16 bits
        array, bfloat16 = value
        return to_proto_np(np.array(array), dtype=tensor_pb2.DTYPE_BFLOAT16 if bfloat16 else None)
    return to_proto_np(value)


class Snapshot:
    """A snapshot's values by name: `array` (an MLX array, on the engine thread), `int`, `ints`, `text`; a
    missing or malformed value is a ValueError naming it. `scope("caches.3")` reads the names under a prefix."""

    def __init__(self, values: dict[str, tensor_pb2.Tensor | str], prefix: str = ""):
        self._values, self._prefix = values, prefix

    @classmethod
    def from_parts(cls, parts: list[snapshot_pb2.SnapshotPart]) -> Snapshot:
        """Join the parts' entries (an array's pieces in order); ValueError when they do not make one snapshot."""
        if not parts or not parts[-1].last or any(part.last for part in parts[:-1]):
            raise ValueError("a snapshot must be sent whole: its parts in order, only the last marked `last`")
        values: dict[str, tensor_pb2.Tensor | str] = {}
        pieces: dict[str, list[bytes]] = {}
        for part in parts:
            for entry in part.entries:
                if entry.WhichOneof("value") == "text":
                    values[entry.name] = entry.text
                    continue
                known = values.get(entry.name)
                if known is None:
                    values[entry.name] = tensor_pb2.Tensor(shape=entry.tensor.shape, dtype=entry.tensor.dtype)
                    pieces[entry.name] = []
                elif isinstance(known, str) or sum(map(len, pieces[entry.name])) != entry.offset:
                    raise ValueError(f"snapshot entry {entry.name!r}: its pieces are out of order")
                pieces[entry.name].append(entry.tensor.data)
        for name, chunks in pieces.items():
            values[name].data = b"".join(chunks)
        return cls(values)

    def scope(self, prefix: str) -> Snapshot:
        return Snapshot(self._values, f"{self._prefix}{prefix}.")

    def has(self, name: str) -> bool:
        return self._prefix + name in self._values

    def _get(self, name: str, kind: type):
        value = self._values.get(self._prefix + name)
        if not isinstance(value, kind):
            what = "missing" if value is None else f"not {'a text' if kind is str else 'an array'}"
            raise ValueError(f"the snapshot's {self._prefix + name!r} is {what}: it was not taken by this service")
        return value

    def array(self, name: str) -> mx.array:
        """The MLX array, in its own dtype and bits (call on the engine thread)."""
        return from_proto(self._get(name, tensor_pb2.Tensor))

    def numpy(self, name: str) -> np.ndarray:
        return from_proto_np(self._get(name, tensor_pb2.Tensor))

    def int(self, name: str) -> int:
        value = self.numpy(name)
        if value.shape != ():
            raise ValueError(f"the snapshot's {self._prefix + name!r} is not a number")
        return int(value)

    def ints(self, name: str) -> list[int]:
        return [int(v) for v in self.numpy(name).reshape(-1)]

    def text(self, name: str) -> str:
        return self._get(name, str)

    def optional(self, name: str, read: Callable[[str], Any]) -> Any:
        """`read(name)` when the snapshot has the value, else None."""
        return read(name) if self.has(name) else None


def prefixed(prefix: str, state: State) -> State:
    """`state`'s names under `prefix` ("caches.3" + "keys" -> "caches.3.keys")."""
    return {f"{prefix}.{name}": value for name, value in state.items()}


def numbered(prefix: str, arrays: list) -> State:
    """`arrays` named `prefix.i`."""
    return {f"{prefix}.{i}": a for i, a in enumerate(arrays)}


def items(values: list, prefix: str, state: Callable[[Any], State]) -> Iterator[tuple[str, Any]]:
    """The state of each of `values` (None skipped), named `prefix.i.name`."""
    for i, value in enumerate(values):
        if value is not None:
            yield from prefixed(f"{prefix}.{i}", state(value)).items()


async def read_restore(requests: AsyncIterator, field: str = "restore") -> list[snapshot_pb2.SnapshotPart]:
    """The `restore` messages that follow an open with `restore` set, up to the one marked `last`."""
    parts = []
    while not parts or not parts[-1].last:
        request = await anext(requests, None)
        if request is None or request.WhichOneof("payload") != field:
            got = "the stream's end" if request is None else (request.WhichOneof("payload") or "an empty message")
            raise ValueError(f"an open with `restore` must be followed by the snapshot's `restore` parts, up to the "
                             f"one marked `last`; got {got}")
        parts.append(getattr(request, field))
    return parts


# ---- the services' Stream handlers ------------------------------------------------------------------------


async def restoring(restore: bool, requests: AsyncIterator) -> Snapshot | None:
    """The snapshot an open with `restore` set brings (its parts read from `requests`, joined off the event loop),
    or None for a plain open."""
    if not restore:
        return None
    return await asyncio.to_thread(Snapshot.from_parts, await read_restore(requests))


async def snapshot_answers(batcher, session, respond: Callable[[snapshot_pb2.SnapshotPart], Any]) -> list:
    """A snapshot request's answers: `respond(part)` for each part of the session's state, captured on the engine
    thread in order with the session's queued steps (`batching.SNAPSHOT`), packed off it."""
    from services.common.batching import SNAPSHOT

    held = await batcher.submit((session, SNAPSHOT))
    return [respond(part) for part in await asyncio.to_thread(pack, held)]


def take_snapshot(session) -> State:
    """What the engine thread does for a snapshot entry (`batching.answer_snapshots`)."""
    return capture(session.snapshot())


async def flattened(answers: AsyncIterator) -> AsyncIterator:
    """A handler's answers, a snapshot's list of parts as one answer each."""
    async for answer in answers:
        if isinstance(answer, list):
            for part in answer:
                yield part
        else:
            yield answer
