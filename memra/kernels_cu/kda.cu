// Kimi Delta Attention kernels: causal short conv, log-decay gate, delta-rule recurrence.
// Exact class. The stateful ops (short_conv, kda_recurrence) walk the t rows in order inside one
// launch, parallel only over channels / (head, value column), never over rows: a t-row launch
// then performs exactly the arithmetic of t successive one-row launches, and the ring / state
// held in registers between rows round-trips through memory unchanged.
// Semantics: NumpyBackend.short_conv / kda_gate / kda_recurrence.
#include "common.cuh"

// The wrapper asserts conv taps K <= KDA_MAX_CONV and key dim dk <= KDA_MAX_DK.
static_assert(KDA_MAX_DK % 32 == 0, "a warp's lanes share a state column evenly");
static_assert(MEMRA_BLOCK == 32 * WARPS_PER_BLOCK, "kda_recurrence: a block's warps are its columns");

// Fixed xor-butterfly over 32 lanes, then lane 0's value to all (one bit pattern per warp).
static __device__ __forceinline__ float kda_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return __shfl_sync(0xffffffffu, v, 0);
}

// One row of a channel's conv: the K taps in order (tap K-1 meets xr), SiLU; hist (the K-1
// inputs before, oldest first) moves on by one.
static __device__ __forceinline__ float conv_row(const float* wc, float* hist, float xr, int k) {
    float acc = wc[0] * (k > 1 ? hist[0] : xr);
    for (int j = 1; j < k; ++j) acc = acc + wc[j] * (j < k - 1 ? hist[j] : xr);
    if (k > 1) {
        for (int j = 0; j < k - 2; ++j) hist[j] = hist[j + 1];
        hist[k - 2] = xr;
    }
    return acc * sigmoidf_stable(acc);
}

// x [t, C]; ring [K-1, C] (oldest first, advanced in place); w [C, K], tap K-1 meets the
// current row; out [t, C] = SiLU(conv). One thread per channel walks the rows in order.
// rows (may be null): the ring after row r < t - 1 is written at rows + r * row_stride, so a
// rollback to the first r + 1 rows is a copy (the ring after the last row is `ring` itself).
extern "C" __global__ void short_conv(const float* __restrict__ x, float* __restrict__ ring,
                                      const float* __restrict__ w, float* __restrict__ out,
                                      int t, int c, int k, float* __restrict__ rows,
                                      long long row_stride) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    float hist[KDA_MAX_CONV];
    for (int j = 0; j < k - 1; ++j) hist[j] = ring[(long long)j * c + ch];
    const float* wc = w + (long long)ch * k;
    for (int r = 0; r < t; ++r) {
        out[(long long)r * c + ch] = conv_row(wc, hist, x[(long long)r * c + ch], k);
        if (rows != nullptr && r < t - 1)
            for (int j = 0; j < k - 1; ++j) rows[r * row_stride + (long long)j * c + ch] = hist[j];
    }
    for (int j = 0; j < k - 1; ++j) ring[(long long)j * c + ch] = hist[j];
}

// g = lb * sigmoid(exp(a_log) (f + dt_bias)) when has_lb, else -exp(a_log) softplus(f + dt_bias)
// with the reference's softplus (linear above 20). f, out [t, Hk, dk]; dt_bias [Hk, dk].
extern "C" __global__ void kda_gate(const float* __restrict__ f, const float* __restrict__ a_log,
                                    const float* __restrict__ dt_bias, float* __restrict__ out,
                                    int t, int hk, int dk, int has_lb, float lb) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)t * hk * dk) return;
    const int h = (int)((idx / dk) % hk), i = (int)(idx % dk);
    const float z = f[idx] + dt_bias[h * dk + i];
    const float rate = expf(a_log[h]);
    if (has_lb) {
        out[idx] = lb * sigmoidf_stable(rate * z);
    } else {
        const float soft = z > 20.0f ? z : log1pf(expf(fminf(z, 20.0f)));
        out[idx] = -rate * soft;
    }
}

