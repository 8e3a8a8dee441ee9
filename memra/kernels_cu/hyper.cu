// mHC (manifold-constrained hyper-connections) kernels: site weights, collapse, combine, mean.
// Exact class: every output's reduction order depends only on n and D (never on the row count
// t or the grid size), so row r of a t-row launch is bit-identical to the same row launched alone.
// Semantics: NumpyBackend.hc_weights / hc_collapse / hc_combine / stream_mean.
#include "common.cuh"

// Fixed xor-butterfly over the 32 lanes. Each step adds a commutative pair, so every lane ends
// with the same bits; callers still take lane 0's value.
static __device__ __forceinline__ float hc_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// hc_weights runs in one warp: lane l owns entries e = l + 32q (q < HC_ENTRIES) of the n x n
// mix, held in registers; the 2 x iters Sinkhorn normalisations read other entries by shuffle.
#define HC_ENTRIES ((HC_MAX_N * HC_MAX_N + 31) / 32)

static_assert(HC_MAX_N == 8, "hc_weights' switch names every n up to HC_MAX_N");

// Entry idx of the mix, held by lane idx % 32 in register idx / 32 < Q (every lane shuffles).
template <int Q>
static __device__ __forceinline__ float hc_entry(const float (&c)[HC_ENTRIES], int idx) {
    float v = __shfl_sync(0xffffffffu, c[0], idx & 31);
#pragma unroll
    for (int q = 1; q < Q; ++q) {
        const float u = __shfl_sync(0xffffffffu, c[q], idx & 31);
        if (idx >= 32 * q) v = u;
    }
    return v;
}

// c[e] /= (the sum of e's column + eps), or of its row, for the lane's entries (a[q], b[q]) of
// the N x N mix; every entry of a column (row) adds it in ascending order, the same bits.
// N is a compile-time size, so a lane's N shuffles issue before the first add waits on them.
template <int N, bool COLUMNS>
static __device__ __forceinline__ void hc_normalise(float (&c)[HC_ENTRIES], const int (&a)[HC_ENTRIES],
                                                    const int (&b)[HC_ENTRIES], float eps) {
    constexpr int Q = (N * N + 31) / 32;  // the registers that hold entries at this size
    float s[Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) {
        s[q] = hc_entry<Q>(c, COLUMNS ? b[q] : a[q] * N);
#pragma unroll
        for (int i = 1; i < N; ++i) s[q] += hc_entry<Q>(c, COLUMNS ? i * N + b[q] : a[q] * N + i);
    }
#pragma unroll
    for (int q = 0; q < Q; ++q) c[q] = c[q] / (s[q] + eps);
}

// Sinkhorn: columns, then iters - 1 rounds of rows and columns (the reference's order).
template <int N>
static __device__ void hc_sinkhorn(float (&c)[HC_ENTRIES], const int (&a)[HC_ENTRIES], const int (&b)[HC_ENTRIES],
                                   float eps, int iters) {
    hc_normalise<N, true>(c, a, b, eps);
    for (int it = 1; it < iters; ++it) {
        hc_normalise<N, false>(c, a, b, eps);
        hc_normalise<N, true>(c, a, b, eps);
    }
}

// Site weights in two launches, so the (2+n)n x nD matvec spreads over many blocks instead of
// one block per row: hc_partials takes fixed chunks of HC_CHUNK flattened elements (a split
// size, never a count) and writes each chunk's (2+n)n dots with fn and its sum of squares (the
// chunk's slots; blockIdx.z takes HC_SLOTS of them, so a row's few chunks still fill the GPU);
// hc_weights adds the chunks in order, normalises (m = inv_rms * fn x) and runs the epilogue.
static_assert(HC_CHUNK == 8 * MEMRA_BLOCK, "thread i of a chunk owns its elements 8i .. 8i + 7");
#define HC_MAX_OUTS ((2 + HC_MAX_N) * HC_MAX_N)

