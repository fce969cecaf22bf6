"""Tensors cross the wire bit for bit, in the dtype their producer made."""

import mlx.core as mx
import numpy as np
import pytest

from protos.voicechat.v1 import tensor_pb2
from services.common.tensors import from_proto, from_proto_np, itemsize, to_proto, to_proto_np

# Bit patterns worth keeping: signalling and quiet NaNs with payloads, -0.0, infinities, subnormals.
F32_BITS = np.array(
    [0x7F800001, 0xFFC00123, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x3FC00000, 0x7FFFFFFF],
    dtype=np.uint32,
)
F16_BITS = np.array([0x7C01, 0xFE33, 0x8000, 0x7C00, 0x0001, 0x3E00], dtype=np.uint16)
BF16_BITS = np.array([0x7F81, 0xFFC1, 0x8000, 0x7F80, 0x0001, 0x3FC0, 0xC2F7], dtype=np.uint16)

NUMPY_CASES = {
    tensor_pb2.DTYPE_FLOAT32: F32_BITS.view(np.float32).reshape(2, 4),
    tensor_pb2.DTYPE_FLOAT16: F16_BITS.view(np.float16).reshape(3, 2),
    tensor_pb2.DTYPE_INT32: np.array([[-(2**31), -1, 0, 2**31 - 1]], np.int32),
    tensor_pb2.DTYPE_BOOL: np.array([True, False, True]),
    tensor_pb2.DTYPE_INT64: np.array([-(2**63), 2**40 + 3, 2**63 - 1], np.int64),
    tensor_pb2.DTYPE_UINT32: np.array([0, 1, 2**32 - 1], np.uint32),
}
MLX_DTYPES = {
    tensor_pb2.DTYPE_FLOAT32: mx.float32,
    tensor_pb2.DTYPE_FLOAT16: mx.float16,
    tensor_pb2.DTYPE_INT32: mx.int32,
    tensor_pb2.DTYPE_BOOL: mx.bool_,
    tensor_pb2.DTYPE_INT64: mx.int64,
    tensor_pb2.DTYPE_UINT32: mx.uint32,
}


def _bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def _through_wire(tensor: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor.FromString(tensor.SerializeToString())


@pytest.mark.parametrize("dtype", list(NUMPY_CASES), ids=tensor_pb2.DType.Name)
def test_numpy_round_trip_is_bit_exact(dtype):
    array = NUMPY_CASES[dtype]
    tensor = _through_wire(to_proto_np(array))
    assert tensor.dtype == dtype
    assert list(tensor.shape) == list(array.shape)
    assert len(tensor.data) == array.size * itemsize(dtype)
    back = from_proto_np(tensor)
    assert back.dtype == array.dtype and back.shape == array.shape
    assert _bits(back) == _bits(array)


@pytest.mark.parametrize("dtype", list(MLX_DTYPES), ids=tensor_pb2.DType.Name)
def test_mlx_round_trip_is_bit_exact(dtype):
    array = mx.array(NUMPY_CASES[dtype])
    tensor = _through_wire(to_proto(array))
    assert tensor.dtype == dtype
    back = from_proto(tensor)
    assert back.dtype == MLX_DTYPES[dtype] and back.shape == array.shape
    assert _bits(np.array(back)) == _bits(NUMPY_CASES[dtype])


def test_bfloat16_round_trip_is_bit_exact():
    array = mx.array(BF16_BITS).view(mx.bfloat16)
    tensor = _through_wire(to_proto(array))
    assert tensor.dtype == tensor_pb2.DTYPE_BFLOAT16
    assert tensor.data == BF16_BITS.astype("<u2").tobytes()
    back = from_proto(tensor)
    assert back.dtype == mx.bfloat16
    assert _bits(np.array(back.view(mx.uint16))) == _bits(BF16_BITS)
    # numpy side: raw bits, or the exact float32 widening (bf16 is the top half of the f32 pattern).
    assert _bits(from_proto_np(tensor, bfloat16="bits")) == _bits(BF16_BITS)
    widened = from_proto_np(tensor)
    assert widened.dtype == np.float32
    assert _bits(widened.view(np.uint32)) == _bits(BF16_BITS.astype(np.uint32) << 16)
    assert to_proto_np(widened, dtype=tensor_pb2.DTYPE_BFLOAT16) == tensor
    assert to_proto_np(BF16_BITS, dtype=tensor_pb2.DTYPE_BFLOAT16) == tensor


def test_float32_that_is_not_bfloat16_is_refused():
    with pytest.raises(ValueError, match="not exactly bfloat16"):
        to_proto_np(np.array([1.0 + 2**-20], np.float32), dtype=tensor_pb2.DTYPE_BFLOAT16)


@pytest.mark.parametrize("shape", [(), (0,), (0, 31), (3, 0, 2)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.int32, mx.bool_])
def test_scalar_and_empty_shapes(shape, dtype):
    array = mx.zeros(shape, dtype=dtype) if shape else mx.array(7, dtype=dtype)
    tensor = _through_wire(to_proto(array))
    assert list(tensor.shape) == list(shape)
    back = from_proto(tensor)
    assert back.shape == array.shape and back.dtype == array.dtype
    assert mx.array_equal(back, array).item()


def test_big_endian_input_is_sent_little_endian():
    array = np.array([1.5, -2.0], dtype=">f4")
    tensor = to_proto_np(array)
    assert tensor.data == np.array([1.5, -2.0], dtype="<f4").tobytes()
    np.testing.assert_array_equal(from_proto_np(tensor), array)


@pytest.mark.parametrize("view", ["transposed", "strided", "fortran", "big-endian transposed"])
def test_non_contiguous_input_is_sent_in_c_order(view):
    base = np.arange(12, dtype=np.int32).reshape(3, 4)
    array = {"transposed": base.T, "strided": base[:, ::2], "fortran": np.asfortranarray(base),
             "big-endian transposed": base.astype(">i4").T}[view]
    tensor = to_proto_np(array)
    assert list(tensor.shape) == list(array.shape)
    assert tensor.data == np.ascontiguousarray(array, dtype="<i4").tobytes()
    np.testing.assert_array_equal(from_proto_np(tensor), array)
    assert np.array_equal(np.array(from_proto(tensor)), array)


def test_truncated_payload_names_both_byte_counts():
    tensor = to_proto_np(np.zeros((2, 1280), np.float32))
    tensor.data = tensor.data[:-3]
    with pytest.raises(ValueError, match=r"10237 bytes.*\[2, 1280\].*DTYPE_FLOAT32.*10240 bytes"):
        from_proto(tensor)
    with pytest.raises(ValueError, match="10237 bytes"):
        from_proto_np(tensor)


def test_bad_dtypes_and_shapes_are_refused():
    with pytest.raises(ValueError, match="DTYPE_UNSPECIFIED"):
        from_proto_np(tensor_pb2.Tensor(shape=[1], data=b"\0\0\0\0"))
    with pytest.raises(ValueError, match="negative dimension"):
        from_proto_np(tensor_pb2.Tensor(shape=[-1], dtype=tensor_pb2.DTYPE_INT32))
    with pytest.raises(ValueError, match="float64"):
        to_proto_np(np.zeros(2, np.float64))
    with pytest.raises(ValueError, match="cannot be sent as DTYPE_INT32"):
        to_proto_np(np.zeros(2, np.float32), dtype=tensor_pb2.DTYPE_INT32)


def test_decoded_arrays_are_writable_copies():
    tensor = to_proto_np(np.arange(4, dtype=np.int32))
    back = from_proto_np(tensor)
    back[0] = 9
    assert from_proto_np(tensor)[0] == 0
