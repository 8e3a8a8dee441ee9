// Norm family: per-row reductions over the last axis (RMSNorm, LayerNorm, L2 norm, KDA's gated
// RMSNorm, softmax, argmax). One block of MEMRA_BLOCK threads owns one row: thread i folds
// elements i, i+MEMRA_BLOCK, ... in increasing order, then common.cuh's fixed tree combines the
// partials. The order depends only on the row length, never on how many rows the launch holds,
// so row r of a t-row call is bit-identical to the row computed alone.
// grid (rows), block MEMRA_BLOCK for every kernel here, except that the sum-of-squares norms
// take per_warp = 1 for a prompt's short rows: grid (ceil(rows / WARPS_PER_BLOCK)), a warp per
// row, the same order played by one warp (warp_sum_squares), so the same bits from 8x fewer blocks.
#include "common.cuh"

static __device__ __forceinline__ const float* row_in(const float* a, int n) {
    return a + (long long)blockIdx.x * n;
}

static __device__ __forceinline__ float* row_out(float* a, int n) {
    return a + (long long)blockIdx.x * n;
}

// The row a sum-of-squares kernel's thread works on: its block's (WARP false), or its warp's
// (-1 past the last row). Its threads walk the row from `first` in steps of STEP.
template <bool WARP>
struct NormRow {
    static constexpr int STEP = WARP ? 32 : MEMRA_BLOCK;
    long long row;
    int first;

    __device__ __forceinline__ explicit NormRow(int rows) {
        const long long r = WARP ? (long long)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32 : blockIdx.x;
        row = r < rows ? r : -1;
        first = WARP ? threadIdx.x % 32 : threadIdx.x;
    }
};

// Elements a thread loads before it uses them: a row of a decode step is one block, so a
// load round trip per element would bound it; 16 covers a 4096-wide row in one round.
constexpr int ROW_BATCH = 16;

static __device__ float row_sum_squares(const float* __restrict__ x, int n, float* shm) {
    float s = 0.0f;
    for (int k0 = threadIdx.x; k0 < n; k0 += ROW_BATCH * MEMRA_BLOCK) {
        float v[ROW_BATCH];
#pragma unroll
        for (int b = 0; b < ROW_BATCH; ++b) v[b] = k0 + b * MEMRA_BLOCK < n ? x[k0 + b * MEMRA_BLOCK] : 0.0f;
#pragma unroll
        for (int b = 0; b < ROW_BATCH; ++b)
            if (k0 + b * MEMRA_BLOCK < n) s = s + v[b] * v[b];
    }
    return block_sum(s, shm);
}

// block_sum's tree over a warp's played threads: steps of stride MEMRA_BLOCK / 2 .. 32 pair a
// lane's own partials v[j] (thread lane + 32 j), the last five pair lanes (shfl_down hands lane l
// the partial of l + o, as the tree's shm[l + o]). Every lane gets the total.
static __device__ __forceinline__ float warp_tree(float (&v)[WARPS_PER_BLOCK]) {
#pragma unroll
    for (int s = WARPS_PER_BLOCK / 2; s > 0; s >>= 1)
#pragma unroll
        for (int j = 0; j < s; ++j) v[j] = v[j] + v[j + s];
    for (int o = 16; o > 0; o >>= 1) v[0] = v[0] + __shfl_down_sync(0xffffffffu, v[0], o);
    return __shfl_sync(0xffffffffu, v[0], 0);
}

// row_sum_squares of a row by one warp, the same bits: lane l plays threads l + 32j (j <
// WARPS_PER_BLOCK), each folding its elements in order, then warp_tree. Rows up to NORM_WARP_ROW.
static __device__ float warp_sum_squares(const float* __restrict__ x, int n) {
    const int lane = threadIdx.x % 32;
    float v[WARPS_PER_BLOCK];
#pragma unroll
    for (int j = 0; j < WARPS_PER_BLOCK; ++j) {
        float s = 0.0f;
#pragma unroll
        for (int b = 0; b < NORM_WARP_ROW / MEMRA_BLOCK; ++b) {
            const int k = lane + 32 * j + b * MEMRA_BLOCK;
            if (k < n) s = s + x[k] * x[k];
        }
        v[j] = s;
    }
    return warp_tree(v);
}