// grid (ceil(nD / HC_CHUNK), t, ceil(((2+n)n + 1) / HC_SLOTS)), block MEMRA_BLOCK.
// part [t, chunks, outs + 1]: slot j < outs the dot with fn row j, slot outs the sum of squares.
// Each slot: thread i's 8 products in order, the warp butterfly, the warps in order.
extern "C" __global__ void hc_partials(const float* __restrict__ streams, const float* __restrict__ fn,
                                       float* __restrict__ part, int n, int d) {
    __shared__ float red[WARPS_PER_BLOCK][HC_SLOTS];
    const int r = blockIdx.y, c = blockIdx.x, chunks = gridDim.x, nd = n * d, outs = (2 + n) * n;
    const int j0 = blockIdx.z * HC_SLOTS, j1 = min(j0 + HC_SLOTS, outs + 1);
    const int k0 = c * HC_CHUNK + threadIdx.x * 8, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float* x = streams + (long long)r * nd;
    float xv[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) xv[e] = k0 + e < nd ? x[k0 + e] : 0.0f;
    float wv[HC_SLOTS][8];  // every slot's fn values load before the first sum waits on them
#pragma unroll
    for (int q = 0; q < HC_SLOTS; ++q) {
        const int j = j0 + q;
        const float* w = j < outs ? fn + (long long)j * nd : nullptr;
#pragma unroll
        for (int e = 0; e < 8; ++e) wv[q][e] = k0 + e < nd ? (w != nullptr ? w[k0 + e] : xv[e]) : 0.0f;
    }
#pragma unroll
    for (int q = 0; q < HC_SLOTS; ++q) {
        if (j0 + q >= j1) break;  // uniform
        float acc = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc += wv[q][e] * xv[e];
        acc = hc_warp_sum(acc);
        if (lane == 0) red[warp][q] = acc;
    }
    __syncthreads();
    for (int j = j0 + threadIdx.x; j < j1; j += MEMRA_BLOCK) {
        float sum = red[0][j - j0];
        for (int v = 1; v < WARPS_PER_BLOCK; ++v) sum += red[v][j - j0];
        part[((long long)r * chunks + c) * (outs + 1) + j] = sum;
    }
}

// grid (t), block 32: lane l owns entries (a, b) = (e / n, e % n), e = l + 32q. base [(2+n)n];
// scale [3]. Outputs pre [t, n], post [t, n], comb [t, n, n], in the reference's operation order.
extern "C" __global__ void hc_weights(const float* __restrict__ part, const float* __restrict__ base,
                                      const float* __restrict__ scale, float* __restrict__ pre,
                                      float* __restrict__ post, float* __restrict__ comb, int n,
                                      int d, int chunks, float rms_eps, float hc_eps, int iters) {
    __shared__ float m[HC_MAX_OUTS + 1];
    float c[HC_ENTRIES];  // the lane's entries of the mix
    const int r = blockIdx.x, outs = (2 + n) * n, lane = threadIdx.x;
    int a[HC_ENTRIES], b[HC_ENTRIES];  // a = n past the mix: no entry
#pragma unroll
    for (int q = 0; q < HC_ENTRIES; ++q) {
        const int e = lane + 32 * q;
        a[q] = e < n * n ? e / n : n;
        b[q] = e % n;
    }
    const float* p = part + (long long)r * chunks * (outs + 1);
    for (int j = lane; j <= outs; j += 32) {
        float sum = p[j];
        for (int k = 1; k < chunks; ++k) sum += p[(long long)k * (outs + 1) + j];
        m[j] = sum;
    }
    __syncwarp();
    const float inv = 1.0f / sqrtf(m[outs] / (float)(n * d) + rms_eps);
    if (lane < n) {
        pre[r * n + lane] = sigmoidf_stable(m[lane] * inv * scale[0] + base[lane]) + hc_eps;
        post[r * n + lane] = 2.0f * sigmoidf_stable(m[n + lane] * inv * scale[1] + base[n + lane]);
    }
    // c = row softmax of the logits + eps: each entry of row a walks the row in order
#pragma unroll
    for (int q = 0; q < HC_ENTRIES; ++q) {
        c[q] = 0.0f;
        if (a[q] >= n) continue;
        const float* mc = m + 2 * n + a[q] * n;
        const float* bc = base + 2 * n + a[q] * n;
        float mx = __int_as_float(0xff800000);  // -inf (no host math.h under NVRTC)
        for (int i = 0; i < n; ++i) mx = fmaxf(mx, mc[i] * inv * scale[2] + bc[i]);
        float s = 0.0f;
        for (int i = 0; i < n; ++i) s += expf(mc[i] * inv * scale[2] + bc[i] - mx);
        c[q] = expf(mc[b[q]] * inv * scale[2] + bc[b[q]] - mx) / s + hc_eps;
    }
    switch (n) {  // the wrapper asserts 1 <= n <= HC_MAX_N
        case 1: hc_sinkhorn<1>(c, a, b, hc_eps, iters); break;
        case 2: hc_sinkhorn<2>(c, a, b, hc_eps, iters); break;
        case 3: hc_sinkhorn<3>(c, a, b, hc_eps, iters); break;
        case 4: hc_sinkhorn<4>(c, a, b, hc_eps, iters); break;
        case 5: hc_sinkhorn<5>(c, a, b, hc_eps, iters); break;
        case 6: hc_sinkhorn<6>(c, a, b, hc_eps, iters); break;
        case 7: hc_sinkhorn<7>(c, a, b, hc_eps, iters); break;
        default: hc_sinkhorn<HC_MAX_N>(c, a, b, hc_eps, iters); break;
    }
#pragma unroll
    for (int q = 0; q < HC_ENTRIES; ++q)
        if (a[q] < n) comb[(long long)r * n * n + a[q] * n + b[q]] = c[q];
}

