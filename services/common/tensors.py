"""Arrays <-> `voicechat.v1.Tensor`: shape, dtype and raw little-endian bytes, bit for bit.

The wire never changes a number: an array crosses in exactly the dtype its producer made, NaN payloads and
-0.0 included. bfloat16 travels as its 16-bit patterns (numpy has no bfloat16, so the numpy side uses uint16
views of the same bits).

    >>> t = to_proto_np(np.array([1.5, -0.0], np.float32))
    >>> (list(t.shape), t.dtype == tensor_pb2.DTYPE_FLOAT32, len(t.data))
    ([2], True, 8)

MLX is imported lazily so numpy-only callers (the orchestrator) need not load it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from protos.voicechat.v1 import tensor_pb2

if TYPE_CHECKING:
    import mlx.core as mx

Tensor = tensor_pb2.Tensor
MLX_MAX_DIM = 2**31 - 1  # MLX array dimensions are 32-bit signed integers

# Wire dtype -> numpy storage dtype (little-endian). bfloat16 is stored as its uint16 bit patterns.
_STORAGE: dict[int, np.dtype] = {
    tensor_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    tensor_pb2.DTYPE_BFLOAT16: np.dtype("<u2"),
    tensor_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    tensor_pb2.DTYPE_INT32: np.dtype("<i4"),
    tensor_pb2.DTYPE_BOOL: np.dtype("?"),
    tensor_pb2.DTYPE_INT64: np.dtype("<i8"),
    tensor_pb2.DTYPE_UINT32: np.dtype("<u4"),
}

# numpy dtype kind+size -> wire dtype, for arrays that are not bfloat16.
_FROM_NUMPY: dict[tuple[str, int], int] = {
    ("f", 4): tensor_pb2.DTYPE_FLOAT32,
    ("f", 2): tensor_pb2.DTYPE_FLOAT16,
    ("i", 4): tensor_pb2.DTYPE_INT32,
    ("b", 1): tensor_pb2.DTYPE_BOOL,
    ("i", 8): tensor_pb2.DTYPE_INT64,
    ("u", 4): tensor_pb2.DTYPE_UINT32,
}


def dtype_name(dtype: int) -> str:
    """`tensor_pb2.DTYPE_INT32` -> "DTYPE_INT32"; unknown numbers are shown as numbers."""
    try:
        return tensor_pb2.DType.Name(dtype)
    except ValueError:
        return f"DType({dtype})"


def itemsize(dtype: int) -> int:
    """Bytes per element of a wire dtype; ValueError for DTYPE_UNSPECIFIED or an unknown value."""
    return _storage(dtype).itemsize


def _storage(dtype: int) -> np.dtype:
    if dtype not in _STORAGE:
        raise ValueError(f"unsupported tensor dtype {dtype_name(dtype)}; expected one of {_supported()}")
    return _STORAGE[dtype]


def _supported() -> str:
    return ", ".join(dtype_name(d) for d in _STORAGE)


def _wire_dtype(array: np.ndarray) -> int:
    wire = _FROM_NUMPY.get((array.dtype.kind, array.dtype.itemsize))  # before `.name`, 20x slower to read
    if wire is None and array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 (kind "V"), should a caller have it
        return tensor_pb2.DTYPE_BFLOAT16
    if wire is None:
        raise ValueError(f"cannot put a {array.dtype} array on the wire; supported: {_supported()}")
    return wire


def to_proto_np(array: np.ndarray, dtype: int | None = None) -> Tensor:
    """A numpy array as a Tensor, in its own dtype.

    `dtype=DTYPE_BFLOAT16` sends a uint16 array as bfloat16 bit patterns, or a float32 array whose values are
    exactly bfloat16 (ValueError otherwise: the wire never rounds).
    """
    array, dtype = wire_array(array, dtype)
    return Tensor(shape=array.shape, dtype=dtype, data=array.tobytes())  # tobytes: C order, one copy


def wire_array(array: np.ndarray, dtype: int | None = None) -> tuple[np.ndarray, int]:
    """What `to_proto_np` sends: the array in its wire dtype's storage dtype (no copy when it is already), and
    that wire dtype."""
    array = np.asarray(array)
    own = _wire_dtype(array) if dtype != tensor_pb2.DTYPE_BFLOAT16 else None
    if dtype is None:
        dtype = own
    if dtype == tensor_pb2.DTYPE_BFLOAT16:
        array = _bf16_bits(array)
    elif dtype != own:
        raise ValueError(f"a {array.dtype} array cannot be sent as {dtype_name(dtype)}")
    storage = _STORAGE[dtype]
    if array.dtype != storage:  # same kind and size: only byte order may change
        array = array.astype(storage)
    return array, dtype


def _bf16_bits(array: np.ndarray) -> np.ndarray:
    kind, size = array.dtype.kind, array.dtype.itemsize
    if array.dtype.name == "bfloat16":
        return np.ascontiguousarray(array).view(np.uint16)
    if (kind, size) == ("u", 2):
        return array.astype("=u2", copy=False)
    if (kind, size) == ("f", 4):
        bits = np.ascontiguousarray(array, dtype="=f4").view(np.uint32)
        if np.any(bits & 0xFFFF):
            raise ValueError("float32 values are not exactly bfloat16; cast them before sending")
        return (bits >> 16).astype(np.uint16)
    raise ValueError(f"a {array.dtype} array cannot be sent as DTYPE_BFLOAT16 (use uint16 bits or float32)")


def from_proto_np(tensor: Tensor, *, bfloat16: str = "float32") -> np.ndarray:
    """A Tensor as a new numpy array in native byte order.

    bfloat16 has no numpy dtype: `bfloat16="float32"` widens it exactly to float32, `"bits"` returns the
    uint16 bit patterns.
    """
    return numpy_from_wire(tensor.shape, tensor.dtype, tensor.data, bfloat16=bfloat16)


def numpy_from_wire(shape, dtype: int, data: bytes | Sequence[bytes], *, bfloat16: str = "float32") -> np.ndarray:
    """`from_proto_np` of a payload given as its bytes or as its pieces in order (a snapshot's entries)."""
    if _whole(data):
        view = wire_view(shape, dtype, data)
        bits = view.astype(view.dtype.newbyteorder("="), copy=True)
    else:
        view = wire_read(shape, dtype, data)  # a new array unless one piece brought it all
        native = view.dtype.newbyteorder("=")
        bits = view if view.flags.owndata and view.dtype == native else view.astype(native, copy=True)
    if dtype != tensor_pb2.DTYPE_BFLOAT16:
        return bits
    if bfloat16 == "bits":
        return bits
    if bfloat16 == "float32":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"bfloat16 must be 'float32' or 'bits', got {bfloat16!r}")


