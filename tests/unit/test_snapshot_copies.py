"""A restore's bytes, copied as few times as can be: the parts of a held array that is a view with room to grow are
its bytes in C order, no part holds more than `part_bytes` of them, an array read wider is its values then zeros,
and malformed pieces are refused as before."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from protos.voicechat.v1 import snapshot_pb2, speech_pb2
from services.common.cache import FullCache
from services.common.snapshot import Held, Slices, Snapshot, pack

BF16 = np.array([0x3F80, 0xC040, 0x8000, 0x7FC1, 0x0001], np.uint16)  # 1.0, -3.0, -0.0, a NaN's payload, subnormal


def float32s(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random float32 values with a NaN payload and a -0.0 among them."""
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    flat = values.reshape(-1).view(np.uint32)
    flat[0], flat[-1] = 0x7FC0_1234, 0x8000_0000
    return values


def bf16s(shape: tuple[int, ...], seed: int) -> np.ndarray:
    bits = np.random.default_rng(seed).integers(0, 2**16, shape, dtype=np.uint16)
    bits.reshape(-1)[: BF16.size] = BF16[: bits.size]
    return bits


def streams(parts: list[snapshot_pb2.SnapshotPart], part_bytes: int) -> dict[str, bytes]:
    """Each array's bytes from its entries, checked: each entry's offset is the bytes before it, no part holds more
    than `part_bytes` array bytes."""
    got: dict[str, bytes] = {}
    for part in parts:
        assert sum(len(entry.tensor.data) for entry in part.entries) <= part_bytes or len(part.entries) == 1
        for entry in part.entries:
            if entry.WhichOneof("value") == "tensor":
                assert len(entry.tensor.data) <= part_bytes
                assert entry.offset == len(got.get(entry.name, b""))
                got[entry.name] = got.get(entry.name, b"") + entry.tensor.data
    return got


def grown_held() -> tuple[Held, dict[str, np.ndarray]]:
    """A Held whose arrays grew by a delta (views of buffers with room, along axis 2 and axis 0), and the values
    it holds (bfloat16 as bits)."""
    keys, bits, rows = float32s((2, 3, 5, 4), 0), bf16s((2, 3, 5, 4), 1), float32s((3, 2, 2), 2)
    more_keys, more_bits, more_rows = float32s((2, 3, 4, 4), 3), bf16s((2, 3, 4, 4), 4), float32s((2, 2, 2), 5)
    held = Held()
    assert held.apply(pack({"keys": keys, "bits": (bits, True), "rows": rows, "n": np.asarray(1)}, snapshot_id=1))
    assert held.apply(pack({"keys": Slices(2, 9, [(5, more_keys)]), "bits": Slices(2, 9, [(5, (more_bits, True))]),
                            "rows": Slices(0, 5, [(3, more_rows)]), "n": np.asarray(2)}, snapshot_id=2, base=1))
    return held, {"keys": np.concatenate([keys, more_keys], axis=2), "bits": np.concatenate([bits, more_bits], axis=2),
                  "rows": np.concatenate([rows, more_rows], axis=0)}


@pytest.mark.parametrize("part_bytes", [1, 3, 16, 52, 96, 100, 144, 1000, 1 << 20])
def test_the_parts_of_a_held_view_with_room_are_its_bytes_in_c_order(part_bytes):
    held, want = grown_held()
    assert not held._values["keys"].view.flags.c_contiguous  # the delta left room: a view of a longer buffer
    parts = list(held.parts(part_bytes))
    got = streams(parts, part_bytes)
    assert got == {**{name: values.tobytes() for name, values in want.items()}, "n": np.int64(2).tobytes()}
    state = Snapshot.from_parts([type(p).FromString(p.SerializeToString()) for p in parts])
    assert state.numpy("keys").tobytes() == want["keys"].tobytes()
    assert np.array(state.array("bits").view(mx.uint16)).tobytes() == want["bits"].tobytes()
    assert state.array("bits").dtype == mx.bfloat16


@pytest.mark.parametrize("view", [
    lambda a: a[:, :, ::2],  # no axis contiguous
    lambda a: a[::-1, :, 1:],  # backwards along the first axis
    lambda a: a.transpose(2, 0, 1),  # Fortran-like
    lambda a: a[:1, :, :3],  # a size-1 axis
    lambda a: a[:, :0],  # empty
], ids=["strided", "backwards", "transposed", "size-1", "empty"])
@pytest.mark.parametrize("part_bytes", [1, 7, 24, 40, 1000])
def test_a_part_never_holds_more_than_part_bytes_even_when_a_row_alone_does(view, part_bytes):
    array = view(float32s((4, 5, 6), 6))  # a row (one index of the first axis) is up to 120 bytes: many split
    parts = pack({"a": array, "t": "text"}, part_bytes)
    assert streams(parts, part_bytes)["a"] == np.ascontiguousarray(array).tobytes()
    assert Snapshot.from_parts(parts).numpy("a").tobytes() == np.ascontiguousarray(array).tobytes()


def test_a_contiguous_array_is_cut_every_part_bytes():
    array = np.arange(1000, dtype=np.int32)
    parts = pack({"a": array}, 1000)
    assert [(e.offset, len(e.tensor.data)) for p in parts for e in p.entries] == [(0, 1000), (1000, 1000),
                                                                                 (2000, 1000), (3000, 1000)]