// The per-channel kernels below: grid (ceil(D / block), min(t, 65535)), thread k of a row,
// rows r = blockIdx.y, + gridDim.y, ... (no 64-bit division per element).

// out[r, k] = sum_i pre[r, i] X[r, i, k], streams accumulated 0..n-1.
extern "C" __global__ void hc_collapse(const float* __restrict__ streams, const float* __restrict__ pre,
                                       float* __restrict__ out, int t, int n, int d) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= d) return;
    for (long long r = blockIdx.y; r < t; r += gridDim.y) {
        const float* x = streams + r * n * d + k;
        float acc = pre[r * n] * x[0];
        for (int i = 1; i < n; ++i) acc = acc + pre[r * n + i] * x[(long long)i * d];
        out[r * d + k] = acc;
    }
}

// X'[r, b, k] = post[r, b] f[r, k] + sum_a C[r, a, b] X[r, a, k] (C transposed), a ascending.
// A thread makes channel k of all n output streams from one read of its n inputs.
extern "C" __global__ void hc_combine(const float* __restrict__ streams, const float* __restrict__ f,
                                      const float* __restrict__ post, const float* __restrict__ comb,
                                      float* __restrict__ out, int t, int n, int d) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= d) return;
    for (long long r = blockIdx.y; r < t; r += gridDim.y) {
        const float* x = streams + r * n * d + k;
        float xs[HC_MAX_N];
#pragma unroll
        for (int a = 0; a < HC_MAX_N; ++a) xs[a] = a < n ? x[(long long)a * d] : 0.0f;
        const float fk = f[r * d + k];
        for (int b = 0; b < n; ++b) {
            const float* c = comb + r * n * n + b;
            float acc = c[0] * xs[0];
#pragma unroll
            for (int a = 1; a < HC_MAX_N; ++a)
                if (a < n) acc = acc + c[a * n] * xs[a];
            out[(r * n + b) * d + k] = post[r * n + b] * fk + acc;
        }
    }
}

// Unweighted stream mean: sum in stream order, then one division by n (as the reference).
extern "C" __global__ void stream_mean(const float* __restrict__ streams, float* __restrict__ out,
                                       int t, int n, int d) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= d) return;
    for (long long r = blockIdx.y; r < t; r += gridDim.y) {
        const float* x = streams + r * n * d + k;
        float acc = x[0];
        for (int i = 1; i < n; ++i) acc = acc + x[(long long)i * d];
        out[r * d + k] = acc / (float)n;
    }
}