def wire_view(shape, dtype: int, data: bytes) -> np.ndarray:
    """A payload of `dtype` and `shape` as a read-only view of `data` in the storage dtype (bfloat16 as bits, no
    copy); ValueError when its size does not match."""
    storage, shape = _fitting(shape, dtype, len(data))
    return np.frombuffer(data, dtype=storage).reshape(shape)


def wire_read(shape, dtype: int, pieces: Sequence[bytes], axis: int = 0, width: int | None = None) -> np.ndarray:
    """A payload given as its pieces in order, in the storage dtype (bfloat16 as bits): a read-only view of a lone
    piece, else a new array (one copy of each piece); with `width`, a new array `width` long along `axis`, the
    payload at the front and zeros past it. ValueError when the pieces' size does not match, or the array does
    not fit in `width`."""
    storage, shape = _fitting(shape, dtype, sum(map(len, pieces)))
    return _read(storage, shape, _wide(shape, axis, width), pieces, axis)


def _read(storage: np.dtype, shape: tuple[int, ...], wide: tuple[int, ...], pieces: Sequence[bytes],
          axis: int) -> np.ndarray:
    """`wire_read` of a payload already checked against its shape and width."""
    if wide == shape and len(pieces) == 1:
        return np.frombuffer(pieces[0], dtype=storage).reshape(shape)
    out = np.zeros(wide, storage)
    if out.size:
        front = math.prod(shape[axis:]) * storage.itemsize
        _fill(out.reshape(math.prod(shape[:axis]), -1).view(np.uint8)[:, :front], pieces)
    return out


