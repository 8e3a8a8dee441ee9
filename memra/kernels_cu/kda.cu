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
// current row; out = SiLU(conv), as [C / cg, t, cg]: channel ch's rows at group ch / cg (cg = C
// for [t, C]). One thread per channel walks the rows in order.
// rows (may be null): the ring after row r < t - 1 is written at rows + r * row_stride, so a
// rollback to the first r + 1 rows is a copy (the ring after the last row is `ring` itself).
extern "C" __global__ void short_conv(const float* __restrict__ x, float* __restrict__ ring,
                                      const float* __restrict__ w, float* __restrict__ out,
                                      int t, int c, int k, int cg, float* __restrict__ rows,
                                      long long row_stride) {
    after_predecessor();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    float* o = out + (long long)(ch / cg) * t * cg + ch % cg;  // row r at o[r * cg]
    float hist[KDA_MAX_CONV];
    for (int j = 0; j < k - 1; ++j) hist[j] = ring[(long long)j * c + ch];
    const float* wc = w + (long long)ch * k;
    for (int r = 0; r < t; ++r) {
        o[(long long)r * cg] = conv_row(wc, hist, x[(long long)r * c + ch], k);
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
    after_predecessor();
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

// The state moves between global memory and a block's shared tile of its WARPS_PER_BLOCK
// adjacent columns, so global accesses are rows of adjacent columns (a warp reading its column
// alone would touch a 32-byte sector per float). Column c's entry i sits at c * KDA_TILE_STRIDE
// + i: a stride of 32 / WARPS_PER_BLOCK mod 32 banks spreads a warp's row-order reads over all
// 32 banks, and a warp's own column is contiguous.
static_assert(32 % WARPS_PER_BLOCK == 0, "kda tile: a warp's row pass covers whole rows");
constexpr int KDA_TILE_STRIDE = KDA_MAX_DK + 32 / WARPS_PER_BLOCK;
static __device__ __forceinline__ int tile_at(int c, int i) { return c * KDA_TILE_STRIDE + i; }

// tile <- the block's columns 0..width-1 of the dk rows at src (row stride dv); every thread.
static __device__ __forceinline__ void tile_from_rows(float* tile, const float* __restrict__ src,
                                                      int dk, int dv, int width) {
    for (int idx = threadIdx.x; idx < dk * WARPS_PER_BLOCK; idx += MEMRA_BLOCK) {
        const int i = idx / WARPS_PER_BLOCK, c = idx % WARPS_PER_BLOCK;
        if (c < width) tile[tile_at(c, i)] = src[i * dv + c];
    }
    __syncthreads();
}

// Each active warp's column s (lane l holds entry l + 32 m) -> the tile -> dst's dk rows of the
// block's width columns (row stride dv). Every thread calls it: it holds two block barriers, the
// second so the tile is read before anyone overwrites it.
template <int SLOTS>
static __device__ __forceinline__ void columns_to_rows(float* tile, const float* s, float* __restrict__ dst,
                                                       int dk, int dv, int width, bool active) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int m = 0; m < SLOTS; ++m) {
        const int i = lane + 32 * m;
        if (active && i < dk) tile[tile_at(warp, i)] = s[m];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < dk * WARPS_PER_BLOCK; idx += MEMRA_BLOCK) {
        const int i = idx / WARPS_PER_BLOCK, c = idx % WARPS_PER_BLOCK;
        if (c < width) dst[i * dv + c] = tile[tile_at(c, i)];
    }
    __syncthreads();
}