// A prompt's short rows (n <= SHORT_ROW: a KDA head) by a warp: lane l's elements l + 32j load
// once, before the sum (with whatever else the output reads), and stay in registers for the
// output: the reload of the row after its sum left these norms at ~40% of the copy bandwidth.
// The same sums as warp_sum_squares (one element a played thread).
constexpr int SHORT_ROW = 32 * WARPS_PER_BLOCK;

struct ShortRow {
    float v[WARPS_PER_BLOCK];  // v[j]: element lane + 32 j, 0 past n
    int lane, n;

    __device__ __forceinline__ ShortRow(const float* __restrict__ x, int n_) : lane(threadIdx.x % 32), n(n_) {
#pragma unroll
        for (int j = 0; j < WARPS_PER_BLOCK; ++j) v[j] = at(j) ? x[lane + 32 * j] : 0.0f;
    }
    __device__ __forceinline__ bool at(int j) const { return lane + 32 * j < n; }

    __device__ __forceinline__ float sum_squares() const {
        float s[WARPS_PER_BLOCK];
#pragma unroll
        for (int j = 0; j < WARPS_PER_BLOCK; ++j) s[j] = at(j) ? 0.0f + v[j] * v[j] : 0.0f;
        return warp_tree(s);
    }
};

// The row's sum of squares, by its block or its warp.
template <bool WARP>
static __device__ __forceinline__ float sum_squares(const float* x, int n, float* shm) {
    return WARP ? warp_sum_squares(x, n) : row_sum_squares(x, n, shm);
}

// 1 / sqrt(mean(x^2) + eps) from the row's sum of squares, as numpy_ref's _rmsnorm_row computes it.
static __device__ __forceinline__ float inv_rms(float sum_squares, int n, float eps) {
    return 1.0f / sqrtf(sum_squares / (float)n + eps);
}

template <bool WARP>
static __device__ float rms_scale(const float* x, int n, float eps, float* shm) {
    return inv_rms(sum_squares<WARP>(x, n, shm), n, eps);
}

// w may be null (unweighted RMSNorm).
template <bool WARP>
static __device__ void rmsnorm_row(const float* __restrict__ x, const float* __restrict__ w,
                                   float* __restrict__ y, int n, float eps, int rows, float* shm) {
    constexpr int STEP = NormRow<WARP>::STEP;
    const NormRow<WARP> at(rows);
    if (at.row < 0) return;  // a warp past the last row (a warp's row has no block-wide sync)
    const float* xr = x + at.row * n;
    float* yr = y + at.row * n;
    const float inv = rms_scale<WARP>(xr, n, eps, shm);
    for (int k0 = at.first; k0 < n; k0 += ROW_BATCH * STEP) {
        float xv[ROW_BATCH], wv[ROW_BATCH];
#pragma unroll
        for (int b = 0; b < ROW_BATCH; ++b) {
            const int k = k0 + b * STEP;
            xv[b] = k < n ? xr[k] : 0.0f;
            wv[b] = k < n && w ? w[k] : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < ROW_BATCH; ++b) {
            const int k = k0 + b * STEP;
            const float v = xv[b] * inv;
            if (k < n) yr[k] = w ? v * wv[b] : v;
        }
    }
}

