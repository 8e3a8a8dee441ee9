// mHC (manifold-constrained hyper-connections) kernels: site weights, collapse, combine, mean.
// Exact class: every output's reduction order depends only on n and D (never on the row count
// t or the grid size), so row r of a t-row launch is bit-identical to the same row launched alone.
// Semantics: NumpyBackend.hc_weights / hc_collapse / hc_combine / stream_mean (hc_collapse_site:
// hc_weights' pre, then hc_collapse).
#include "common.cuh"

// Thread (a, b) of the n x n mixing matrix c (shared): c[a, b] /= (sum of its column + eps),
// or of its row; every thread of a column (row) adds it in ascending order, the same bits.
static __device__ void hc_normalise(float* c, int n, int a, int b, bool columns, float eps) {
    float s = 0.0f;
    if (a < n) {
        s = columns ? c[b] : c[a * n];
        for (int i = 1; i < n; ++i) s += columns ? c[i * n + b] : c[a * n + i];
    }
    __syncthreads();  // every sum is read before any entry changes
    if (a < n) c[a * n + b] = c[a * n + b] / (s + eps);
    __syncthreads();
}

// Site weights in two launches, so the (2+n)n x nD matvec spreads over many blocks instead of
// one block per row: hc_partials takes fixed chunks of HC_CHUNK flattened elements (a split
// size, never a count) and writes each chunk's (2+n)n dots with fn and its sum of squares (the
// chunk's slots; blockIdx.z takes HC_SLOTS of them, so a row's few chunks still fill the GPU);
// hc_weights adds the chunks in order, normalises (m = inv_rms * fn x) and runs the epilogue.
static_assert(HC_CHUNK == 8 * MEMRA_BLOCK, "thread i of a chunk owns its elements 8i .. 8i + 7");
#define HC_MAX_OUTS ((2 + HC_MAX_N) * HC_MAX_N)

