"""A session's state as named values, and those values as `SnapshotPart` messages (protos/voicechat/v1/snapshot.proto).

An engine's session gives its state as a flat dict (`State`): names like "caches.3.keys" to MLX arrays (any dtype,
bfloat16 included), ints, texts or lists of ints. Taking a snapshot runs in three steps, only the first on the
engine thread (it must not hold the other sessions' steps up for a copy of every array):

    held = capture(session.snapshot())          # engine thread: each array pinned as it is now, evaluated
    parts = pack(held)                          # any thread: the bytes, split into parts of PART_BYTES at most
    state = Snapshot.from_parts(parts)          # any thread: the values again, the arrays as Tensors
    session = engine.restore(state)             # engine thread: `state.array(name)` is the MLX array, bit for bit

Every array crosses in its own dtype (tensors.py): a restored session holds exactly what the snapshot's did.

Deltas: a stream's `Marks` remember where its session's growing arrays (attention caches) stood at the last
snapshot it gave, so a snapshot asked against that one (`SnapshotRequest.base`) carries for each such array only
the positions written since (`Slices`), every other value whole. The client keeps a `Held` state, the last whole
snapshot with each delta since applied, and sends it whole to restore:

    held = capture(session.snapshot(marks))     # engine thread, after marks.begin(base); then marks.end()
    held_state.apply(parts)                     # the client: a whole snapshot replaces, a delta changes in place
    parts = held_state.parts()                  # the merged state, whole, as a restore sends it
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from protos.voicechat.v1 import snapshot_pb2, tensor_pb2
from services.common.tensors import mlx_from_wire, numpy_from_wire, wire_array, wire_read

if TYPE_CHECKING:
    import mlx.core as mx

State = dict[str, Any]  # name -> mx.array | Slices | int | str | list[int]
PART_BYTES = 8 << 20  # array bytes per part: far below the 64 MiB gRPC message limit


@dataclass
class Slices:
    """An array of a delta: along `axis` its size is now `length`, and `runs` (start, array) are the positions
    that changed since the base snapshot (at least one run, maybe empty, so the name is in the delta)."""

    axis: int
    length: int
    runs: list[tuple[int, Any]]


class Marks:
    """Where a stream's session stood at the last snapshot the stream gave (`id`): a mark for each growing array
    (its owner's choice, e.g. an attention cache's offset), so that the next snapshot, asked against that one,
    sends what changed since.

        marks.begin(request.base)         # a delta when the base is the last snapshot given, else whole
        since = marks.swap(cache, mark)   # in the array's snapshot: its mark at the base (None: send it whole)
        snapshot_id = marks.end()
    """

    def __init__(self) -> None:
        self.id = 0  # the last snapshot's (0: none, or one failed midway)
        self._marks: dict[int, tuple[Any, Any]] = {}  # id(owner) -> (owner, its mark at the last snapshot)
        self._delta = False

    def begin(self, base: int) -> int:
        """Start a snapshot asked against `base`: returns `base` when it is a delta against it, else 0."""
        self._delta, self.id = bool(base) and base == self.id, 0  # a snapshot that fails midway is no base
        return base if self._delta else 0

    def swap(self, owner: Any, mark: Any) -> Any:
        """`owner`'s mark at the base when this snapshot is a delta (None: none, send it whole); `mark` is kept."""
        old = self._marks.get(id(owner))
        self._marks[id(owner)] = (owner, mark)
        return old[1] if self._delta and old is not None and old[0] is owner else None

    def end(self) -> int:
        """The snapshot's id, now the base a next request may name (random: no other stream's can match)."""
        self.id = secrets.randbits(63) + 1
        return self.id


def _pin(value) -> tuple:
    """An MLX array as a new array of its current value (bfloat16 as its uint16 bits) and whether it was bf16."""
    import mlx.core as mx

    bits = value.view(mx.uint16) if value.dtype == mx.bfloat16 else value
    return mx.contiguous(bits), value.dtype == mx.bfloat16