@pytest.mark.parametrize("axis, width", [(2, 12), (2, 9), (0, 7), (3, 5), (1, 3)])
@pytest.mark.parametrize("part_bytes", [52, 1 << 20])
def test_an_array_read_wider_is_its_values_then_zeros(axis, width, part_bytes):
    held, want = grown_held()
    state = Snapshot.from_parts(held.parts(part_bytes))
    for name, bfloat16 in (("keys", False), ("bits", True)):
        array = state.array(name, axis=axis, width=width)
        assert array.dtype == (mx.bfloat16 if bfloat16 else mx.float32)
        bits = np.array(array.view(mx.uint16) if bfloat16 else array.view(mx.uint32))
        values = want[name].view(np.uint16 if bfloat16 else np.uint32)
        assert bits.shape == values.shape[:axis] + (width,) + values.shape[axis + 1 :]
        front = (slice(None),) * axis
        assert bits[(*front, slice(0, values.shape[axis]))].tobytes() == values.tobytes()
        assert not bits[(*front, slice(values.shape[axis], None))].any()  # zeros: +0.0 bits
    with pytest.raises(ValueError, match=r"tensor shape \[2, 3, 9, 4\] is wider than 8 along axis 2"):
        state.array("keys", axis=2, width=8)
    with pytest.raises(ValueError, match=r"tensor shape \[2, 3, 9, 4\] has no axis 4 to widen"):
        state.array("keys", axis=4, width=12)


@pytest.mark.parametrize("dtype", [np.float32, "bits"])
def test_a_cache_restores_its_keys_in_a_buffer_of_its_capacity(dtype):
    held_keys = float32s((1, 2, 9, 3), 7) if dtype is np.float32 else bf16s((1, 2, 9, 3), 7)
    wire = (held_keys, True) if dtype == "bits" else held_keys
    state = {"keys": wire, "values": wire, "offset": np.asarray(9), "capacity": np.asarray(256),
             "keep": np.asarray(-1), "window": np.asarray(-1)}
    cache = FullCache()
    cache.restore(Snapshot.from_parts(pack(state, 100)))
    keys = cache.keys.view(mx.uint16) if dtype == "bits" else cache.keys.view(mx.uint32)
    bits = np.array(keys)
    assert (cache.capacity, cache.offset, bits.shape) == (256, 9, (1, 2, 256, 3))
    assert bits[:, :, :9].tobytes() == held_keys.tobytes() and not bits[:, :, 9:].any()


def malformed(change) -> list[snapshot_pb2.SnapshotPart]:
    """A whole snapshot of an array in 8 pieces and a text, then changed by `change(entries)`."""
    part = snapshot_pb2.SnapshotPart(id=1, last=True)
    for sub in pack({"a": np.arange(16, dtype=np.float32), "t": "text"}, 8):
        part.entries.extend(sub.entries)
    change(part.entries)
    return [part]


@pytest.mark.parametrize("change", [
    lambda entries: setattr(entries[3], "offset", entries[3].offset + 4),  # a piece's offset past the bytes before
    lambda entries: entries.__delitem__(2),  # a piece missing
    lambda entries: entries.insert(2, entries[5]),  # a piece twice
    lambda entries: entries[1].CopyFrom(entries[8]) or setattr(entries[1], "name", "a"),  # a text, then a piece
    lambda entries: setattr(entries[4], "name", "b"),  # another name's piece inside
], ids=["offset", "missing", "twice", "after-a-text", "another-name"])
def test_pieces_out_of_order_are_refused_as_before(change):
    with pytest.raises(ValueError, match=r"^snapshot entry '[ab]': its pieces are out of order$"):
        Snapshot.from_parts(malformed(change))


def test_pieces_of_the_wrong_size_are_refused_as_before():
    def short(entries):
        entries[7].tensor.data = entries[7].tensor.data[:4]
    state = Snapshot.from_parts(malformed(short))
    for read in (state.array, state.numpy, lambda name: state.array(name, axis=0, width=20)):
        with pytest.raises(ValueError, match=r"tensor payload is 60 bytes but shape \[16\] of DTYPE_FLOAT32 needs 64"):
            read("a")
    with pytest.raises(ValueError, match="'missing' is missing"):
        state.array("missing", axis=0, width=3)


@pytest.mark.parametrize("part_bytes", [16, 1 << 20])
def test_parts_built_inside_the_callers_messages_are_the_plain_parts(part_bytes):
    held, _ = grown_held()

    def request():
        message = speech_pb2.SpeechStreamRequest()
        return message, message.restore

    plain = list(held.parts(part_bytes))
    wrapped = list(held.parts(part_bytes, into=request))
    assert len(wrapped) == len(plain) and (len(plain) > 1) == (part_bytes == 16)
    for message, part in zip(wrapped, plain, strict=True):
        assert message.WhichOneof("payload") == "restore"
        assert message.restore.SerializeToString() == part.SerializeToString()
    assert wrapped[-1].restore.last and not any(m.restore.last for m in wrapped[:-1])