// rmsnorm(o) * w * sigmoid(gate): KDA's output norm.
template <bool WARP>
static __device__ void gated_rmsnorm_row(const float* __restrict__ o, const float* __restrict__ gate,
                                         const float* __restrict__ w, float* __restrict__ y, int n, float eps,
                                         int rows, float* shm) {
    const NormRow<WARP> at(rows);
    if (at.row < 0) return;
    const float* orow = o + at.row * n;
    const float* grow = gate + at.row * n;
    float* yr = y + at.row * n;
    if (WARP && n <= SHORT_ROW) {
        const ShortRow x(orow, n);
        float g[WARPS_PER_BLOCK], wv[WARPS_PER_BLOCK];
#pragma unroll
        for (int j = 0; j < WARPS_PER_BLOCK; ++j) {
            g[j] = x.at(j) ? grow[x.lane + 32 * j] : 0.0f;
            wv[j] = x.at(j) ? w[x.lane + 32 * j] : 0.0f;
        }
        const float inv = inv_rms(x.sum_squares(), n, eps);
#pragma unroll
        for (int j = 0; j < WARPS_PER_BLOCK; ++j)
            if (x.at(j)) yr[x.lane + 32 * j] = ((x.v[j] * inv) * wv[j]) * sigmoidf_exact(g[j]);
        return;
    }
    const float inv = rms_scale<WARP>(orow, n, eps, shm);
#pragma unroll 4
    for (int k = at.first; k < n; k += NormRow<WARP>::STEP)
        yr[k] = ((orow[k] * inv) * w[k]) * sigmoidf_exact(grow[k]);
}

// x / sqrt(sum(x^2) + eps) (fla's convention: eps inside the sqrt), times scale (KDA's q).
template <bool WARP>
static __device__ void l2norm_row(const float* __restrict__ x, float* __restrict__ y, int n, float eps, float scale,
                                  int rows, float* shm) {
    const NormRow<WARP> at(rows);
    if (at.row < 0) return;
    const float* xr = x + at.row * n;
    float* yr = y + at.row * n;
    if (WARP && n <= SHORT_ROW) {
        const ShortRow row(xr, n);
        const float den = sqrtf(row.sum_squares() + eps);
#pragma unroll
        for (int j = 0; j < WARPS_PER_BLOCK; ++j)
            if (row.at(j)) yr[row.lane + 32 * j] = (row.v[j] / den) * scale;
        return;
    }
    const float den = sqrtf(sum_squares<WARP>(xr, n, shm) + eps);
    for (int k = at.first; k < n; k += NormRow<WARP>::STEP) yr[k] = (xr[k] / den) * scale;
}

extern "C" __global__ void rmsnorm_rows(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ y, int n, float eps, int rows, int per_warp) {
    after_predecessor();
    __shared__ float shm[MEMRA_BLOCK];
    if (per_warp) rmsnorm_row<true>(x, w, y, n, eps, rows, shm);
    else rmsnorm_row<false>(x, w, y, n, eps, rows, shm);
}

extern "C" __global__ void gated_rmsnorm_rows(const float* __restrict__ o, const float* __restrict__ gate,
                                              const float* __restrict__ w, float* __restrict__ y,
                                              int n, float eps, int rows, int per_warp) {
    after_predecessor();
    __shared__ float shm[MEMRA_BLOCK];
    if (per_warp) gated_rmsnorm_row<true>(o, gate, w, y, n, eps, rows, shm);
    else gated_rmsnorm_row<false>(o, gate, w, y, n, eps, rows, shm);
}

extern "C" __global__ void l2norm_rows(const float* x, float* y, int n, float eps, float scale, int rows,
                                       int per_warp) {
    after_predecessor();
    __shared__ float shm[MEMRA_BLOCK];
    if (per_warp) l2norm_row<true>(x, y, n, eps, scale, rows, shm);
    else l2norm_row<false>(x, y, n, eps, scale, rows, shm);
}

// (x - mean) / sqrt(var + eps) * w + b, the variance taken about the mean (two passes).
extern "C" __global__ void layernorm_rows(const float* x, const float* w, const float* b,
                                          float* y, int n, float eps) {
    after_predecessor();
    __shared__ float shm[MEMRA_BLOCK];
    const float* xr = row_in(x, n);
    float* yr = row_out(y, n);
    float s = 0.0f;
    for (int k = threadIdx.x; k < n; k += MEMRA_BLOCK) s = s + xr[k];
    const float mu = block_sum(s, shm) / (float)n;
    float ss = 0.0f;
    for (int k = threadIdx.x; k < n; k += MEMRA_BLOCK) {
        const float d = xr[k] - mu;
        ss = ss + d * d;
    }
    const float den = sqrtf(block_sum(ss, shm) / (float)n + eps);
    for (int k = threadIdx.x; k < n; k += MEMRA_BLOCK) yr[k] = (xr[k] - mu) / den * w[k] + b[k];
}

