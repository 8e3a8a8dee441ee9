// Dense family: embedding gather, projections (linear, per-head linear), elementwise activations
// and elementwise arithmetic (scale, add).
//
// Projections are exact class and read each weight once for all t rows of the call. bf16
// weights (every real checkpoint) run on tensor cores through exact_mma.cuh: exact bf16 pieces of
// the float32 activations, a fixed MMA sequence per output. float32 weights run on CUDA cores:
// one warp owns one output row of the weight and streams it once for the rows (up to 16; more
// only in the prime class). Lane l reads the 8-float chunks starting at in-features
// k = 8l, 8l + 256, 8l + 512, ... and adds the 8 products of each chunk in increasing k; the
// warp's fixed shuffle tree then adds the 32 lane partials. Either order depends only on n_in,
// never on t, the grid or the kernel's row template, so row r of a t-row call is bit-identical
// to the row alone.
#include "common.cuh"
#include "exact_mma.cuh"
#include "exact_mma_fp8.cuh"

static_assert(MMA_THREADS == MEMRA_BLOCK, "the host launches every tensor-core kernel with BLOCK threads");
static_assert(VERIFY_CAP <= 16, "a verify walk's rows take one weight pass (row template t16, bf16 n2)");
static_assert(BF16_OUTS % 16 == 0, "a bf16 tile is whole 16-row MMA blocks");

#define WARP 32
#define CHUNK 8  // in-features per lane per step
#define STEP (WARP * CHUNK)

static __device__ __forceinline__ float widen(float v) { return v; }
static __device__ __forceinline__ float widen(unsigned short v) { return bf16_to_f32(v); }