def capture(state: State) -> State:
    """On the engine thread: each array (and each run of a `Slices`) as a new array of its current value
    (bfloat16 as its uint16 bits), evaluated, so that `pack` may read it from another thread while the session
    steps on."""
    import mlx.core as mx

    held: State = {}
    for name, value in state.items():
        if isinstance(value, mx.array):
            held[name] = _pin(value)
        elif isinstance(value, Slices):
            held[name] = Slices(value.axis, value.length, [(start, _pin(a)) for start, a in value.runs])
        elif isinstance(value, (list, tuple)):
            held[name] = np.asarray(value, dtype=np.int64).reshape(-1)
        elif isinstance(value, (bool, int, np.integer)):
            held[name] = np.asarray(int(value), dtype=np.int64)
        elif isinstance(value, str):
            held[name] = value
        else:
            raise TypeError(f"snapshot value {name!r} is a {type(value).__name__}; expected an array, int or text")
    mx.eval([a for value in held.values() for a, _ in _pinned(value)])
    return held


def _pinned(value) -> list[tuple]:
    """The pinned arrays of a captured value."""
    if isinstance(value, Slices):
        return [pin for _, pin in value.runs]
    return [value] if isinstance(value, tuple) else []


def is_delta(held: State) -> bool:
    """Whether a captured state sends any array as slices."""
    return any(isinstance(value, Slices) for value in held.values())


def pack(held: State, part_bytes: int = PART_BYTES, snapshot_id: int = 0,
         base: int = 0) -> list[snapshot_pb2.SnapshotPart]:
    """`capture`'s values (or `Held` ones) as parts of at most `part_bytes` array bytes each (a larger array spans
    several), each part marked with the snapshot's id and base, the last marked `last`."""
    return list(packed(held, part_bytes, snapshot_id, base))


def packed(held: State, part_bytes: int = PART_BYTES, snapshot_id: int = 0, base: int = 0,
           into: Callable[[], tuple[Any, snapshot_pb2.SnapshotPart]] | None = None) -> Iterator:
    """`pack`'s parts one at a time, each made when the one before is taken (a large state is never all parts at
    once, and a sender may send each while the next is made). With `into`, each part is built in place inside a
    message of the caller's, `into()` giving (that message, its `SnapshotPart` field), and the messages are
    yielded: wrapping a finished part in a message would copy its bytes once more."""
    def fresh() -> tuple[Any, snapshot_pb2.SnapshotPart]:
        if into is None:
            part = message = snapshot_pb2.SnapshotPart()
        else:
            message, part = into()
            part.SetInParent()  # set in the message even while it is empty
        part.id, part.base = snapshot_id, base
        return message, part

    message, part = fresh()
    room = part_bytes
    for entry in _entries(held, part_bytes):
        if entry.size > room and len(part.entries):
            yield message
            (message, part), room = fresh(), part_bytes
        entry.add_to(part.entries)
        room -= entry.size
    part.last = True
    yield message


class _Entry(NamedTuple):
    """An entry of the parts, made in the part that takes it: a text, or an array's bytes from `offset` on (`span`,
    a piece of the array in C order) with the whole array's shape and wire dtype, and a delta's slice."""

    name: str
    size: int  # its array bytes (a text's length)
    text: str | None = None
    span: np.ndarray | None = None
    shape: tuple[int, ...] = ()
    dtype: int = 0
    offset: int = 0
    where: snapshot_pb2.SnapshotSlice | None = None

    def add_to(self, entries) -> None:
        """Append it to a part's entries, its bytes copied out of the array once (then into the message)."""
        if self.text is not None:
            entries.add(name=self.name, text=self.text)
            return
        entry = entries.add(name=self.name, offset=self.offset, slice=self.where)
        entry.tensor.dtype = self.dtype
        entry.tensor.shape.extend(self.shape)
        entry.tensor.data = self.span.tobytes()


def _entries(held: State, part_bytes: int) -> Iterator[_Entry]:
    """Each value's entries: a text, an array in pieces of `part_bytes` at most, a `Slices`' runs each as its own
    array with its slice."""
    for name, value in held.items():
        if isinstance(value, str):
            yield _Entry(name, len(value), text=value)
        elif isinstance(value, Slices):
            for start, run in value.runs:
                where = snapshot_pb2.SnapshotSlice(axis=value.axis, start=start, length=value.length)
                yield from _pieces(name, run, part_bytes, where)
        else:
            yield from _pieces(name, value, part_bytes)