// exp(x - max) / sum(exp(x - max)); the exponentials are recomputed (same inputs, same bits).
// The row's max and sum(exp(x - max)), both in the fixed per-thread-stride + tree order.
static __device__ void row_max_and_expsum(const float* xr, int n, float* shm, float* m_out, float* s_out) {
    float m = __int_as_float(0xff800000);  // -inf
    for (int k = threadIdx.x; k < n; k += MEMRA_BLOCK) m = fmaxf(m, xr[k]);
    m = block_max(m, shm);
    float s = 0.0f;
    for (int k = threadIdx.x; k < n; k += MEMRA_BLOCK) s = s + expf(xr[k] - m);
    *m_out = m;
    *s_out = block_sum(s, shm);
}

extern "C" __global__ void softmax_rows(const float* x, float* y, int n) {
    after_predecessor();
    __shared__ float shm[MEMRA_BLOCK];
    const float* xr = row_in(x, n);
    float* yr = row_out(y, n);
    float m, s;
    row_max_and_expsum(xr, n, shm, &m, &s);
    for (int k = threadIdx.x; k < n; k += MEMRA_BLOCK) yr[k] = expf(xr[k] - m) / s;
}

extern "C" __global__ void log_softmax_rows(const float* x, float* y, int n) {
    after_predecessor();
    __shared__ float shm[MEMRA_BLOCK];
    const float* xr = row_in(x, n);
    float* yr = row_out(y, n);
    float m, s;
    row_max_and_expsum(xr, n, shm, &m, &s);
    const float lse = logf(s);
    for (int k = threadIdx.x; k < n; k += MEMRA_BLOCK) yr[k] = (xr[k] - m) - lse;
}

// numpy's argmax order: NaN beats every number (the first NaN wins), otherwise the larger value,
// and among equal values the lower index. A total order, so the answer is order-independent.
static __device__ __forceinline__ bool beats(float b, int ib, float a, int ia) {
    if (a != a) return b != b && ib < ia;  // a is NaN
    if (b != b) return true;
    return b > a || (b == a && ib < ia);
}

// A row's argmax in two launches, so a vocab-long row spreads over blocks: argmax_parts takes
// grid (rows, parts), block y folding elements [y * span, (y + 1) * span) of its row into
// (vals, idxs) [rows, parts]; argmax_rows (grid rows) picks the best part. beats is a total
// order, so the split never changes the answer. With sums (else null) each part also writes
// the sum of exp(x - its best) over its elements (0 for a part of -inf alone), and argmax_rows
// the softmax probability of the winner, 1 / sum_p sums_p exp(best_p - best), parts in order:
// a greedy draft's confidence without a vocab-long probability row.
extern "C" __global__ void argmax_parts(const float* x, float* vals, int* idxs, float* sums, int n, int span) {
    after_predecessor();
    __shared__ float sv[MEMRA_BLOCK];
    __shared__ int si[MEMRA_BLOCK];
    const float* xr = row_in(x, n);
    const int begin = blockIdx.y * span, end = min(n, begin + span);
    const long long slot = (long long)blockIdx.x * gridDim.y + blockIdx.y;
    float best = __int_as_float(0xff800000);  // -inf
    int at = 0x7fffffff;  // sentinel: loses every tie against a real index
    for (int k = begin + threadIdx.x; k < end; k += MEMRA_BLOCK)
        if (beats(xr[k], k, best, at)) { best = xr[k]; at = k; }
    block_best(best, at, sv, si, beats);
    if (threadIdx.x == 0) {
        vals[slot] = best;
        idxs[slot] = at;
    }
    if (sums == nullptr) return;  // uniform
    float s = 0.0f;
    for (int k = begin + threadIdx.x; k < end; k += MEMRA_BLOCK) s = s + expf(xr[k] - best);
    s = block_sum(s, sv);
    if (threadIdx.x == 0) sums[slot] = best == __int_as_float(0xff800000) ? 0.0f : s;
}

