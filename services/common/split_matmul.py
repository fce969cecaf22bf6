"""float32 activations times bfloat16 weights on a CUDA GPU, at float32's accuracy, reading the weights once.

A frame step's activations are float32 while the weights hold bf16 values (`--weights-dtype bfloat16`). cuBLAS
then has two choices: convert the weight to float32 in every call (three times the weight's bytes moved a
step), or read float32 copies kept at load (`--float32-weights`: twice the memory) in a float32 GEMM without
tensor cores, which at 16 rows runs far short of the GPU's bandwidth. TF32 is not an option: it rounds the
activations to 10 bits (the services keep `MLX_ENABLE_TF32=0`).

Here each activation x is split into three bf16 parts, x = hi + mid + lo (hi = bf16(x), mid = bf16(x - hi),
lo = bf16(x - hi - mid): 24 bits of mantissa, all of float32's), and x W^T = hi W^T + mid W^T + lo W^T is
computed by bf16 tensor-core products (`mma.sync` m16n8k16) accumulated in float32. Each product of two bf16
values is exact in float32, so the only rounding is the accumulation's, as in a float32 GEMM. A tensor core's
accumulator is not quite an IEEE float32 sum, and a long chain of them drifts (one range over K = 4480: 1.5e-5
of the output's scale), so each 64-wide block of K runs its 12 products into a fresh accumulator that an
ordinary float32 addition then adds to the running sum: 3-5e-7 at the language model's shapes, against
0.5-2.2e-6 for cuBLAS's float32 GEMM (an H200, against a float64 product).

A frame step multiplies a few dozen rows at most (one per session), so the product is a stream of the weight's
bytes: the kernel is laid out to keep many of them in flight. The weight's rows are the mma's 16-row side and
x's rows its 8-row side; each lane loads 32 contiguous bytes of two weight rows per 64-wide block of K, read
straight into the mma's registers (the k order inside a block is permuted alike on both sides), and splits its
x elements into their parts as it loads them. The weight (N, K) is cut along K into `splits` ranges, a number
set by its shape alone (`plan`), so that a narrow weight still spreads over the GPU; a second kernel adds the
ranges' partial sums in order. A batch of more than 16 rows takes several blocks for each stretch of the weight;
those blocks are neighbours in the launch order (the grid's fastest axis; then the weight's stretches, then the
ranges of K, the order a single row block has), so they run together and read the stretch from HBM once, the
others finding it in L2. Each output element is summed in one fixed order, so a row's result depends on neither
the other rows nor their number: a session's row is the same in a batch of 16 as alone.

    y = split_matmul(x, weight)   # x: (..., K) float32, weight: (N, K) bfloat16 -> (..., N) float32

The kernels are MLX custom CUDA kernels (`mx.fast.cuda_kernel`, compiled at first use and cached); `supports`
says which weights qualify (K and N multiples of 16).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

TILE = 16  # the sides of a supported weight are multiples of this
BLOCK_K = 64  # K is split in whole blocks of this (the rest, in 16-wide steps, goes to the last range)
ROW_TILE = 8  # x rows per mma (its n side); a block takes one or two tiles, 16 rows at most
# The layout, the fastest of those measured on an H200 at the language model's shapes (`bench.matmuls`,
# docs/performance-history.md): a warp takes 4 16-row tiles of W, one 64-wide block of K at a time, and a weight giving
# fewer than TARGET_WARPS warps is split along K until it gives about that many. A function of the weight's
# shape only, never of the rows.
COLUMN_TILES = 4
WARP_COLUMNS = 16 * COLUMN_TILES
UNROLL = 1
BLOCK_WARPS = 4
TARGET_WARPS = 1024

# Device helpers: one m16n8k16 bf16 tensor-core product accumulated in float32, and the three bf16 parts of four
# float32 values as the two packed registers of an mma operand (the lower k in the low half).
_HEADER = """
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// four float32 values -> their three bf16 parts, each as two packed pairs (lower index in the low half)
__device__ __forceinline__ void split_parts(float4 v, unsigned (&p)[3][2]) {
    const float e[4] = {v.x, v.y, v.z, v.w};
    unsigned bits[3][4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat16 hi = __float2bfloat16_rn(e[i]);
        const float rest = e[i] - __bfloat162float(hi);
        const __nv_bfloat16 mid = __float2bfloat16_rn(rest);
        const __nv_bfloat16 lo = __float2bfloat16_rn(rest - __bfloat162float(mid));
        bits[0][i] = __bfloat16_as_ushort(hi);
        bits[1][i] = __bfloat16_as_ushort(mid);
        bits[2][i] = __bfloat16_as_ushort(lo);
    }
    #pragma unroll
    for (int q = 0; q < 3; ++q) {
        p[q][0] = bits[q][0] | (bits[q][1] << 16);
        p[q][1] = bits[q][2] | (bits[q][3] << 16);
    }
}
"""

# x (R, K) float32, w (N, K) bf16 -> part (S, R, N) float32: the sums over each of the S ranges of K.
# Block (bx, by, s): x rows 8 NT bx .. 8 NT bx + 8 NT - 1 (the mma's n side, NT tiles of 8); warp v of the grid
# (counted along y) takes W rows 16 T v .. 16 T v + 16 T - 1 (the mma's m side, T tiles of 16) over K range s.
# Lane (g, t) loads W rows g and g + 8 of each tile and x row g of each x tile, 16 contiguous elements of each
# 64-wide block of K, so the mma's k order is a permutation of K's, the same for both sides.
_MATMUL_SOURCE = """
    const int R = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int warp = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int s = blockIdx.z;
    const int m0 = blockIdx.x * 8 * NT;
    const int n0 = warp * T * 16;
    const int blocks = K >> 6;
    const int first = (int)((long long)blocks * s / gridDim.z);
    const int last = (int)((long long)blocks * (s + 1) / gridDim.z);
    const __nv_bfloat16* wrow[T][2];
    #pragma unroll
    for (int tt = 0; tt < T; ++tt)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int n = n0 + tt * 16 + h * 8 + g;
            wrow[tt][h] = w + (long long)(n < N ? n : N - 1) * K;
        }
    const float* xrow[NT];
    bool xlive[NT];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int m = m0 + nt * 8 + g;
        xlive[nt] = m < R;
        xrow[nt] = x + (long long)(xlive[nt] ? m : 0) * K;
    }
    float acc[T][NT][4];
    #pragma unroll
    for (int tt = 0; tt < T; ++tt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc[tt][nt][i] = 0.f;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    // 64-wide blocks of K: lane t holds elements 16 t .. 16 t + 15 of each of its rows; the j-th 16-wide mma
    // step takes elements 4 j .. 4 j + 3 of every lane's 16 (the same order for W and for x)
    #pragma unroll UNROLL
    for (int b = first; b < last; ++b) {
        const int k = (b << 6) + (t << 4);
        uint4 wv[T][2][2];
        #pragma unroll
        for (int tt = 0; tt < T; ++tt)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                wv[tt][h][0] = __ldg(reinterpret_cast<const uint4*>(wrow[tt][h] + k));
                wv[tt][h][1] = __ldg(reinterpret_cast<const uint4*>(wrow[tt][h] + k + 8));
            }
        unsigned xb[NT][4][3][2];
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float4 v = xlive[nt] ? __ldg(reinterpret_cast<const float4*>(xrow[nt] + k + 4 * j)) : zero;
                split_parts(v, xb[nt][j]);
            }
        float block[T][NT][4] = {};
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            #pragma unroll
            for (int tt = 0; tt < T; ++tt) {
                // the A registers: rows g and g + 8 at the step's first pair of k, then at its second
                const uint4& row_g = wv[tt][0][j >> 1];
                const uint4& row_h = wv[tt][1][j >> 1];
                const unsigned g0 = (j & 1) ? row_g.z : row_g.x;
                const unsigned h0 = (j & 1) ? row_h.z : row_h.x;
                const unsigned g1 = (j & 1) ? row_g.w : row_g.y;
                const unsigned h1 = (j & 1) ? row_h.w : row_h.y;
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    #pragma unroll
                    for (int q = 0; q < 3; ++q)
                        mma_bf16(block[tt][nt], g0, h0, g1, h1, xb[nt][j][q][0], xb[nt][j][q][1]);
            }
        #pragma unroll
        for (int tt = 0; tt < T; ++tt)
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int i = 0; i < 4; ++i) acc[tt][nt][i] += block[tt][nt][i];
    }
    // what K leaves past its 64-wide blocks, in 16-wide steps (the last range's): lane t holds elements
    // 4 t .. 4 t + 3 of each step
    if (s == gridDim.z - 1) {
        for (int k16 = blocks << 6; k16 < K; k16 += 16) {
            const int k = k16 + (t << 2);
            uint2 wv[T][2];
            #pragma unroll
            for (int tt = 0; tt < T; ++tt)
                #pragma unroll
                for (int h = 0; h < 2; ++h) wv[tt][h] = __ldg(reinterpret_cast<const uint2*>(wrow[tt][h] + k));
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                unsigned xb[3][2];
                split_parts(xlive[nt] ? __ldg(reinterpret_cast<const float4*>(xrow[nt] + k)) : zero, xb);
                #pragma unroll
                for (int tt = 0; tt < T; ++tt) {
                    float step[4] = {};
                    #pragma unroll
                    for (int q = 0; q < 3; ++q)
                        mma_bf16(step, wv[tt][0].x, wv[tt][1].x, wv[tt][0].y, wv[tt][1].y, xb[q][0], xb[q][1]);
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) acc[tt][nt][i] += step[i];
                }
            }
        }
    }
    // acc[tt][nt]: {W row g, x row 2t}, {g, 2t + 1}, {g + 8, 2t}, {g + 8, 2t + 1} of the tile pair
    #pragma unroll
    for (int tt = 0; tt < T; ++tt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int n = n0 + tt * 16 + g + (i >> 1) * 8;
                const int m = m0 + nt * 8 + 2 * t + (i & 1);
                if (n < N && m < R) part[((long long)s * R + m) * N + n] = acc[tt][nt][i];
            }
