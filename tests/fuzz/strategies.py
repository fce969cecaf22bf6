"""Hypothesis strategies for the fuzz suite, built from the protobuf descriptors.

`random_message(descriptor)` fills any message type with random values of each field's wire type (ints at their
range edges, NaN and infinities, unknown enum numbers, random strings and bytes, any oneof choice or none);
`mutated(message)` breaks one to three fields of a valid message (cleared, replaced by a random value, another
oneof choice); `tensors()` and `corrupted_tensor(t)` make `voicechat.v1.Tensor`s whose shape, dtype and bytes may
disagree, with zero, negative and huge dimensions, unknown dtype numbers and non-finite values. Array payloads
come from a drawn seed, so an example stays small however many elements its tensor holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from protos.voicechat.v1 import tensor_pb2
from services.common.tensors import itemsize

TENSOR = tensor_pb2.Tensor.DESCRIPTOR.full_name
VALID_DTYPES = [d for d in tensor_pb2.DType.values() if d != tensor_pb2.DTYPE_UNSPECIFIED]
MAX_DEPTH = 3  # nested random messages below this depth are left empty
MAX_ELEMENTS = 8192  # largest payload a generated tensor carries (elements)

_F = FieldDescriptor
_INT_RANGES = {
    _F.TYPE_INT32: (-(2**31), 2**31 - 1), _F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), _F.TYPE_ENUM: (-(2**31), 2**31 - 1),
    _F.TYPE_INT64: (-(2**63), 2**63 - 1), _F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _F.TYPE_UINT32: (0, 2**32 - 1), _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_UINT64: (0, 2**64 - 1), _F.TYPE_FIXED64: (0, 2**64 - 1),
}
_EDGES = (0, 1, -1, 2, 3, 16000, 22050, 2**15, 2**16, 2**31 - 1, -(2**31), 2**31, 2**32 - 1, 2**53, 2**63 - 1,
          -(2**63), 2**64 - 1)
# Special element values: NaN, infinities, the largest finite float32, -0.0 and a subnormal.
_SPECIAL_FLOATS = (math.nan, math.inf, -math.inf, 3.4028235e38, -3.4028235e38, -0.0, 1e-45)


def _is_tensor(field: FieldDescriptor) -> bool:
    return field.type == _F.TYPE_MESSAGE and field.message_type.full_name == TENSOR


def message_class(descriptor: Descriptor) -> type[Message]:
    return GetMessageClass(descriptor)


def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Ints in [lo, hi], leaning on the edges (0, +-1, powers of two, the type's limits) and small values."""
    edges = sorted({v for v in (*_EDGES, lo, lo + 1, hi, hi - 1) if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(max(lo, -4), min(hi, 64)), st.integers(lo, hi))


def scalar_values(field: FieldDescriptor) -> st.SearchStrategy:
    """A random value of a non-message field's type (one element for a repeated field)."""
    kind = field.type
    if kind == _F.TYPE_ENUM:  # proto3 enums are open: unknown numbers are valid on the wire
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), integers(*_INT_RANGES[kind]))
    if kind in _INT_RANGES:
        return integers(*_INT_RANGES[kind])
    if kind == _F.TYPE_BOOL:
        return st.booleans()
    if kind == _F.TYPE_FLOAT:
        return st.one_of(st.sampled_from(_SPECIAL_FLOATS[:3]), st.floats(width=32))
    if kind == _F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(_SPECIAL_FLOATS[:3]), st.floats())
    if kind == _F.TYPE_STRING:
        return st.text(max_size=24)
    if kind == _F.TYPE_BYTES:
        return st.one_of(st.just(b""), st.binary(max_size=64))
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


def field_values(field: FieldDescriptor, depth: int = 0) -> st.SearchStrategy:
    """A random value for `field`: a list for a repeated field, a message for a message field."""
    if field.type == _F.TYPE_MESSAGE:
        one = tensors() if _is_tensor(field) else random_message(field.message_type, depth + 1)
    else:
        one = scalar_values(field)
    return st.lists(one, max_size=6) if field.is_repeated else one


def set_field(message: Message, field: FieldDescriptor, value) -> None:
    """Set `field` of `message` to `value` (replacing a repeated field's elements)."""
    name = field.name
    if field.is_repeated:
        message.ClearField(name)
        container = getattr(message, name)
        if field.type == _F.TYPE_MESSAGE:
            for item in value:
                container.add().CopyFrom(item)
        else:
            container.extend(value)
    elif field.type == _F.TYPE_MESSAGE:
        sub = getattr(message, name)
        sub.SetInParent()  # an empty message still selects its oneof choice
        sub.CopyFrom(value)
    else:
        setattr(message, name, value)


@st.composite
def random_message(draw, descriptor: Descriptor, depth: int = 0) -> Message:
    """Any message of `descriptor`'s type: each field set or not, each oneof on one of its choices or none."""
    message = message_class(descriptor)()
    if depth > MAX_DEPTH:
        return message
    chosen = {oneof.full_name: draw(st.sampled_from([None, *oneof.fields])) for oneof in descriptor.oneofs}
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None:
            if chosen[oneof.full_name] is not field:
                continue
        elif not draw(st.booleans()):
            continue
        set_field(message, field, draw(field_values(field, depth)))
    return message