// v = p[k0 .. k0 + 7], zeros at and past n (n = 0: a missing row); vec: 16-byte loads allowed.
static __device__ __forceinline__ void load8(const float* p, int k0, int n, bool vec, float (&v)[8]) {
    if (vec && k0 + 8 <= n) {
        const float4 a = *reinterpret_cast<const float4*>(p + k0);
        const float4 b = *reinterpret_cast<const float4*>(p + k0 + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = k0 + e < n ? p[k0 + e] : 0.0f;
}

// grid (ceil(nD / HC_CHUNK), ceil(t / ROWS), ceil(((2+n)n + 1) / HC_SLOTS)), block MEMRA_BLOCK.
// part [t, chunks, outs + 1]: slot j < outs the dot with fn row j, slot outs the sum of squares.
// A block loads its slots' fn values once for its ROWS rows (the rows' x loads issue together):
// hc_partials_r1 for one row, hc_partials_r<HC_ROWS> for more. Each slot of a row: thread i's 8
// products in order, the warp butterfly, the warps in order, whichever rows share the block.
template <int ROWS>
static __device__ void partials_rows(const float* __restrict__ streams, const float* __restrict__ fn,
                                     float* __restrict__ part, int t, int n, int d) {
    __shared__ float red[ROWS][WARPS_PER_BLOCK][HC_SLOTS];
    const int r0 = blockIdx.y * ROWS, rows = min(ROWS, t - r0);
    const int c = blockIdx.x, chunks = gridDim.x, nd = n * d, outs = (2 + n) * n;
    const int j0 = blockIdx.z * HC_SLOTS, j1 = min(j0 + HC_SLOTS, outs + 1);
    const int k0 = c * HC_CHUNK + threadIdx.x * 8, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // 8 elements a thread: two 16-byte loads where the rows allow (the same values either way)
    const bool vec = nd % 8 == 0 && reinterpret_cast<unsigned long long>(streams) % 16 == 0 &&
                     reinterpret_cast<unsigned long long>(fn) % 16 == 0;
    float xv[ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
        load8(streams + (long long)(r0 + r) * nd, k0, r < rows ? nd : 0, vec, xv[r]);
    float wv[HC_SLOTS][8];  // fn rows; the sum of squares' slot (no fn row) multiplies x by itself
    bool squares[HC_SLOTS];
#pragma unroll
    for (int q = 0; q < HC_SLOTS; ++q) {
        const int j = j0 + q;
        squares[q] = j >= outs;
        load8(fn + (long long)min(j, outs - 1) * nd, k0, squares[q] ? 0 : nd, vec, wv[q]);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (r >= rows) break;  // uniform
#pragma unroll
        for (int q = 0; q < HC_SLOTS; ++q) {
            if (j0 + q >= j1) break;  // uniform
            float acc = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc += (squares[q] ? xv[r][e] : wv[q][e]) * xv[r][e];
            acc = warp_xor_sum(acc);
            if (lane == 0) red[r][warp][q] = acc;
        }
    }
    __syncthreads();
    const int slots = j1 - j0;
    for (int i = threadIdx.x; i < rows * slots; i += MEMRA_BLOCK) {
        const int r = i / slots, q = i % slots;
        float sum = red[r][0][q];
        for (int v = 1; v < WARPS_PER_BLOCK; ++v) sum += red[r][v][q];
        part[((long long)(r0 + r) * chunks + c) * (outs + 1) + j0 + q] = sum;
    }
}

#define HC_PARTIALS(ROWS)                                                                          \
    extern "C" __global__ void hc_partials_r##ROWS(const float* __restrict__ streams,              \
                                                   const float* __restrict__ fn,                   \
                                                   float* __restrict__ part, int t, int n, int d) { \
        after_predecessor();                                                                       \
        partials_rows<ROWS>(streams, fn, part, t, n, d);                                           \
    }
HC_PARTIALS(1)
HC_PARTIALS(4)
static_assert(HC_ROWS == 4, "the host launches hc_partials_r1 or hc_partials_r<HC_ROWS>");

// Slot j of a row's partials p [chunks, outs + 1], its chunks added in order.
static __device__ __forceinline__ float hc_slot_sum(const float* p, int j, int chunks, int outs) {
    float sum = p[j];
    for (int k = 1; k < chunks; ++k) sum += p[(long long)k * (outs + 1) + j];
    return sum;
}

// 1 / rms of the row's nD flattened elements, from their sum of squares.
static __device__ __forceinline__ float hc_inv_rms(float sum_squares, int n, int d, float rms_eps) {
    return 1.0f / sqrtf(sum_squares / (float)(n * d) + rms_eps);
}

// pre weight i of a row, from its normalised dot m_i (hc_weights and hc_collapse_site alike).
static __device__ __forceinline__ float hc_pre(float m_i, float inv, const float* scale, const float* base,
                                               int i, float hc_eps) {
    return sigmoidf_stable(m_i * inv * scale[0] + base[i]) + hc_eps;
}

// grid (t), block HC_MAX_N^2: thread (a, b) = (tid / n, tid % n). base [(2+n)n]; scale [3].
// Outputs pre [t, n], post [t, n], comb [t, n, n], in the reference's operation order.
extern "C" __global__ void hc_weights(const float* __restrict__ part, const float* __restrict__ base,
                                      const float* __restrict__ scale, float* __restrict__ pre,
                                      float* __restrict__ post, float* __restrict__ comb, int n,
                                      int d, int chunks, float rms_eps, float hc_eps, int iters) {
    after_predecessor();
    __shared__ float m[HC_MAX_OUTS + 1];
    __shared__ float c[HC_MAX_N * HC_MAX_N];
    const int r = blockIdx.x, outs = (2 + n) * n, a = threadIdx.x / n, b = threadIdx.x % n;
    const float* p = part + (long long)r * chunks * (outs + 1);
    for (int j = threadIdx.x; j <= outs; j += blockDim.x) m[j] = hc_slot_sum(p, j, chunks, outs);
    __syncthreads();
    const float inv = hc_inv_rms(m[outs], n, d, rms_eps);
    if (threadIdx.x < n) {
        const int i = threadIdx.x;
        pre[r * n + i] = hc_pre(m[i], inv, scale, base, i, hc_eps);
        post[r * n + i] = 2.0f * sigmoidf_stable(m[n + i] * inv * scale[1] + base[n + i]);
    }
    // c = row softmax of the logits + eps: each thread of row a walks the row in order
    if (a < n) {
        const float* mc = m + 2 * n + a * n;
        const float* bc = base + 2 * n + a * n;
        float mx = __int_as_float(0xff800000);  // -inf (no host math.h under NVRTC)
        for (int i = 0; i < n; ++i) mx = fmaxf(mx, mc[i] * inv * scale[2] + bc[i]);
        float s = 0.0f;
        for (int i = 0; i < n; ++i) s += expf(mc[i] * inv * scale[2] + bc[i] - mx);
        c[a * n + b] = expf(mc[b] * inv * scale[2] + bc[b] - mx) / s + hc_eps;
    }
    __syncthreads();
    hc_normalise(c, n, a, b, true, hc_eps);
    for (int it = 1; it < iters; ++it) {
        hc_normalise(c, n, a, b, false, hc_eps);
        hc_normalise(c, n, a, b, true, hc_eps);
    }
    if (a < n) comb[(long long)r * n * n + a * n + b] = c[a * n + b];
}

// The per-channel kernels below: grid runtime.columns_grid(t, D), for_column_rows's layout
// (common.cuh): thread k of a row, rows blockIdx.y, + gridDim.y, ...

// out[r, k] = sum_i pre[r, i] X[r, i, k], streams accumulated 0..n-1.
extern "C" __global__ void hc_collapse(const float* __restrict__ streams, const float* __restrict__ pre,
                                       float* __restrict__ out, int t, int n, int d) {
    after_predecessor();
    for_column_rows(t, d, [&](long long r, int k) {
        const float* x = streams + r * n * d + k;
        float acc = pre[r * n] * x[0];
        for (int i = 1; i < n; ++i) acc = acc + pre[r * n + i] * x[(long long)i * d];
        out[r * d + k] = acc;
    });
}

// Channels k .. k + W - 1 of every stream of row r: xs[i][e] = X[r, i, k + e], zeros past n
// (W = HC_VECTOR: 16-byte loads; the host checks d and the pointers).
template <int W>
static __device__ __forceinline__ void load_streams(const float* streams, long long r, int k, int n, int d,
                                                    float (&xs)[HC_MAX_N][W]) {
#pragma unroll
    for (int i = 0; i < HC_MAX_N; ++i) {
        if (i < n) {
            load_values<W>(streams + (r * n + i) * d + k, xs[i]);
        } else {
#pragma unroll
            for (int e = 0; e < W; ++e) xs[i][e] = 0.0f;
        }
    }
}

// hc_collapse with the pre weights made from hc_weights' partials part [t, chunks, outs + 1]
// (the same bits as hc_weights' pre): the site's collapse need not wait for its Sinkhorn mix,
// which runs beside the block (HyperOps.hc_site). Grid runtime.columns_grid(t, D / W): thread
// k / W of a row makes channels k .. k + W - 1, each the sum of pre_i X_i in stream order.
template <int W>
static __device__ void collapse_site(const float* __restrict__ streams, const float* __restrict__ part,
                                     const float* __restrict__ base, const float* __restrict__ scale,
                                     float* __restrict__ out, int t, int n, int d, int chunks,
                                     float rms_eps, float hc_eps) {
    __shared__ float pre[HC_MAX_N];
    const int k = (blockIdx.x * blockDim.x + threadIdx.x) * W, outs = (2 + n) * n;
    for (long long r = blockIdx.y; r < t; r += gridDim.y) {  // uniform across the block
        float xs[HC_MAX_N][W];  // loaded first: their latency overlaps the pre weights' loads
        if (k < d) load_streams<W>(streams, r, k, n, d, xs);
        const float* p = part + r * chunks * (outs + 1);
        if (threadIdx.x < n) {
            const float inv = hc_inv_rms(hc_slot_sum(p, outs, chunks, outs), n, d, rms_eps);
            pre[threadIdx.x] = hc_pre(hc_slot_sum(p, threadIdx.x, chunks, outs), inv, scale, base, threadIdx.x, hc_eps);
        }
        __syncthreads();
        if (k < d) {
            float acc[W];
#pragma unroll
            for (int e = 0; e < W; ++e) {
                acc[e] = pre[0] * xs[0][e];
#pragma unroll
                for (int i = 1; i < HC_MAX_N; ++i)
                    if (i < n) acc[e] = acc[e] + pre[i] * xs[i][e];
            }
            store_values<W>(out + r * d + k, acc);
        }
        __syncthreads();  // every thread has read pre before the next row's
    }
}

// width 1, or HC_VECTOR for a prompt's rows (prime.prompt_width): the same sums per channel.
extern "C" __global__ void hc_collapse_site(const float* __restrict__ streams, const float* __restrict__ part,
                                            const float* __restrict__ base, const float* __restrict__ scale,
                                            float* __restrict__ out, int t, int n, int d, int chunks,
                                            float rms_eps, float hc_eps, int width) {
    after_predecessor();
    if (width == HC_VECTOR)
        collapse_site<HC_VECTOR>(streams, part, base, scale, out, t, n, d, chunks, rms_eps, hc_eps);
    else
        collapse_site<1>(streams, part, base, scale, out, t, n, d, chunks, rms_eps, hc_eps);
}

// X'[r, b, k] = post[r, b] f[r, k] + sum_a C[r, a, b] X[r, a, k] (C transposed), a ascending.
// A thread makes W channels of all n output streams from one read of its n inputs; width 1, or
// HC_VECTOR for a prompt's rows (grid columns_grid(t, D / width)).
template <int W>
static __device__ __forceinline__ void combine_channels(const float* streams, const float* f, const float* post,
                                                        const float* comb, float* out, long long r, int k,
                                                        int n, int d) {
    float xs[HC_MAX_N][W], fk[W];
    load_streams<W>(streams, r, k, n, d, xs);
    load_values<W>(f + r * d + k, fk);
    for (int b = 0; b < n; ++b) {
        const float* c = comb + r * n * n + b;
        const float pb = post[r * n + b];
        float y[W];
#pragma unroll
        for (int e = 0; e < W; ++e) {
            float acc = c[0] * xs[0][e];
#pragma unroll
            for (int a = 1; a < HC_MAX_N; ++a)
                if (a < n) acc = acc + c[a * n] * xs[a][e];
            y[e] = pb * fk[e] + acc;
        }
        store_values<W>(out + (r * n + b) * d + k, y);
    }
}

extern "C" __global__ void hc_combine(const float* __restrict__ streams, const float* __restrict__ f,
                                      const float* __restrict__ post, const float* __restrict__ comb,
                                      float* __restrict__ out, int t, int n, int d, int width) {
    after_predecessor();
    if (width == HC_VECTOR)
        for_column_rows(t, d / HC_VECTOR, [&](long long r, int col) {
            combine_channels<HC_VECTOR>(streams, f, post, comb, out, r, col * HC_VECTOR, n, d);
        });
    else
        for_column_rows(t, d, [&](long long r, int k) { combine_channels<1>(streams, f, post, comb, out, r, k, n, d); });
}

// Unweighted stream mean: sum in stream order, then one division by n (as the reference).
extern "C" __global__ void stream_mean(const float* __restrict__ streams, float* __restrict__ out,
                                       int t, int n, int d) {
    after_predecessor();
    for_column_rows(t, d, [&](long long r, int k) {
        const float* x = streams + r * n * d + k;
        float acc = x[0];
        for (int i = 1; i < n; ++i) acc = acc + x[(long long)i * d];
        out[r * d + k] = acc / (float)n;
    });
}