// Fixed-shape warp tree: lane 0 ends with the sum of the 32 lanes' partials.
static __device__ __forceinline__ float warp_sum(float v) {
    for (int off = WARP / 2; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

// The 8 floats of a full chunk (weights or activations); vector loads when 16-byte aligned.
static __device__ __forceinline__ void load_chunk(const float* p, bool aligned, float* v) {
    if (aligned) {
        const float4 a = *reinterpret_cast<const float4*>(p);
        const float4 b = *reinterpret_cast<const float4*>(p + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int j = 0; j < CHUNK; ++j) v[j] = p[j];
    }
}

// y[r, o] = sum_k w[o, k] x[r, k] for r < t (t <= T) and this warp's O output rows o. x rows are
// x_stride floats apart and y rows y_stride apart (head_linear interleaves heads within a row).
// O > 1 lets one activation load serve O weight rows (multi-row calls are load-bound otherwise);
// each output's own reduction order is the same for every O.
template <int T, int O>
static __device__ void project(const float* __restrict__ x, const float* __restrict__ w,
                               float* __restrict__ y, int t, int n_in, int n_out,
                               long long x_stride, long long y_stride) {
    const int lane = threadIdx.x % WARP;
    const int o0 = (blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP) * O;
    if (o0 >= n_out) return;
    const int no = min(O, n_out - o0);
    const float* wr = w + (long long)o0 * n_in;
    const bool aligned = (reinterpret_cast<unsigned long long>(wr) % 16) == 0 && n_in % CHUNK == 0;
    const bool x_aligned = (reinterpret_cast<unsigned long long>(x) % 16) == 0 && x_stride % 4 == 0;
    for (int r0 = 0; r0 < t; r0 += T) {  // more than T rows only in the prime class
        const int nr = min(T, t - r0);
        float acc[T][O];
#pragma unroll
        for (int r = 0; r < T; ++r)
#pragma unroll
            for (int q = 0; q < O; ++q) acc[r][q] = 0.0f;
        for (int c = lane * CHUNK; c < n_in; c += STEP) {
            if (c + CHUNK <= n_in) {
                float wv[O][CHUNK];
#pragma unroll
                for (int q = 0; q < O; ++q)
                    if (q < no) load_chunk(wr + (long long)q * n_in + c, aligned, wv[q]);
#pragma unroll
                for (int r = 0; r < T; ++r) {
                    if (r < nr) {
                        float xv[CHUNK];
                        load_chunk(x + (r0 + r) * x_stride + c, x_aligned, xv);  // the same chunk of row r
#pragma unroll
                        for (int q = 0; q < O; ++q)
#pragma unroll
                            for (int j = 0; j < CHUNK; ++j) acc[r][q] = acc[r][q] + wv[q][j] * xv[j];
                    }
                }
            } else {  // the row's ragged tail: same order, element by element
                for (int j = 0; c + j < n_in; ++j) {
#pragma unroll
                    for (int q = 0; q < O; ++q) {
                        const float wv = q < no ? wr[(long long)q * n_in + c + j] : 0.0f;
#pragma unroll
                        for (int r = 0; r < T; ++r)
                            if (r < nr) acc[r][q] = acc[r][q] + wv * x[(r0 + r) * x_stride + c + j];
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < T; ++r)
#pragma unroll
            for (int q = 0; q < O; ++q) {
                const float s = warp_sum(acc[r][q]);
                if (lane == 0 && r < nr && q < no) y[(r0 + r) * y_stride + o0 + q] = s;
            }
    }
}

// x [t, in], w [out, in] -> y [t, out]; grid (ceil(out / (WARPS_PER_BLOCK * O))), block MEMRA_BLOCK.
// x [t, H, in], w [H, out, in] -> y [t, H, out] for head_linear; grid (.., H).
// One float32-weight kernel per row template T in {1, 2, 4, 8, 16}, each with its outputs per
// warp O = OUTS_PER_WARP_T<T>: the host picks the smallest T >= min(t, 16).
// Neither T nor O changes a row's bits; they size the accumulators and the activation reuse.
#define PROJECTIONS(T, O)                                                                          \
    extern "C" __global__ void linear_f32_t##T(const float* x, const float* w, float* y, int t,     \
                                               int n_in, int n_out) {                              \
        after_predecessor();                                                                       \
        project<T, O>(x, w, y, t, n_in, n_out, n_in, n_out);                                \
    }                                                                                              \
    extern "C" __global__ void head_linear_f32_t##T(const float* x, const float* w, float* y,       \
                                                    int t, int n_in, int n_out) {                  \
        after_predecessor();                                                                       \
        const long long h = blockIdx.y, heads = gridDim.y;                                         \
        project<T, O>(x + h * n_in, w + h * n_out * n_in, y + h * n_out, t, n_in, n_out,    \
                             heads * n_in, heads * n_out);                                         \
    }

PROJECTIONS(1, OUTS_PER_WARP_T1) PROJECTIONS(2, OUTS_PER_WARP_T2) PROJECTIONS(4, OUTS_PER_WARP_T4)
PROJECTIONS(8, OUTS_PER_WARP_T8) PROJECTIONS(16, OUTS_PER_WARP_T16)

// bf16 weights: the BF16_OUTS outputs of o-tile `tile` per block of MMA_THREADS, 8 NT rows per pass
// (NT = 1 for t <= 8, else 2; the host picks, the bits do not depend on it).
// w_stride: elements from one weight row to the next (n_in, or more for a split-K slice).
// PREFETCH: mma_tile's two k-blocks in flight: the projection groups' 16-row tiles (at 8 rows
// and at 1 the walk and the decode step ran slower with it; the per-head projections keep one,
// whose registers would otherwise halve their blocks an SM).
template <int NT, bool PREFETCH, bool ONE = false>
static __device__ void project_bf16(const float* x, const unsigned short* w, float* y, int t,
                                    int n_in, int n_out, long long x_stride, long long y_stride,
                                    long long w_stride, int tile) {
    constexpr int J = BF16_OUTS / 16;
    __shared__ MmaTile<J, NT> sh;
    const int g = threadIdx.x % MMA_WARP / 4, o0 = tile * BF16_OUTS;
    const bool w_aligned = (reinterpret_cast<unsigned long long>(w) % 16) == 0 && w_stride % 8 == 0;
    const bool x_aligned = (reinterpret_cast<unsigned long long>(x) % 16) == 0 && x_stride % 4 == 0;
    const unsigned short* wrow[J][2];
#pragma unroll
    for (int j = 0; j < J; ++j) mma_rows(w, o0 + 16 * j, n_out, w_stride, wrow[j]);
    for (int r0 = 0; r0 < t; r0 += 8 * NT) {  // more than 8 NT rows only in the prime class
        const int nr = min(8 * NT, t - r0);
        const float* xrow[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n)
            xrow[n] = 8 * n + g < nr ? x + (r0 + 8 * n + g) * x_stride : nullptr;
        mma_tile<J, NT, true, PREFETCH, ONE>(wrow, xrow, n_in, w_aligned, x_aligned, sh);
        for (int i = threadIdx.x; i < BF16_OUTS * nr; i += MMA_THREADS) {
            const int m = i % BF16_OUTS, n = i / BF16_OUTS;
            if (o0 + m < n_out) y[(r0 + n) * y_stride + o0 + m] = sh.tile[m][n];
        }
    }
}

// x [t, H, in], w [H, out, in] -> y [t, H, out]; grid (ceil(out / BF16_OUTS), H).
#define HEAD_PROJECTIONS_BF16(NT)                                                                  \
    extern "C" __global__ void head_linear_bf16_n##NT(const float* x, const unsigned short* w,     \
                                                      float* y, int t, int n_in, int n_out) {      \
        after_predecessor();                                                                       \
        const long long h = blockIdx.y, heads = gridDim.y;                                         \
        project_bf16<NT, false>(x + h * n_in, w + h * n_out * n_in, y + h * n_out, t, n_in, n_out, \
                         heads * n_in, heads * n_out, n_in, blockIdx.x);                           \
    }

HEAD_PROJECTIONS_BF16(1) HEAD_PROJECTIONS_BF16(2)

// FP8 weights (e4m3 bytes, scale [ceil(out / FP8_BLOCK), ceil(in / FP8_BLOCK)]): the bf16 tile
// shape with exact_mma_fp8.cuh's blockwise tile, one byte read per weight. k0: the first in-feature
// of a split-K slice (a multiple of FP8_BLOCK), so the slice's blocks keep their scale columns.
// ONE: one row and whole tiles (mma_tile_fp8's ONE; the host checks, dense.py's _group_kernel).
static_assert(SPLIT_KC % FP8_BLOCK == 0, "a split-K slice is whole FP8 blocks");
template <int NT, bool ONE = false>
static __device__ void project_fp8(const float* x, const unsigned char* w, const float* scale, float* y,
                                   int t, int n_in, int n_out, long long k0, long long w_stride, int tile) {
    constexpr int J = BF16_OUTS / 16;
    __shared__ MmaTile<J, NT> sh;
    const int g = threadIdx.x % MMA_WARP / 4, o0 = tile * BF16_OUTS;
    const long long n_kb = (w_stride + FP8_BLOCK - 1) / FP8_BLOCK;  // scale columns of the whole row
    const bool w_aligned = (reinterpret_cast<unsigned long long>(w + k0) % 16) == 0 && w_stride % 16 == 0;
    const bool x_aligned = (reinterpret_cast<unsigned long long>(x + k0) % 16) == 0 && w_stride % 4 == 0;
    const unsigned char* wrow[J][2];
    const float* srow[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        mma_rows_fp8(w + k0, scale, o0 + 16 * j, n_out, w_stride, n_kb, wrow[j], srow[j]);
        if (srow[j] != nullptr) srow[j] += k0 / FP8_BLOCK;
    }
    for (int r0 = 0; r0 < t; r0 += 8 * NT) {  // more than 8 NT rows only in the prime class
        const int nr = min(8 * NT, t - r0);
        const float* xrow[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n)
            xrow[n] = 8 * n + g < nr ? x + (r0 + 8 * n + g) * w_stride + k0 : nullptr;
        mma_tile_fp8<J, NT, ONE>(wrow, srow, xrow, n_in, w_aligned, x_aligned, sh);
        for (int i = threadIdx.x; i < BF16_OUTS * nr; i += MMA_THREADS) {
            const int m = i % BF16_OUTS, n = i / BF16_OUTS;
            if (o0 + m < n_out) y[(r0 + n) * (long long)n_out + o0 + m] = sh.tile[m][n];
        }
    }
}

// A projection group: the bf16 or FP8 weights that share one input x [t, in], in one launch (a
// lone projection is a group of one). Each member keeps the o-tiles and split-K slices it has on
// its own (SPLIT_KC in-features a slice, chosen by its shape, never by t), so its outputs do not
// depend on the rest of the group. table: int64 [members][GROUP_FIELDS], member m's fields at
// table + m GROUP_FIELDS in the order of the enum; the host builds it (backend/cuda/dense.py).
// Block b serves the last member whose first block is <= b: o-tile (b - first) / splits,
// slice (b - first) % splits. A member's outputs start at y + t G_Y ([t, n_out]), its slices'
// partial outputs at part + t G_PART ([splits, t, n_out]).
enum GroupField { G_W, G_SCALE, G_OUT, G_SPLITS, G_FIRST, G_Y, G_PART, G_COUNTER, GROUP_FIELDS };

// Split-K without a second launch: every slice block writes its partial tile, then counts itself
// in at counters[tile] (an integer atomic); the block that arrives last adds the slices in slice
// order, part[0] + part[1] + ..., whichever block that is, and sets the counter back to 0 for the
// next launch on this stream.
static __device__ void add_slices(const float* part, float* y, int* counter, int t, int n_out,
                                  int splits, int tile) {
    __shared__ int last;
    __threadfence();  // this block's partial tile is visible before it counts itself in
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1) == splits - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    if (!last) return;
    const long long n = (long long)t * n_out;
    for (int i = threadIdx.x; i < BF16_OUTS * t; i += MMA_THREADS) {
        const int o = tile * BF16_OUTS + i % BF16_OUTS;
        if (o >= n_out) continue;
        const long long at = (long long)(i / BF16_OUTS) * n_out + o;
        float acc = __ldcg(part + at);  // from L2: the other slices were written by other SMs
        for (int s = 1; s < splits; ++s) acc += __ldcg(part + s * n + at);
        y[at] = acc;
    }
}

// One block of a group: its member's slice of one o-tile through project(w, scale, out, n_in, k0,
// tile), into y or, split, into its partial tile and then add_slices.
template <typename Project>
static __device__ void group_block(const long long* table, int members, float* y, float* part,
                                   int* counters, int t, int n_in, Project project) {
    int m = 0;
    while (m + 1 < members && blockIdx.x >= table[(m + 1) * GROUP_FIELDS + G_FIRST]) ++m;
    const long long* f = table + m * GROUP_FIELDS;
    const int n_out = (int)f[G_OUT], splits = (int)f[G_SPLITS], local = blockIdx.x - (int)f[G_FIRST];
    const int tile = local / splits, s = local % splits;
    if (splits == 1) {
        project(f, y + t * f[G_Y], n_in, 0LL, tile);
        return;
    }
    const long long k0 = (long long)s * SPLIT_KC;
    float* mine = part + t * f[G_PART];
    project(f, mine + s * (long long)t * n_out, (int)min((long long)SPLIT_KC, n_in - k0), k0, tile);
    add_slices(mine, y + t * f[G_Y], counters + f[G_COUNTER] + tile, t, n_out, splits, tile);
}

// One block of a group of bf16 members, and of FP8 members (template arguments as for
// project_bf16 and project_fp8); the kernels below differ only in them and in their launch bounds.
template <int NT, bool PREFETCH, bool ONE = false>
static __device__ void bf16_group_block(const float* x, const long long* table, int members, float* y, float* part,
                                        int* counters, int t, int n_in) {
    group_block(table, members, y, part, counters, t, n_in,
                [&](const long long* f, float* out, int len, long long k0, int tile) {
                    const unsigned short* w = reinterpret_cast<const unsigned short*>(f[G_W]);
                    project_bf16<NT, PREFETCH, ONE>(x + k0, w + k0, out, t, len, (int)f[G_OUT], n_in, f[G_OUT], n_in,
                                                    tile);
                });
}

template <int NT, bool ONE = false>
static __device__ void fp8_group_block(const float* x, const long long* table, int members, float* y, float* part,
                                       int* counters, int t, int n_in) {
    group_block(table, members, y, part, counters, t, n_in,
                [&](const long long* f, float* out, int len, long long k0, int tile) {
                    project_fp8<NT, ONE>(x, reinterpret_cast<const unsigned char*>(f[G_W]),
                                         reinterpret_cast<const float*>(f[G_SCALE]), out, t, len, (int)f[G_OUT], k0,
                                         n_in, tile);
                });
}

// grid (the members' blocks), block MMA_THREADS. The launch bounds keep the blocks per SM the
// registers would otherwise cut (a decode projection is bound by the loads its blocks keep in flight).
#define GROUP_KERNEL(NAME, BLOCKS, BODY)                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, BLOCKS)                              \
    NAME(const float* x, const long long* table, int members, float* y, float* part, int* counters, int t, \
         int n_in) {                                                                                \
        after_predecessor();                                                                        \
        BODY(x, table, members, y, part, counters, t, n_in);                                        \
    }

GROUP_KERNEL(linear_group_bf16_n1, 3, (bf16_group_block<1, false>))
GROUP_KERNEL(linear_group_bf16_n2, 2, (bf16_group_block<2, true>))
GROUP_KERNEL(linear_group_fp8_n1, 2, fp8_group_block<1>)
GROUP_KERNEL(linear_group_fp8_n2, 1, fp8_group_block<2>)

// One decode row: linear_group_bf16_n1's bits through mma_tile's ONE tile, and linear_group_fp8_n1's
// through the staged one-row FP8 tile where every member's tiles are whole (rows 16-byte aligned,
// n_in whole FP8 blocks: the host checks). Kernels of their own, so the 2..8-row walks keep the n1
// kernels' registers (with the one-row loop beside its checked loop, bf16 n1 spilled and its 8-row
// calls ran 1-3% slower) and the one-row ones fewer (80: three blocks an SM). linear_group_bf16_one4
// (64 registers: four blocks an SM) serves the groups whose blocks fill an SM's last round better
// at four than at three (the host picks, dense.py's _one_row_kernel: a 4096 x 8192 projection is
// 512 blocks, one round at four and 1.3 at three); the bits are the same.
GROUP_KERNEL(linear_group_bf16_one, 3, (bf16_group_block<1, false, true>))
GROUP_KERNEL(linear_group_bf16_one4, 4, (bf16_group_block<1, false, true>))
GROUP_KERNEL(linear_group_fp8_one, 3, (fp8_group_block<1, true>))

// y[i] = table[ids[i]]; grid (n_ids), block MEMRA_BLOCK. An id outside [0, vocab) gives a NaN
// row (loud downstream) instead of an out-of-bounds read; host ids are checked before launch.
template <typename W>
static __device__ void gather(const W* table, const int* ids, float* y, int vocab, int dim) {
    const int id = ids[blockIdx.x];
    float* out = y + (long long)blockIdx.x * dim;
    const bool ok = id >= 0 && id < vocab;
    for (int k = threadIdx.x; k < dim; k += MEMRA_BLOCK)
        out[k] = ok ? widen(table[(long long)id * dim + k]) : __int_as_float(0x7fc00000);
}

extern "C" __global__ void embed_f32(const float* table, const int* ids, float* y, int vocab,
                                     int dim) {
    after_predecessor();
    gather(table, ids, y, vocab, dim);
}

extern "C" __global__ void embed_bf16(const unsigned short* table, const int* ids, float* y,
                                      int vocab, int dim) {
    after_predecessor();
    gather(table, ids, y, vocab, dim);
}

// dst rows at.. = the n floats of src (rows of `width`), `at` read from the device so a captured
// graph keeps writing the plane's next rows as it grows (grid-stride, a plain copy).
extern "C" __global__ void write_rows(const float* src, float* dst, long long n, const int* at,
                                      int width) {
    after_predecessor();
    float* base = dst + (long long)at[0] * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        base[i] = src[i];
}

// Elementwise activations over n floats (grid-stride; no reduction, so trivially row-exact).
extern "C" __global__ void silu_kernel(const float* x, float* y, long long n) {
    after_predecessor();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = siluf_exact(x[i]);
}

extern "C" __global__ void sigmoid_kernel(const float* x, float* y, long long n) {
    after_predecessor();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = sigmoidf_exact(x[i]);
}

// x * s and a + b over n floats: one IEEE float32 operation an element (round to nearest, no
// contraction to fuse), so the bits are numpy's and those of CuPy's own multiply / add.
extern "C" __global__ void scale_kernel(const float* x, float* y, long long n, float s) {
    after_predecessor();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = x[i] * s;
}

extern "C" __global__ void add_kernel(const float* a, const float* b, float* y, long long n) {
    after_predecessor();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = a[i] + b[i];
}

// silu(min(gate, limit)) * clip(up, -limit, limit); the comparisons let NaN through as numpy does.
extern "C" __global__ void swiglu_kernel(const float* gate, const float* up, float* y, long long n,
                                         float limit) {
    after_predecessor();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = swiglu_clamped(gate[i], up[i], limit);
    }
}
