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

// hc_weights holds the N x N mix in one warp: entry e = a N + b in lane e % 32, slot e / 32 of
// its c[]. N is a template argument so the Sinkhorn chain is straight-line code: its steps are
// serial, one warp runs them, and each instruction's latency is paid in full.
template <int N>
struct HcMix {
    static constexpr int SLOTS = (N * N + 31) / 32;
    float c[SLOTS];

    // Entry e from the lane holding it; every lane calls it (a warp-wide shuffle).
    __device__ __forceinline__ float entry(int e) const {
        const float v0 = __shfl_sync(0xffffffffu, c[0], e & 31);
        if (SLOTS == 1) return v0;
        const float v1 = __shfl_sync(0xffffffffu, c[SLOTS - 1], e & 31);
        return e < 32 ? v0 : v1;
    }

    // Every entry (a, b) /= (the sum of its column + eps), or of its row; every lane adds the
    // column (row) in ascending order, the same bits in each. All sums precede any change.
    __device__ __forceinline__ void normalise(bool columns, float eps) {
        float s[SLOTS];
#pragma unroll
        for (int q = 0; q < SLOTS; ++q) {
            const int e = (threadIdx.x & 31) + 32 * q, a = e / N, b = e % N;
            float sum = entry(columns ? b : a * N);
#pragma unroll
            for (int i = 1; i < N; ++i) sum += entry(columns ? i * N + b : a * N + i);
            s[q] = sum;
        }
#pragma unroll
        for (int q = 0; q < SLOTS; ++q) c[q] = c[q] / (s[q] + eps);  // lanes past N * N: unread
    }
};

// comb [N, N] of one row from its logits mc [N, N] (m * inv * scale + base): a row softmax + eps,
// then the column normalisation, iters - 1 times (rows, columns), in the reference's order.
template <int N>
static __device__ void hc_sinkhorn(const float* mc, const float* bc, float inv, float scale, float hc_eps,
                                   int iters, float* comb) {
    const int lane = threadIdx.x & 31;
    HcMix<N> mix;
#pragma unroll
    for (int q = 0; q < HcMix<N>::SLOTS; ++q) {
        const int e = lane + 32 * q, a = e / N, b = e % N;
        mix.c[q] = 0.0f;
        if (a < N) {  // each entry of row a walks the row in order
            float mx = __int_as_float(0xff800000);  // -inf (no host math.h under NVRTC)
#pragma unroll
            for (int i = 0; i < N; ++i) mx = fmaxf(mx, mc[a * N + i] * inv * scale + bc[a * N + i]);
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < N; ++i) s += expf(mc[a * N + i] * inv * scale + bc[a * N + i] - mx);
            mix.c[q] = expf(mc[e] * inv * scale + bc[e] - mx) / s + hc_eps;
        }
    }
    mix.normalise(true, hc_eps);
    for (int it = 1; it < iters; ++it) {
        mix.normalise(false, hc_eps);
        mix.normalise(true, hc_eps);
    }
#pragma unroll
    for (int q = 0; q < HcMix<N>::SLOTS; ++q)
        if (lane + 32 * q < N * N) comb[lane + 32 * q] = mix.c[q];
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

// grid (t), block 32 (one warp: HcMix). base [(2+n)n]; scale [3].
// Outputs pre [t, n], post [t, n], comb [t, n, n], in the reference's operation order.
extern "C" __global__ void hc_weights(const float* __restrict__ part, const float* __restrict__ base,
                                      const float* __restrict__ scale, float* __restrict__ pre,
                                      float* __restrict__ post, float* __restrict__ comb, int n,
                                      int d, int chunks, float rms_eps, float hc_eps, int iters) {
    __shared__ float m[HC_MAX_OUTS + 1];
    const int r = blockIdx.x, outs = (2 + n) * n, lane = threadIdx.x & 31;
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
    const float* mc = m + 2 * n;
    const float* bc = base + 2 * n;
    float* out = comb + (long long)r * n * n;
    static_assert(HC_MAX_N == 8, "one case per stream count below");
    switch (n) {
        case 1: hc_sinkhorn<1>(mc, bc, inv, scale[2], hc_eps, iters, out); break;
        case 2: hc_sinkhorn<2>(mc, bc, inv, scale[2], hc_eps, iters, out); break;
        case 3: hc_sinkhorn<3>(mc, bc, inv, scale[2], hc_eps, iters, out); break;
        case 4: hc_sinkhorn<4>(mc, bc, inv, scale[2], hc_eps, iters, out); break;
        case 5: hc_sinkhorn<5>(mc, bc, inv, scale[2], hc_eps, iters, out); break;
        case 6: hc_sinkhorn<6>(mc, bc, inv, scale[2], hc_eps, iters, out); break;
        case 7: hc_sinkhorn<7>(mc, bc, inv, scale[2], hc_eps, iters, out); break;
        default: hc_sinkhorn<8>(mc, bc, inv, scale[2], hc_eps, iters, out); break;
    }
}

// The per-channel kernels below: grid runtime.columns_grid(t, D), for_column_rows's layout
// (common.cuh): thread k of a row, rows blockIdx.y, + gridDim.y, ...

// out[r, k] = sum_i pre[r, i] X[r, i, k], streams accumulated 0..n-1.
extern "C" __global__ void hc_collapse(const float* __restrict__ streams, const float* __restrict__ pre,
                                       float* __restrict__ out, int t, int n, int d) {
    for_column_rows(t, d, [&](long long r, int k) {
        const float* x = streams + r * n * d + k;
        float acc = pre[r * n] * x[0];
        for (int i = 1; i < n; ++i) acc = acc + pre[r * n + i] * x[(long long)i * d];
        out[r * d + k] = acc;
    });
}

// X'[r, b, k] = post[r, b] f[r, k] + sum_a C[r, a, b] X[r, a, k] (C transposed), a ascending.
// A thread makes channel k of all n output streams from one read of its n inputs.
extern "C" __global__ void hc_combine(const float* __restrict__ streams, const float* __restrict__ f,
                                      const float* __restrict__ post, const float* __restrict__ comb,
                                      float* __restrict__ out, int t, int n, int d) {
    for_column_rows(t, d, [&](long long r, int k) {
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
    });
}

// Unweighted stream mean: sum in stream order, then one division by n (as the reference).
extern "C" __global__ void stream_mean(const float* __restrict__ streams, float* __restrict__ out,
                                       int t, int n, int d) {
    for_column_rows(t, d, [&](long long r, int k) {
        const float* x = streams + r * n * d + k;
        float acc = x[0];
        for (int i = 1; i < n; ++i) acc = acc + x[(long long)i * d];
        out[r * d + k] = acc / (float)n;
    });
}