def _pieces(name: str, value, part_bytes: int, where: snapshot_pb2.SnapshotSlice | None = None) -> Iterator[_Entry]:
    """An array's entries, its bytes in C order from `offset` on in pieces of `part_bytes` at most (each a view of
    the array, copied only as its part takes it)."""
    array, dtype = _wire(value)
    offset = 0
    for span in _spans(_merged(array), part_bytes):
        yield _Entry(name, span.nbytes, span=span, shape=array.shape, dtype=dtype, offset=offset, where=where)
        offset += span.nbytes


def _merged(array: np.ndarray) -> np.ndarray:
    """A view of `array` with the same elements in the same C order, each run of axes that steps through memory as
    one axis merged into one (a contiguous array is 1-D; a cache's front, (B, H, T, Dh) of a longer buffer, is
    (B * H, T * Dh))."""
    if array.size == 0:
        return array
    shape: list[int] = []
    strides: list[int] = []
    for size, stride in zip(array.shape, array.strides, strict=True):
        if size == 1:
            continue
        if shape and strides[-1] == stride * size:
            shape[-1] *= size
            strides[-1] = stride
        else:
            shape.append(size)
            strides.append(stride)
    return np.lib.stride_tricks.as_strided(array, shape, strides, writeable=False)


def _spans(array: np.ndarray, limit: int) -> Iterator[np.ndarray]:
    """Views of `array` whose bytes, one after another, are its bytes in C order, each of `limit` bytes at most:
    runs of whole rows along its first axis, a row that alone is larger in pieces of its own, a contiguous array
    cut every `limit` bytes."""
    if array.nbytes <= limit:
        yield array
    elif array.flags.c_contiguous:
        flat = array.reshape(-1).view(np.uint8)
        for offset in range(0, flat.size, limit):
            yield flat[offset : offset + limit]
    else:
        rows = limit // (array.nbytes // len(array))
        if rows:
            for start in range(0, len(array), rows):
                yield array[start : start + rows]
        else:
            for row in array:
                yield from _spans(row, limit)


def _wire(value) -> tuple[np.ndarray, int]:
    """A value's array in its wire storage and its wire dtype: an MLX array from `capture` (or a Held numpy
    one) with whether it is bfloat16 bits, or a numpy array."""
    if isinstance(value, tuple):
        array, bfloat16 = value
        array = array if isinstance(array, np.ndarray) else np.array(array)  # MLX: copied out here, off its thread
        return wire_array(array, tensor_pb2.DTYPE_BFLOAT16 if bfloat16 else None)
    return wire_array(value)


class Raw(NamedTuple):
    """An array as its entries carried it: shape, wire dtype and its bytes in order, one piece an entry."""

    shape: list[int]
    dtype: int
    pieces: list[bytes]

    def numpy(self) -> np.ndarray:
        """Its values in the storage dtype (bfloat16 as its bits): a read-only view of a lone piece, else a new
        array; ValueError when their size does not fit."""
        return wire_read(self.shape, self.dtype, self.pieces)


class Value(NamedTuple):
    """One value of a snapshot's parts: a name, where it goes (a delta's slice, else None) and the array or text."""

    name: str
    slice: snapshot_pb2.SnapshotSlice | None
    value: Raw | str


def joined(parts: Iterable[snapshot_pb2.SnapshotPart]) -> tuple[list[Value], int, int]:
    """The values of one snapshot's parts in order (an array's pieces kept in order, not copied into one), its id
    and its base; ValueError when the parts do not make one snapshot."""
    parts = list(parts)
    if not parts or not parts[-1].last or any(part.last for part in parts[:-1]):
        raise ValueError("a snapshot must be sent whole: its parts in order, only the last marked `last`")
    if len({(part.id, part.base) for part in parts}) != 1:
        raise ValueError("a snapshot's parts must all carry its id and base")
    values: list[Value] = []
    size = 0  # the bytes of the last array's pieces so far
    for part in parts:
        for entry in part.entries:
            where = entry.slice if entry.HasField("slice") else None
            if entry.WhichOneof("value") == "text":
                values.append(Value(entry.name, None, entry.text))
            elif entry.offset == 0:
                tensor = entry.tensor
                data = tensor.data
                values.append(Value(entry.name, where, Raw(list(tensor.shape), tensor.dtype, [data])))
                size = len(data)
            elif (not values or values[-1][:2] != (entry.name, where) or isinstance(values[-1].value, str)
                  or size != entry.offset):
                raise ValueError(f"snapshot entry {entry.name!r}: its pieces are out of order")
            else:
                data = entry.tensor.data
                values[-1].value.pieces.append(data)
                size += len(data)
    return values, parts[0].id, parts[0].base