"""

# part (S, R, N) -> y (R, N): the S partial sums of each element added in order.
_SUM_SOURCE = """
    const long long size = (long long)part_shape[1] * part_shape[2];
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= size) return;
    float v = part[i];
    for (int s = 1; s < part_shape[0]; ++s) v += part[s * size + i];
    y[i] = v;
"""

_kernels: dict[str, object] = {}


@dataclass(frozen=True)
class Plan:
    """How a product with a (N, K) weight is laid out: `splits` ranges of K (the weight's shape alone decides),
    `row_tiles` x tiles of 8 rows a block (the batch's size decides: it changes no row's sums), `warps` along N."""

    splits: int
    row_tiles: int
    warps: int

    @property
    def blocks(self) -> int:
        return -(-self.warps // BLOCK_WARPS)

    @property
    def rows(self) -> int:
        """x rows a block takes."""
        return ROW_TILE * self.row_tiles


def plan(n: int, k: int, rows: int) -> Plan:
    """The layout of x (rows, k) @ W (n, k)^T."""
    warps = -(-n // WARP_COLUMNS)
    splits = max(1, min(k // BLOCK_K, round(TARGET_WARPS / warps)))
    return Plan(splits, 1 if rows <= ROW_TILE else 2, warps)


def available() -> bool:
    """Whether MLX runs on a CUDA GPU here (the kernels are CUDA's)."""
    return mx.cuda.is_available()


def require() -> None:
    """Fail, naming the flag, where the kernels cannot run (checked before a service loads its weights)."""
    if not available():
        raise ValueError("split matmuls run on a CUDA GPU; MLX here has no CUDA device (leave --split-matmuls off)")


def supports(weight: mx.array) -> bool:
    """A dense bf16 (N, K) weight with N and K multiples of 16."""
    return (weight.ndim == 2 and weight.dtype == mx.bfloat16
            and weight.shape[0] % TILE == 0 and weight.shape[1] % TILE == 0)


def _kernel(name: str) -> object:
    if name not in _kernels:
        if name == "sum":
            _kernels[name] = mx.fast.cuda_kernel("split_matmul_sum", ["part"], ["y"], _SUM_SOURCE)
        else:
            _kernels[name] = mx.fast.cuda_kernel("split_matmul_ranges", ["x", "w"], ["part"], _MATMUL_SOURCE,
                                                 header=_HEADER)
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
    layout = plan(n, k, m)
    template = [("NT", layout.row_tiles), ("T", COLUMN_TILES), ("UNROLL", UNROLL)]
    part = _kernel("matmul")(inputs=[rows, weight], template=template,
                             grid=(-(-m // layout.rows) * BLOCK_WARPS * 32, layout.blocks, layout.splits),
                             threadgroup=(BLOCK_WARPS * 32, 1, 1), output_shapes=[(layout.splits, m, n)],
                             output_dtypes=[mx.float32])[0]
    if layout.splits == 1:
        y = part.reshape(m, n)
    else:
        y = _kernel("sum")(inputs=[part], grid=(-(-m * n // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                           output_shapes=[(m, n)], output_dtypes=[mx.float32])[0]
    return y.reshape(*lead, n)