// Delta rule over the t rows in order, per head h:
//   S <- S * exp(g)[:, None];  S += k (x) beta (v - S^T k);  o = S^T q.
// q, k, g [t, Hk, dk]; v [t, Hk, dv]; beta [t, Hk]; state [Hk, dk, dv] float32 in place;
// out [t, Hk, dv]. Grid (Hk, ceil(dv / WARPS_PER_BLOCK)): one warp owns one value column j of S,
// lane l holding S[l + 32 m, j]. Both dk-reductions: per lane ascending m, then the butterfly.
// rows (may be null): S after row r < t - 1 is written at rows + r * row_stride ([Hk, dk, dv]),
// so a rollback to the first r + 1 rows is a copy instead of a replay.
// SLOTS: S entries each lane holds (ceil(dk / 32) rounded up to a kernel below); more slots
// than dk needs only idle, so every instantiation does a given dk's arithmetic alike.
template <int SLOTS>
static __device__ void kda_rows(const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, const float* __restrict__ g,
                                const float* __restrict__ beta, float* __restrict__ state,
                                float* __restrict__ out, int t, int hk, int dk, int dv,
                                float* __restrict__ rows, long long row_stride) {
    __shared__ float tile[WARPS_PER_BLOCK * KDA_TILE_STRIDE];
    const int h = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int j0 = blockIdx.y * WARPS_PER_BLOCK, j = j0 + warp, width = min(WARPS_PER_BLOCK, dv - j0);
    // a warp past dv holds zeros and computes nothing, but joins every block barrier
    const bool active = j < dv, snapping = rows != nullptr && t > 1;
    const long long head = (long long)h * dk * dv + j0;
    // row r + 1's inputs load while row r computes (the same arithmetic, in the same order)
    float s[SLOTS], gn[SLOTS], kn[SLOTS], qn[SLOTS], vn = 0.0f, bn = 0.0f;
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
    fetch(0);  // in flight while the state loads
    tile_from_rows(tile, state + head, dk, dv, width);
#pragma unroll
    for (int m = 0; m < SLOTS; ++m) {
        const int i = lane + 32 * m;
        s[m] = active && i < dk ? tile[tile_at(warp, i)] : 0.0f;
    }
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
                    s[m] = s[m] * expf(gg[m]);
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
        if (snapping && r < t - 1) columns_to_rows<SLOTS>(tile, s, rows + r * row_stride + head, dk, dv, width, active);
    }
    columns_to_rows<SLOTS>(tile, s, state + head, dk, dv, width, active);
}

#define KDA_RECURRENCE(NAME, SLOTS)                                                         \
    extern "C" __global__ void NAME(const float* __restrict__ q, const float* __restrict__ k,         \
                                    const float* __restrict__ v, const float* __restrict__ g,         \
                                    const float* __restrict__ beta, float* __restrict__ state,        \
                                    float* __restrict__ out, int t, int hk, int dk, int dv,           \
                                    float* __restrict__ rows, long long row_stride) {                 \
        after_predecessor();                                                                          \
        kda_rows<SLOTS>(q, k, v, g, beta, state, out, t, hk, dk, dv, rows, row_stride);    \
    }
KDA_RECURRENCE(kda_recurrence_s4, 4)             // dk <= 128 (every KDA checkpoint so far)
KDA_RECURRENCE(kda_recurrence, KDA_MAX_DK / 32)  // up to KDA_MAX_DK
// short_conv for a prompt (prime class): the rows split into spans of KDA_CONV_SPAN, a thread
// per (channel, span), each output's taps in the same order as short_conv (so the same bits).
// The ring is only read: the wrapper copies the last K-1 rows of x into it afterwards.
extern "C" __global__ void short_conv_spans(const float* __restrict__ x, const float* __restrict__ ring,
                                            const float* __restrict__ w, float* __restrict__ out,
                                            int t, int c, int k, int cg) {
    after_predecessor();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int r0 = blockIdx.y * KDA_CONV_SPAN, r1 = min(r0 + KDA_CONV_SPAN, t);
    if (ch >= c) return;
    float* o = out + (long long)(ch / cg) * t * cg + ch % cg;
    float hist[KDA_MAX_CONV];
    for (int j = 0; j < k - 1; ++j) {  // the K-1 inputs before row r0: rows of x, or the ring's
        const int src = r0 - (k - 1) + j;
        hist[j] = src >= 0 ? x[(long long)src * c + ch] : ring[(long long)(src + k - 1) * c + ch];
    }
    const float* wc = w + (long long)ch * k;
    for (int r = r0; r < r1; ++r) {
        o[(long long)r * cg] = conv_row(wc, hist, x[(long long)r * c + ch], k);
    }
}
