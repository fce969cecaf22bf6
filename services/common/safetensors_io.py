"""Minimal safetensors reading and writing, by key, without loading whole files.

A safetensors file is `u64 header_len | JSON header | data`; the header maps each key to its dtype,
shape and byte range. Reading parses the header and maps only the byte ranges asked for; writing
emits a deterministic header (keys in the order given, no timestamps) so equal inputs give equal bytes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import mmap
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors dtype name -> (numpy storage dtype, bytes per element). BF16 is stored as raw uint16.
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
    "I32": (np.dtype("<i4"), 4),
    "I64": (np.dtype("<i8"), 8),
    "U32": (np.dtype("<u4"), 4),
    "U16": (np.dtype("<u2"), 2),
    "U8": (np.dtype("u1"), 1),
    "I8": (np.dtype("i1"), 1),
    "BOOL": (np.dtype("?"), 1),
}


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file."""


@dataclass(frozen=True)
class TensorInfo:
    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int
    path: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Parse the header of one file: key -> TensorInfo (absolute offsets)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SafetensorsError(f"{path}: too short to be a safetensors file")
            (length,) = struct.unpack("<Q", raw)
            size = path.stat().st_size
            if length > size - 8:
                raise SafetensorsError(
                    f"{path}: not a safetensors file (header length {length} exceeds the file size {size})"
                )
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{path}: not a safetensors file ({exc})") from None
    base = 8 + length
    infos = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        if meta["dtype"] not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {key!r} has unsupported dtype {meta['dtype']}")
        shape = tuple(int(s) for s in meta["shape"])
        expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[meta["dtype"]][1]
        if end - start != expected or base + end > size:
            raise SafetensorsError(f"{path}: tensor {key!r} byte range {start}..{end} does not fit shape {shape}")
        infos[key] = TensorInfo(key, meta["dtype"], shape, base + start, base + end, path)
    return infos


class MappedFile:
    """A read-only memory map of one file; `array(info)` views a tensor's bytes without copying."""

    def __init__(self, path: Path):
        self._file = open(path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def array(self, info: TensorInfo) -> np.ndarray:
        dtype, _ = DTYPES[info.dtype]
        count = int(np.prod(info.shape, dtype=np.int64))
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=info.start).reshape(info.shape)

    def close(self) -> None:
        self._map.close()
        self._file.close()


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the raw uint16 bits."""
    values = np.asarray(values, dtype=np.float32)
    bits = np.ascontiguousarray(values).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16).reshape(values.shape)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to be written: its bytes come from `produce()` when its turn comes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype][1]


def write_file(path: str | Path, tensors: Iterable[PlannedTensor], metadata: dict[str, str] | None = None,
               workers: int = 1) -> int:
    """Write tensors in the order given, producing each one only shortly before it is written. Returns bytes
    written. With `workers` > 1 up to that many tensors (about 2 GB of them) are produced at once on threads
    (numpy releases the GIL in its generators and array arithmetic); each `produce` must then be safe to call
    concurrently with the others. The bytes written are the same."""
    tensors = list(tensors)
    header: dict[str, object] = {"__metadata__": metadata or {"format": "mlx"}}
    offset = 0
    for t in tensors:
        header[t.key] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t, data in zip(tensors, _produced(tensors, workers), strict=True):
            data = np.asarray(data)
            if not data.flags.c_contiguous:
                data = data.copy()
            storage = DTYPES[t.dtype][0]
            if data.dtype != storage or tuple(data.shape) != t.shape:
                raise ValueError(f"{t.key}: produced {data.dtype}{data.shape}, planned {storage}{t.shape}")
            f.write(data.tobytes())
    return 8 + len(blob) + offset


def _produced(tensors: list[PlannedTensor], workers: int, ahead_bytes: int = 2 << 30) -> Iterator[np.ndarray]:
    """Each tensor's data in order; with workers > 1, produced on a thread pool ahead of the writer, at most
    `workers` tensors and (beyond the next one) `ahead_bytes` of them at a time."""
    if workers <= 1:
        for t in tensors:
            yield t.produce()
        return
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        ahead: collections.deque[tuple[int, concurrent.futures.Future[np.ndarray]]] = collections.deque()
        queued = 0
        upcoming = 0
        while upcoming < len(tensors) or ahead:
            while upcoming < len(tensors) and len(ahead) < workers and (
                    not ahead or queued + tensors[upcoming].nbytes <= ahead_bytes):
                t = tensors[upcoming]
                ahead.append((t.nbytes, pool.submit(t.produce)))
                queued += t.nbytes
                upcoming += 1
            nbytes, future = ahead.popleft()
            queued -= nbytes
            yield future.result()
