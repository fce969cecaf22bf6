"""float32 activations times bfloat16 weights on a CUDA GPU's tensor cores, at float32's accuracy.

A frame step's activations are float32 while the weights hold bf16 values (`--weights-dtype bfloat16`). cuBLAS
then has two choices: convert the weight to float32 in every call (three times the weight's bytes moved a
step), or read float32 copies kept at load (`--float32-weights`: twice the memory) in a float32 GEMM without
tensor cores, which at 16 rows runs short of the GPU's bandwidth. TF32 is not an option: it rounds the
activations to 10 bits (the services keep `MLX_ENABLE_TF32=0`).

Here each activation x is split into three bf16 parts, x = hi + mid + lo (hi = bf16(x), mid = bf16(x - hi),
lo = bf16(x - hi - mid): 24 bits of mantissa, all of float32's), and x W^T = hi W^T + mid W^T + lo W^T is
computed by bf16 tensor-core products accumulated in float32. Each product of two bf16 values is exact in
float32, so the only rounding is the accumulation's, as in a float32 GEMM (against a float64 product of
16 x 4480 by 4480 x 22656, in an 8-warp layout: largest error 2.5e-6 of the output's scale, 1.7e-6 for cuBLAS's
float32 GEMM; the GPU tests hold the kernel to 4 times cuBLAS's error).
The weights are read once, as bf16. On an H200, the language model's matmuls of one 16-session step, each timed
one after another, sum to 16.7 ms against 28.4 with float32 copies, and the engine's whole 16-session step takes
28.9 ms instead of 37.9 (`docs/performance.md`).

    y = split_matmul(x, weight)   # x: (..., K) float32, weight: (N, K) bfloat16 -> (..., N) float32

A row's result does not depend on the other rows or on how many there are (each output element is summed in
one fixed order), so a session's row is the same in a batch of 16 as alone. The kernels are MLX custom CUDA
kernels (`mx.fast.cuda_kernel`, compiled at first use and cached); `supports` says which weights qualify (K and
N multiples of 16).
"""

from __future__ import annotations

import mlx.core as mx

TILE = 16  # the tensor-core fragment: 16 x 16 x 16, bf16 in, float32 accumulated
WARPS = 16  # warps of a block: each takes every WARPS-th 16-wide step along K, then the block sums them in order
# 16-column tiles of W per block: the best of 8 layouts, each timed one matmul after another on an H200
# (docs/performance.md); outputs of at least WIDE columns (the language heads) take WIDE_TILES
TILES = 4
WIDE_TILES = 8
WIDE = 65536

# x (M, K) float32 -> parts (3, Mp, K) bf16: hi, mid, lo, rows past M zero (Mp: M rounded up to 16).
_SPLIT_SOURCE = """
    const int rows = x_shape[0];
    const int K = x_shape[1];
    const long padded = (long)((rows + 15) / 16) * 16 * K;
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= padded) return;
    const float v = i < (long)rows * K ? x[i] : 0.f;
    const __nv_bfloat16 hi = __float2bfloat16_rn(v);
    const float rest = v - __bfloat162float(hi);
    const __nv_bfloat16 mid = __float2bfloat16_rn(rest);
    parts[i] = hi;
    parts[padded + i] = mid;
    parts[2 * padded + i] = __float2bfloat16_rn(rest - __bfloat162float(mid));
"""