class Snapshot:
    """A snapshot's values by name: `array` (an MLX array, on the engine thread), `int`, `ints`, `text`; a
    missing or malformed value is a ValueError naming it. `scope("caches.3")` reads the names under a prefix."""

    def __init__(self, values: dict[str, Raw | str], prefix: str = ""):
        self._values, self._prefix = values, prefix

    @classmethod
    def from_parts(cls, parts: Iterable[snapshot_pb2.SnapshotPart]) -> Snapshot:
        """Join the parts' entries (an array's pieces in order); ValueError when they do not make one whole
        snapshot (a restore takes the client's merged state, never a delta)."""
        values, _, base = joined(parts)
        if base or any(value.slice is not None for value in values):
            raise ValueError("a restore takes a whole snapshot, not a delta: send the merged state (its `Held`)")
        by_name = {value.name: value.value for value in values}  # the pieces, read in place by `array`
        if len(by_name) != len(values):
            raise ValueError("a snapshot names each value once")
        return cls(by_name)

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

    def array(self, name: str, axis: int = 0, width: int | None = None) -> mx.array:
        """The MLX array, in its own dtype and bits (call on the engine thread); with `width`, `width` long along
        `axis`, zeros past its own values (read so: one copy on the host, one into MLX)."""
        return mlx_from_wire(*self._get(name, Raw), axis, width)

    def numpy(self, name: str) -> np.ndarray:
        return numpy_from_wire(*self._get(name, Raw))

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