// Delta rule over the t rows in order, per head h:
//   S <- S * exp(g)[:, None];  S += k (x) beta (v - S^T k);  o = S^T q.
// q, k, g [t, Hk, dk]; v [t, Hk, dv]; beta [t, Hk]; state [Hk, dk, dv] float32 in place;
// out [t, Hk, dv]. Grid (Hk, ceil(dv / WARPS_PER_BLOCK)): one warp owns one value column j of S,
// lane l holding S[l + 32 m, j]. Both dk-reductions: per lane ascending m, then the butterfly.
// rows (may be null): S after row r < t - 1 is written at rows + r * row_stride ([Hk, dk, dv]),
// so a rollback to the first r + 1 rows is a copy instead of a replay. A warp holds a column of
// S, so the block's WARPS_PER_BLOCK columns go through shared memory and out as rows of adjacent
// columns (a warp writing its column alone would touch a 32-byte sector per float).
// SLOTS: S entries each lane holds (ceil(dk / 32) rounded up to a kernel below); more slots
// than dk needs only idle, so every instantiation does a given dk's arithmetic alike.
template <int SLOTS, bool DECAYED>
static __device__ void kda_rows(const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, const float* __restrict__ g,
                                const float* __restrict__ beta, float* __restrict__ state,
                                float* __restrict__ out, int t, int hk, int dk, int dv,
                                float* __restrict__ rows, long long row_stride) {
    __shared__ float tile[WARPS_PER_BLOCK][KDA_MAX_DK + 1];
    const int h = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int j0 = blockIdx.y * WARPS_PER_BLOCK, j = j0 + warp;
    const bool active = j < dv, snapping = rows != nullptr && t > 1;
    if (!active && !snapping) return;  // a whole warp leaves; with snapshots it joins the barriers
    float* col = state + (long long)h * dk * dv + (active ? j : 0);
    // row r + 1's inputs load while row r computes (the same arithmetic, in the same order)
    float s[SLOTS], gn[SLOTS], kn[SLOTS], qn[SLOTS], vn = 0.0f, bn = 0.0f;
#pragma unroll
    for (int m = 0; m < SLOTS; ++m) {
        const int i = lane + 32 * m;
        s[m] = active && i < dk ? col[(long long)i * dv] : 0.0f;
    }
    auto fetch = [&](int r) {
        if (!active || r >= t) return;
        const long long kb = ((long long)r * hk + h) * dk;
#pragma unroll
        for (int m = 0; m < SLOTS; ++m) {
            const int i = lane + 32 * m;
            if (i < dk) {
                gn[m] = g[kb + i];
                kn[m] = k[kb + i];
                qn[m] = q[kb + i];
            }
        }
        vn = v[((long long)r * hk + h) * dv + j];
        bn = beta[(long long)r * hk + h];
    };
    fetch(0);
    for (int r = 0; r < t; ++r) {
        if (active) {
            float gg[SLOTS], kk[SLOTS], qq[SLOTS];
#pragma unroll
            for (int m = 0; m < SLOTS; ++m) {
                gg[m] = gn[m];
                kk[m] = kn[m];
                qq[m] = qn[m];
            }
            const float vr = vn, br = bn;
            fetch(r + 1);
            float ks = 0.0f;
#pragma unroll
            for (int m = 0; m < SLOTS; ++m) {
                const int i = lane + 32 * m;
                if (i < dk) {
                    s[m] = s[m] * (DECAYED ? gg[m] : expf(gg[m]));
                    ks += kk[m] * s[m];
                }
            }
            ks = kda_warp_sum(ks);
            const float delta = (vr - ks) * br;
            float qs = 0.0f;
#pragma unroll
            for (int m = 0; m < SLOTS; ++m) {
                const int i = lane + 32 * m;
                if (i < dk) {
                    s[m] = s[m] + kk[m] * delta;
                    qs += qq[m] * s[m];
                }
            }
            qs = kda_warp_sum(qs);
            if (lane == 0) out[((long long)r * hk + h) * dv + j] = qs;
        }
        if (snapping && r < t - 1) {
#pragma unroll
            for (int m = 0; m < SLOTS; ++m) {
                const int i = lane + 32 * m;
                if (active && i < dk) tile[warp][i] = s[m];
            }
            __syncthreads();
            float* snap = rows + r * row_stride + (long long)h * dk * dv + j0;
            const int width = min(WARPS_PER_BLOCK, dv - j0);
            for (int idx = threadIdx.x; idx < dk * WARPS_PER_BLOCK; idx += blockDim.x) {
                const int i = idx / WARPS_PER_BLOCK, c = idx % WARPS_PER_BLOCK;
                if (c < width) snap[(long long)i * dv + c] = tile[c][i];
            }
            __syncthreads();  // the tile is read before the next row overwrites it
        }
    }
    if (!active) return;
#pragma unroll
    for (int m = 0; m < SLOTS; ++m) {
        const int i = lane + 32 * m;
        if (i < dk) col[(long long)i * dv] = s[m];
    }
}

#define KDA_RECURRENCE(NAME, SLOTS, DECAYED)                                                         \
    extern "C" __global__ void NAME(const float* __restrict__ q, const float* __restrict__ k,         \
                                    const float* __restrict__ v, const float* __restrict__ g,         \
                                    const float* __restrict__ beta, float* __restrict__ state,        \
                                    float* __restrict__ out, int t, int hk, int dk, int dv,           \
                                    float* __restrict__ rows, long long row_stride) {                 \
        kda_rows<SLOTS, DECAYED>(q, k, v, g, beta, state, out, t, hk, dk, dv, rows, row_stride);    \
    }
KDA_RECURRENCE(kda_recurrence_s4, 4, false)             // dk <= 128 (every KDA checkpoint so far)
KDA_RECURRENCE(kda_recurrence, KDA_MAX_DK / 32, false)  // up to KDA_MAX_DK
// A prompt's rows (prime class) take g as exp(g), made once per element by kda_decay instead
// of once per element and value column: the same expf, so the same bits.
KDA_RECURRENCE(kda_recurrence_s4_decayed, 4, true)
KDA_RECURRENCE(kda_recurrence_decayed, KDA_MAX_DK / 32, true)

extern "C" __global__ void kda_decay(const float* __restrict__ g, float* __restrict__ out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = expf(g[i]);
}

// short_conv for a prompt (prime class): the rows split into spans of KDA_CONV_SPAN, a thread
// per (channel, span), each output's taps in the same order as short_conv (so the same bits).
// The ring is only read: the wrapper copies the last K-1 rows of x into it afterwards.
extern "C" __global__ void short_conv_spans(const float* __restrict__ x, const float* __restrict__ ring,
                                            const float* __restrict__ w, float* __restrict__ out,
                                            int t, int c, int k) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int r0 = blockIdx.y * KDA_CONV_SPAN, r1 = min(r0 + KDA_CONV_SPAN, t);
    if (ch >= c) return;
    float hist[KDA_MAX_CONV];
    for (int j = 0; j < k - 1; ++j) {  // the K-1 inputs before row r0: rows of x, or the ring's
        const int src = r0 - (k - 1) + j;
        hist[j] = src >= 0 ? x[(long long)src * c + ch] : ring[(long long)(src + k - 1) * c + ch];
    }
    const float* wc = w + (long long)ch * k;
    for (int r = r0; r < r1; ++r) {
        out[(long long)r * c + ch] = conv_row(wc, hist, x[(long long)r * c + ch], k);
    }
}