# parts (3, Mp, K) bf16, w (N, K) bf16 -> y (Mp, N) float32. Block (bx, by): rows 16 by .. 16 by + 15, columns
# TILES 16-wide tiles from 16 TILES bx. Warp q sums the K-steps q, q + WARPS, ... of its tiles on the tensor
# cores (the three parts into one float32 accumulator); the block then adds its warps' sums in warp order.
_MATMUL_SOURCE = """
    using namespace nvcuda;
    __shared__ __align__(32) float partial[WARPS][256];
    const int N = w_shape[0];
    const int K = w_shape[1];
    const long padded = (long)parts_shape[1] * K;
    const int warp = threadIdx.x / 32;
    const int n0 = blockIdx.x * TILES * 16;
    const int m0 = blockIdx.y * 16;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[TILES];
    #pragma unroll
    for (int t = 0; t < TILES; ++t) wmma::fill_fragment(acc[t], 0.f);
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[3];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[TILES];
    const __nv_bfloat16* rows = parts + (long)m0 * K;
    const __nv_bfloat16* cols = w + (long)n0 * K;
    for (int k = warp * 16; k < K; k += WARPS * 16) {
        #pragma unroll
        for (int t = 0; t < TILES; ++t)
            if (n0 + t * 16 < N) wmma::load_matrix_sync(b[t], cols + (long)t * 16 * K + k, K);
        #pragma unroll
        for (int p = 0; p < 3; ++p) wmma::load_matrix_sync(a[p], rows + p * padded + k, K);
        #pragma unroll
        for (int t = 0; t < TILES; ++t) {
            if (n0 + t * 16 >= N) break;
            #pragma unroll
            for (int p = 0; p < 3; ++p) wmma::mma_sync(acc[t], a[p], b[t], acc[t]);
        }
    }
    #pragma unroll
    for (int t = 0; t < TILES; ++t) {
        if (n0 + t * 16 >= N) break;
        wmma::store_matrix_sync(&partial[warp][0], acc[t], 16, wmma::mem_row_major);
        __syncthreads();
        for (int e = threadIdx.x; e < 256; e += WARPS * 32) {
            float sum = 0.f;
            #pragma unroll
            for (int q = 0; q < WARPS; ++q) sum += partial[q][e];
            y[(long)(m0 + e / 16) * N + n0 + t * 16 + e % 16] = sum;
        }
        __syncthreads();
    }
"""

_kernels: dict[str, object] = {}


def available() -> bool:
    """Whether MLX runs on a CUDA GPU here (the kernels are CUDA's)."""
    return mx.cuda.is_available()


def require() -> None:
    """Fail, naming the flag, where the kernels cannot run (checked before a service loads its weights)."""
    if not available():
        raise ValueError("split matmuls run on a CUDA GPU's tensor cores; MLX here has no CUDA device "
                         "(leave --split-matmuls off)")


def supports(weight: mx.array) -> bool:
    """A dense bf16 (N, K) weight with N and K multiples of 16."""
    return (weight.ndim == 2 and weight.dtype == mx.bfloat16
            and weight.shape[0] % TILE == 0 and weight.shape[1] % TILE == 0)


def _kernel(name: str) -> object:
    if name not in _kernels:
        if name == "split":
            _kernels[name] = mx.fast.cuda_kernel("split_bf16_parts", ["x"], ["parts"], _SPLIT_SOURCE)
        else:
            _kernels[name] = mx.fast.cuda_kernel("split_bf16_matmul", ["parts", "w"], ["y"], _MATMUL_SOURCE,
                                                 header="#include <mma.h>\n")
    return _kernels[name]


def split_matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x (..., K) float32 @ weight (N, K) bf16 transposed -> (..., N) float32, on a CUDA GPU."""
    if x.dtype != mx.float32 or not supports(weight) or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"split_matmul: needs float32 x (..., K) and a bf16 (N, K) weight with N, K multiples of "
                         f"16; got x {x.dtype} {x.shape}, weight {weight.dtype} {weight.shape}")
    n, k = weight.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    padded = -(-m // TILE) * TILE
    parts = _kernel("split")(inputs=[rows], grid=(padded * k, 1, 1), threadgroup=(256, 1, 1),
                             output_shapes=[(3, padded, k)], output_dtypes=[mx.bfloat16])[0]
    tiles = WIDE_TILES if n >= WIDE else TILES
    y = _kernel("matmul")(inputs=[parts, weight], template=[("WARPS", WARPS), ("TILES", tiles)],
                          grid=(-(-n // (TILE * tiles)) * WARPS * 32, padded // TILE, 1),
                          threadgroup=(WARPS * 32, 1, 1), output_shapes=[(padded, n)],
                          output_dtypes=[mx.float32])[0]
    if padded != m:
        y = y[:m]
    return y.reshape(*lead, n)