def _fitting(shape, dtype: int, size: int) -> tuple[np.dtype, tuple[int, ...]]:
    """The storage dtype and the shape of a payload of `size` bytes; ValueError when they do not agree."""
    storage = _storage(dtype)
    shape = tuple(shape)
    if shape and min(shape) < 0:
        raise ValueError(f"tensor shape {list(shape)} has a negative dimension")
    expected = math.prod(shape) * storage.itemsize
    if size != expected:
        raise ValueError(
            f"tensor payload is {size} bytes but shape {list(shape)} of {dtype_name(dtype)} "
            f"needs {expected} bytes"
        )
    return storage, shape


def _wide(shape: tuple[int, ...], axis: int, width: int | None) -> tuple[int, ...]:
    """`shape` with `width` along `axis` (itself when None); ValueError when that is narrower or no axis."""
    if width is None:
        return shape
    if not 0 <= axis < len(shape):
        raise ValueError(f"tensor shape {list(shape)} has no axis {axis} to widen")
    if width < shape[axis]:
        raise ValueError(f"tensor shape {list(shape)} is wider than {width} along axis {axis}")
    return shape[:axis] + (width,) + shape[axis + 1 :]


def _fill(rows: np.ndarray, pieces: Sequence[bytes]) -> None:
    """Write the pieces' bytes in order into `rows` (uint8, (n, span)), row after row: at most three copies a
    piece (the rest of a row, whole rows, the start of a row)."""
    span, at = rows.shape[1], 0
    for piece in pieces:
        data = np.frombuffer(piece, np.uint8)
        while data.size:
            row, column = divmod(at, span)
            if column or data.size < span:
                n = min(span - column, data.size)
                rows[row, column : column + n] = data[:n]
            else:
                n = data.size - data.size % span
                rows[row : row + n // span] = data[:n].reshape(-1, span)
            data, at = data[n:], at + n


def _fits_mlx(shape: tuple[int, ...]) -> None:
    """ValueError for a dimension an MLX array cannot hold."""
    if shape and max(shape) > MLX_MAX_DIM:
        raise ValueError(f"tensor shape {list(shape)} has a dimension above {MLX_MAX_DIM}, the most an MLX "
                         "array can hold")


def _whole(data: bytes | Sequence[bytes]) -> bool:
    """Whether a payload is one run of bytes (a message's), not a snapshot's list of pieces."""
    return isinstance(data, (bytes, bytearray, memoryview))


def to_proto(array: mx.array | np.ndarray) -> Tensor:
    """An MLX (or numpy) array as a Tensor, in its own dtype; bfloat16 crosses as its bit patterns."""
    import mlx.core as mx

    if not isinstance(array, mx.array):
        return to_proto_np(array)
    if array.dtype == mx.bfloat16:
        return to_proto_np(np.array(array.view(mx.uint16)), dtype=tensor_pb2.DTYPE_BFLOAT16)
    return to_proto_np(np.asarray(array))


def from_proto(tensor: Tensor) -> mx.array:
    """A Tensor as an MLX array of the same dtype and bits; ValueError for a dimension MLX cannot hold (an
    empty tensor's payload agrees with any other dimension)."""
    return mlx_from_wire(tensor.shape, tensor.dtype, tensor.data)


def mlx_from_wire(shape, dtype: int, data: bytes | Sequence[bytes], axis: int = 0,
                  width: int | None = None) -> mx.array:
    """`from_proto` of a payload given as its bytes or as its pieces in order (a snapshot's entries); with `width`,
    `width` long along `axis`, zeros past the payload (one copy on the host, one into MLX)."""
    import mlx.core as mx

    if _whole(data) and width is None:  # a message's tensor: a view of its bytes, copied once into MLX below
        bits = wire_view(shape, dtype, data)
        _fits_mlx(bits.shape)
    else:
        pieces = [data] if _whole(data) else data
        storage, shape = _fitting(shape, dtype, sum(map(len, pieces)))
        wide = _wide(shape, axis, width)
        _fits_mlx(wide)  # before the buffer is made
        bits = _read(storage, shape, wide, pieces, axis)
    if not bits.dtype.isnative:
        bits = bits.astype(bits.dtype.newbyteorder("="))
    if dtype == tensor_pb2.DTYPE_BFLOAT16:
        return mx.array(bits).view(mx.bfloat16)
    return mx.array(bits)  # a copy: the array does not hold on to the message's bytes