extern "C" __global__ void argmax_rows(const float* vals, const int* idxs, const float* sums,
                                        long long* out, float* prob, int parts) {
    after_predecessor();
    __shared__ float sv[MEMRA_BLOCK];
    __shared__ int si[MEMRA_BLOCK];
    float best = __int_as_float(0xff800000);
    int at = 0x7fffffff;
    for (int k = threadIdx.x; k < parts; k += MEMRA_BLOCK) {
        const long long e = (long long)blockIdx.x * parts + k;
        if (beats(vals[e], idxs[e], best, at)) { best = vals[e]; at = idxs[e]; }
    }
    block_best(best, at, sv, si, beats);
    if (threadIdx.x != 0) return;
    out[blockIdx.x] = at;
    if (sums == nullptr) return;
    const float ninf = __int_as_float(0xff800000);
    float s = 0.0f;
    for (int k = 0; k < parts; ++k) {
        const long long e = (long long)blockIdx.x * parts + k;
        if (vals[e] != ninf) s = s + sums[e] * expf(vals[e] - best);
    }
    // a row of -inf alone has no softmax (numpy: 0 / 0); NaN and +inf rows come out NaN above
    prob[blockIdx.x] = best == ninf ? __int_as_float(0x7fc00000) : 1.0f / s;
}

// A row's k first entries in beats' order (NaN first, then larger values, ties to the lower
// index), in that order, over two launches as argmax: top_k_parts (grid (rows, parts)) writes
// each ARGMAX_SPAN part's k first to (vals, idxs) [rows, parts, k], top_k_rows (grid rows) the
// row's k first among them. Pick j is the best entry that ranks after pick j - 1: beats is a
// strict total order, so no entry is marked and the split never changes the answer. A part with
// fewer than k entries pads with (-inf, INT_MAX), which no entry ranks after and every entry beats.
// Candidates v [count] with ids (or, ids null, first + e); outputs as 32- or 64-bit ids.
static __device__ void top_k_pass(const float* v, const int* ids, int first, int count, int k,
                                  float* out_v, int* out_i, long long* out_l, float* sv, int* si) {
    float pv = 0.0f;
    int pi = 0;
    for (int j = 0; j < k; ++j) {
        float best = __int_as_float(0xff800000);
        int bi = 0x7fffffff;
        for (int e = threadIdx.x; e < count; e += MEMRA_BLOCK) {
            const float x = v[e];
            const int i = ids == nullptr ? first + e : ids[e];
            if ((j == 0 || beats(pv, pi, x, i)) && beats(x, i, best, bi)) { best = x; bi = i; }
        }
        block_best(best, bi, sv, si, beats);
        if (threadIdx.x == 0) {
            if (out_v != nullptr) out_v[j] = best;
            if (out_i != nullptr) out_i[j] = bi;
            if (out_l != nullptr) out_l[j] = bi;
        }
        pv = best;
        pi = bi;
    }
}

extern "C" __global__ void top_k_parts(const float* x, float* vals, int* idxs, int n, int span, int k) {
    after_predecessor();
    __shared__ float sv[MEMRA_BLOCK];
    __shared__ int si[MEMRA_BLOCK];
    const int begin = blockIdx.y * span, count = min(n, begin + span) - begin;
    const long long slot = ((long long)blockIdx.x * gridDim.y + blockIdx.y) * k;
    top_k_pass(row_in(x, n) + begin, nullptr, begin, count, k, vals + slot, idxs + slot, nullptr, sv, si);
}

extern "C" __global__ void top_k_rows(const float* vals, const int* idxs, float* out_v, long long* out_i,
                                      int candidates, int k) {
    after_predecessor();
    __shared__ float sv[MEMRA_BLOCK];
    __shared__ int si[MEMRA_BLOCK];
    const long long row = (long long)blockIdx.x * candidates, out = (long long)blockIdx.x * k;
    top_k_pass(vals + row, idxs + row, 0, candidates, k, out_v + out, nullptr, out_i + out, sv, si);
}