# ------------------------------------------------------------------------------------------------ tensors


def _payload(rng: np.random.Generator, dtype: int, count: int, specials: list[tuple[float, int]]) -> bytes:
    """`count` random little-endian elements of a wire dtype, with special float values at the given positions."""
    if dtype in (tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_FLOAT16, tensor_pb2.DTYPE_BFLOAT16):
        values = rng.standard_normal(count).astype(np.float32) * 0.3
        for value, position in specials:
            if count:
                values[position % count] = value
        if dtype == tensor_pb2.DTYPE_FLOAT16:
            with np.errstate(over="ignore"):
                return values.astype("<f2").tobytes()
        if dtype == tensor_pb2.DTYPE_BFLOAT16:
            return (values.view(np.uint32) >> 16).astype("<u2").tobytes()
        return values.astype("<f4").tobytes()
    width = itemsize(dtype)
    if dtype == tensor_pb2.DTYPE_BOOL:  # 0 and 1, and now and then a byte that is neither
        return rng.choice(np.array([0, 1, 1, 0, 2, 255], np.uint8), count).tobytes()
    return rng.integers(0, 256, count * width, dtype=np.uint8).tobytes()


def _dims() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 8), st.sampled_from([0, 1, 31, 37, 1280, 1764]),
                     st.sampled_from([-1, -(2**63), 2**31 - 1, 2**31, 2**40, 2**63 - 1]))


@st.composite
def tensors(draw, max_elements: int = MAX_ELEMENTS) -> tensor_pb2.Tensor:
    """A Tensor: consistent (any dtype and a small shape, maybe with NaN/inf), or with shape, dtype and bytes
    that disagree (short, long, empty or random bytes, unknown dtypes, negative or huge dimensions)."""
    dtype = draw(st.one_of(st.sampled_from(VALID_DTYPES), st.sampled_from([tensor_pb2.DTYPE_UNSPECIFIED, 8, 99]),
                           integers(-(2**31), 2**31 - 1)))
    shape = draw(st.lists(_dims(), max_size=4))
    tensor = tensor_pb2.Tensor(shape=shape, dtype=dtype)
    valid_shape = all(d >= 0 for d in shape) and math.prod(shape) <= max_elements
    mode = draw(st.sampled_from(["exact", "exact", "short", "long", "empty", "bytes", "no elements"]))
    if mode == "no elements":  # a zero dimension beside any others (huge ones too): no bytes agree with it
        shape.insert(draw(st.integers(0, len(shape))), 0)
        if draw(st.booleans()):
            shape.insert(draw(st.integers(0, len(shape))), draw(st.sampled_from([2**31, 2**40, 2**63 - 1])))
        return tensor_pb2.Tensor(shape=shape, dtype=dtype)
    if mode == "bytes" or dtype not in VALID_DTYPES or not valid_shape:
        tensor.data = draw(st.binary(max_size=64)) if mode != "empty" else b""
        return tensor
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    specials = draw(st.lists(st.tuples(st.sampled_from(_SPECIAL_FLOATS), st.integers(0, 2**16)), max_size=3))
    data = _payload(rng, dtype, math.prod(shape), specials)
    if mode == "short":
        data = data[: max(len(data) - draw(st.integers(1, 8)), 0)]
    elif mode == "long":
        data += draw(st.binary(min_size=1, max_size=8))
    elif mode == "empty":
        data = b""
    tensor.data = data
    return tensor