class _Array:
    """A held array: `view`, the value, is the front of `buffer`, which may have room to grow along one axis (a
    growing cache's array takes each delta without a copy of the whole array each time). A whole snapshot's
    array is a read-only view of the bytes it came in (when one piece brought it, else an array of its own),
    copied only when a delta first changes it."""

    def __init__(self, array: np.ndarray, dtype: int):
        self.buffer = self.view = array
        self.dtype = dtype  # the wire dtype (bfloat16 held as its uint16 bits)

    @classmethod
    def of(cls, raw: Raw) -> _Array:
        return cls(raw.numpy(), raw.dtype)

    def _writable(self) -> None:
        if not self.view.flags.writeable:  # a whole snapshot's (then view is buffer)
            self.buffer = self.view = self.view.copy()

    def resize(self, axis: int, length: int) -> None:
        """Make the size along `axis` `length`: cut, or extended with zeros (into the buffer's room, or a buffer
        a quarter larger than needed)."""
        old = self.view.shape[axis]
        if length == old:
            return
        self._writable()
        shape = list(self.view.shape)
        shape[axis] = length
        room = list(self.buffer.shape)
        if length > room[axis] or room[:axis] + room[axis + 1 :] != shape[:axis] + shape[axis + 1 :]:
            room = shape[:axis] + [length + length // 4] + shape[axis + 1 :]
            buffer = np.zeros(room, self.view.dtype)
            kept = min(old, length)
            buffer[_along(axis, 0, kept)] = self.view[_along(axis, 0, kept)]
            self.buffer = buffer
        self.view = self.buffer[_along(axis, 0, length)]
        if length > old:
            self.view[_along(axis, old, length)] = 0

    def write(self, axis: int, start: int, array: np.ndarray) -> None:
        self._writable()
        self.view[_along(axis, start, start + array.shape[axis])] = array


def _along(axis: int, start: int, stop: int) -> tuple:
    """The index of positions start .. stop - 1 along `axis`."""
    return (slice(None),) * axis + (slice(start, stop),)


class Held:
    """A session's state as a client keeps it: the last whole snapshot with every delta since applied, by name
    (arrays as numpy, bfloat16 as its bits), sent whole again (`parts`) to restore the session.

        held = Held()
        held.apply(parts)       # True: taken (a whole snapshot, or a delta against `held.id`); False: left as it was
        parts = held.parts()    # the merged state as one whole snapshot, as the service's would be now

    A delta is checked whole before any of it applies: a ValueError (a slice that does not fit the held array)
    leaves the held state as it was."""

    def __init__(self) -> None:
        self.id = 0  # the snapshot the held state is (0: none)
        self._values: dict[str, _Array | str] = {}

    @property
    def nbytes(self) -> int:
        return sum(len(v) if isinstance(v, str) else v.view.nbytes for v in self._values.values())

    def apply(self, parts: Iterable[snapshot_pb2.SnapshotPart]) -> bool:
        """Take a snapshot's parts: a whole snapshot replaces the held state, a delta against it changes it; a
        delta against another snapshot is refused (False), and the next request should ask for a whole one."""
        values, snapshot_id, base = joined(parts)
        if base and base != self.id:
            return False
        by_name: dict[str, list[Value]] = {}
        for value in values:
            by_name.setdefault(value.name, []).append(value)
        changes = {name: self._checked(name, got, base) for name, got in by_name.items()}
        self._values = {name: self._changed(name, change) for name, change in changes.items()}
        self.id = snapshot_id
        return True

    def _checked(self, name: str, got: list[Value], base: int):
        """A name's new value (an `_Array` or text) or its slices (axis, length, [(start, array)]), checked against
        the held array; ValueError naming what does not fit."""
        if got[0].slice is None:
            if len(got) > 1:
                raise ValueError(f"snapshot value {name!r} comes more than once")
            return got[0].value if isinstance(got[0].value, str) else _Array.of(got[0].value)
        held = self._values.get(name)
        if not base or not isinstance(held, _Array):
            raise ValueError(f"snapshot value {name!r} is a slice of an array the base does not hold")
        axis, length = got[0].slice.axis, got[0].slice.length
        runs = []
        for value in got:
            where, raw = value.slice, value.value
            shape = list(raw.shape)
            if (where is None or (where.axis, where.length) != (axis, length) or raw.dtype != held.dtype
                    or not 0 <= axis < held.view.ndim or len(shape) != held.view.ndim
                    or shape[:axis] + shape[axis + 1 :] != list(held.view.shape[:axis] + held.view.shape[axis + 1 :])
                    or where.start < 0 or where.start + shape[axis] > length):
                raise ValueError(f"snapshot value {name!r}: a slice that does not fit the held array "
                                 f"{list(held.view.shape)} ({held.view.dtype})")
            runs.append((where.start, raw.numpy()))
        return axis, length, runs

    def _changed(self, name: str, change) -> _Array | str:
        if not isinstance(change, tuple):
            return change
        axis, length, runs = change
        held = self._values[name]
        held.resize(axis, length)
        for start, array in runs:
            held.write(axis, start, array)
        return held

    def parts(self, part_bytes: int = PART_BYTES,
              into: Callable[[], tuple[Any, snapshot_pb2.SnapshotPart]] | None = None) -> Iterator:
        """The held state as the parts of one whole snapshot, each made as the one before is taken (with `into`,
        each inside a message of the caller's: `packed`)."""
        return packed({name: v if isinstance(v, str) else (v.view, v.dtype == tensor_pb2.DTYPE_BFLOAT16)
                       for name, v in self._values.items()}, part_bytes, into=into)


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


class Taken(NamedTuple):
    """A snapshot as the engine thread took it: the captured state, its id and the base it is a delta against."""

    held: State
    id: int
    base: int


async def snapshot_answers(batcher, session, request: snapshot_pb2.SnapshotRequest, marks: Marks,
                           respond: Callable[[snapshot_pb2.SnapshotPart], Any]) -> list:
    """A snapshot request's answers: `respond(part)` for each part of the session's state (a delta against
    `request.base` when `marks`, the stream's, still know it), captured on the engine thread in order with the
    session's queued steps (`batching.SnapshotAsk`), packed off it."""
    from services.common.batching import SnapshotAsk

    taken = await batcher.submit((session, SnapshotAsk(request.base, marks)))
    return [respond(part) for part in await asyncio.to_thread(pack, taken.held, PART_BYTES, taken.id, taken.base)]


def take_snapshot(session, ask) -> Taken:
    """What the engine thread does for a snapshot entry (`batching.answer_snapshots`): the session's state, only
    what changed since `ask.base` when its marks know that snapshot."""
    marks = ask.marks if ask.marks is not None else Marks()
    base = marks.begin(ask.base)
    held = capture(session.snapshot(marks))
    return Taken(held, marks.end(), base if is_delta(held) else 0)


async def flattened(answers: AsyncIterator) -> AsyncIterator:
    """A handler's answers, a snapshot's list of parts as one answer each."""
    async for answer in answers:
        if isinstance(answer, list):
            for part in answer:
                yield part
        else:
            yield answer