@st.composite
def corrupted_tensor(draw, tensor: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    """A valid tensor broken one way: non-finite values, another dtype, a dimension off by one, another rank,
    truncated or extended bytes, a negative or huge dimension, an unknown dtype."""
    out = tensor_pb2.Tensor()
    out.CopyFrom(tensor)
    how = draw(st.sampled_from(["nonfinite", "dtype", "dim", "rank", "truncate", "extend", "baddim", "baddim",
                                "unknown", "empty"]))
    shape = list(out.shape)
    small = all(d >= 0 for d in shape) and math.prod(shape) <= MAX_ELEMENTS  # bytes to match can be made
    if how == "nonfinite" and out.dtype in (tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_FLOAT16,
                                            tensor_pb2.DTYPE_BFLOAT16) and small and math.prod(shape):
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        specials = draw(st.lists(st.tuples(st.sampled_from(_SPECIAL_FLOATS[:3]), st.integers(0, 2**16)),
                                 min_size=1, max_size=3))
        out.data = _payload(rng, out.dtype, math.prod(shape), specials)
    elif how == "dtype":  # the same bytes read as another dtype
        out.dtype = draw(st.sampled_from([d for d in VALID_DTYPES if d != out.dtype]))
    elif how == "dim" and shape and small and out.dtype in VALID_DTYPES:  # one dimension off by one, bytes to match
        axis = draw(st.integers(0, len(shape) - 1))
        shape[axis] = max(shape[axis] + draw(st.sampled_from([-1, 1])), 0)
        return _consistent(draw, out.dtype, shape)
    elif how == "rank" and small:  # the same elements with another rank
        shape = draw(st.sampled_from([[1, *shape], [*shape, 1], [math.prod(shape)] if len(shape) > 1 else [], []]))
        out.ClearField("shape")
        out.shape.extend(shape)
    elif how == "truncate":
        out.data = out.data[: draw(st.integers(0, max(len(out.data) - 1, 0)))]
    elif how == "extend":
        out.data = out.data + draw(st.binary(min_size=1, max_size=16))
    elif how == "baddim":
        bad = draw(st.sampled_from([-1, 0, 2**31, 2**40, 2**63 - 1]))
        out.ClearField("shape")
        if draw(st.booleans()):  # no elements at all, so the bytes (none) agree with the shape
            out.shape.extend([*shape, 0, bad])
            out.data = b""
        else:
            out.shape.extend([*shape, bad])
    elif how == "unknown":
        out.dtype = draw(st.sampled_from([tensor_pb2.DTYPE_UNSPECIFIED, 8, -1, 2**31 - 1]))
    else:
        out.data = b""
    return out


def _consistent(draw, dtype: int, shape: list[int]) -> tensor_pb2.Tensor:
    count = math.prod(shape)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return tensor_pb2.Tensor(shape=shape, dtype=dtype, data=_payload(rng, dtype, count, []))


# ---------------------------------------------------------------------------------------------- mutation


def field_paths(message: Message, prefix: tuple = ()) -> list[tuple[FieldDescriptor, ...]]:
    """Every field of `message` (set or not) and, inside the set singular message fields, theirs."""
    paths = []
    for field in message.DESCRIPTOR.fields:
        path = (*prefix, field)
        paths.append(path)
        if (field.type == _F.TYPE_MESSAGE and not field.is_repeated and message.HasField(field.name)
                and not _is_tensor(field)):
            paths += field_paths(getattr(message, field.name), path)
    return paths


def _parent(message: Message, path: tuple[FieldDescriptor, ...]) -> Message:
    for field in path[:-1]:
        message = getattr(message, field.name)
    return message


@st.composite
def mutated(draw, message: Message, fields: Callable[[FieldDescriptor], bool] = lambda f: True) -> Message:
    """A copy of `message` with one to three of its fields (those `fields` accepts) cleared or replaced: a random
    value of the field's type, another oneof choice, or a corrupted version of a tensor it held."""
    out = type(message)()
    out.CopyFrom(message)
    candidates = [p for p in field_paths(out) if fields(p[-1])]
    if not candidates:
        return out
    # tensors hold most of what can be wrong with a message: give their fields three times the weight
    candidates += [p for p in candidates if _is_tensor(p[-1])] * 2
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(candidates))
        parent, field = _parent(out, path), path[-1]
        how = draw(st.sampled_from(["replace", "replace", "clear"]))
        if field.is_repeated or not _is_tensor(field):
            if how == "clear":
                parent.ClearField(field.name)
            else:
                set_field(parent, field, draw(field_values(field)))
        elif how == "clear":
            parent.ClearField(field.name)
        elif parent.HasField(field.name) and draw(st.booleans()):
            set_field(parent, field, draw(corrupted_tensor(getattr(parent, field.name))))
        else:
            set_field(parent, field, draw(tensors()))
    return out


def frame_index_path(message: Message) -> tuple[FieldDescriptor, ...] | None:
    """The path to the field named `frame_index` in a frame message, if it has one."""
    for path in field_paths(message):
        if path[-1].name == "frame_index":
            return path
    return None


def with_frame_index(message: Message, index: int) -> Message:
    """A copy of a frame message whose frame_index is `index`."""
    out = type(message)()
    out.CopyFrom(message)
    path = frame_index_path(out)
    assert path is not None, f"{message.DESCRIPTOR.full_name} has no frame_index"
    setattr(_parent(out, path), path[-1].name, index)
    return out


@st.composite
def raw_bodies(draw, valid: list[bytes]) -> bytes:
    """A request body: random bytes, or a valid message's bytes truncated, with bytes flipped, or extended."""
    how = draw(st.sampled_from(["random", "random", "truncate", "flip", "extend"]) if valid
               else st.just("random"))
    if how == "random":
        return draw(st.binary(max_size=96))
    body = bytearray(draw(st.sampled_from(valid)))
    if how == "truncate":
        return bytes(body[: draw(st.integers(0, max(len(body) - 1, 0)))])
    if how == "flip" and body:
        for _ in range(draw(st.integers(1, 4))):
            body[draw(st.integers(0, len(body) - 1))] = draw(st.integers(0, 255))
        return bytes(body)
    return bytes(body) + draw(st.binary(min_size=1, max_size=32))
