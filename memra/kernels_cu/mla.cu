// The sparse-attention family of the exact class: DSA kpool indexer (pool keys, pool scores,
// position selection) and absorbed MLA attention over a row's position list.
// Every output is produced by one thread or one block whose loop order depends only on that
// row's own data (its position, its list width), never on t or on the grid, so row r of a
// t-row launch is bit-identical to the same row launched alone.
#include "common.cuh"

// One pool key channel: the P slot keys (stride Di from k, g) mixed by a softmax over the slots
// of gate + ape, slots taken in order (max, then the sum, then the weighted sum).
static __device__ float pool_channel(const float* k, const float* g, const float* ape, int P,
                                     int Di) {
    float mx = neg_inf();
    for (int m = 0; m < P; ++m) mx = fmaxf(mx, g[m * Di] + ape[m * Di]);
    float sum = 0.0f;
    for (int m = 0; m < P; ++m) sum += expf(g[m * Di] + ape[m * Di] - mx);
    float acc = 0.0f;
    for (int m = 0; m < P; ++m) {
        float p = expf(g[m * Di] + ape[m * Di] - mx) / sum;
        acc = acc + p * k[m * Di];
    }
    return acc;
}

// Pool keys of npool pools laid out [npool, P, Di]: thread (pool j, channel d).
extern "C" __global__ void kpool_compress(const float* keys, const float* gates, const float* ape,
                                          float* out, int npool, int P, int Di) {
    long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)npool * Di) return;
    long long j = id / Di;
    int d = (int)(id % Di);
    out[id] = pool_channel(keys + j * P * Di + d, gates + j * P * Di + d, ape + d, P, Di);
}

// The pools that plane rows at..at+t-1 complete (pools at/P .. (at+t)/P - 1, `at` read from the
// device so a captured graph stays valid as the plane grows), from the plane's own key and gate
// rows into pool_keys. Thread (pool j - at/P, channel d); the grid covers t/P + 1 pools.
extern "C" __global__ void kpool_finalize(const float* keys, const float* gates, const float* ape,
                                          float* pool_keys, const int* at, int t, int P, int Di) {
    long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long j = at[0] / P + id / Di;
    if (j >= (at[0] + t) / P) return;
    int d = (int)(id % Di);
    pool_keys[j * Di + d] = pool_channel(keys + j * P * Di + d, gates + j * P * Di + d, ape + d, P, Di);
}

// Pool scores of row r (blockIdx.y) at position at + r: thread j computes
// sum_h w_h relu(scale q_h . pk_j) for a complete pool j < n_r, heads in order, each dot over the
// channels in order. Dense rows (n_r <= budget) need no scores. The grid covers every pool the
// plane can hold (nmax), so one launch shape serves every position.
extern "C" __global__ void kpool_scores(const float* q, const float* w, const float* pool_keys,
                                        float* scores, const int* at, int pool, int budget, int Hi,
                                        int Di, int nmax, float scale) {
    int r = blockIdx.y;
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int n = (at[0] + r + 1) / pool;
    if (n <= budget || j >= n) return;
    const float* qr = q + (long long)r * Hi * Di;
    const float* pk = pool_keys + (long long)j * Di;
    float acc = 0.0f;
    for (int h = 0; h < Hi; ++h) {
        float dot = 0.0f;
        for (int d = 0; d < Di; ++d) dot += qr[h * Di + d] * pk[d];
        acc += w[r * Hi + h] * fmaxf(dot * scale, 0.0f);
    }
    scores[(long long)r * nmax + j] = acc;
}

// Positions of row r (one block): dense rows attend 0..p; sparse rows take the `budget` best
// pools one at a time (each round the best candidate ranking after the previous winner, so
// the result is the exact top-`budget` set under the total order), then write the chosen
// pools' positions in ascending pool order, the tail n*pool..p, and -1 padding.
// Dynamic shared memory: budget ints.
extern "C" __global__ void kpool_select(const float* scores, int* out, const int* at, int pool,
                                        int budget, int width, int nmax) {
    __shared__ float sv[MEMRA_BLOCK];
    __shared__ int si[MEMRA_BLOCK];
    extern __shared__ int chosen[];
    int r = blockIdx.x;
    int p = at[0] + r;
    int n = (p + 1) / pool;
    int* o = out + (long long)r * width;
    if (n <= budget) {
        for (int c = threadIdx.x; c < width; c += MEMRA_BLOCK) o[c] = c <= p ? c : -1;
        return;
    }
    const float* s = scores + (long long)r * nmax;
    float prev_v = 0.0f;
    int prev_i = -1;
    for (int b = 0; b < budget; ++b) {
        float best_v = 0.0f;
        int best_i = -1;
        for (int j = threadIdx.x; j < n; j += MEMRA_BLOCK) {
            float v = s[j];
            bool after = prev_i < 0 || ranks_before(prev_v, prev_i, v, j);
            if (after && ranks_before(v, j, best_v, best_i)) {
                best_v = v;
                best_i = j;
            }
        }
        block_best(best_v, best_i, sv, si, ranks_before);
        if (threadIdx.x == 0) chosen[b] = best_i;
        prev_v = best_v;
        prev_i = best_i;
    }
    __syncthreads();
    for (int b = threadIdx.x; b < budget; b += MEMRA_BLOCK) {
        int j = chosen[b];
        int rank = 0;  // place among the chosen pools, ascending by pool index
        for (int c = 0; c < budget; ++c) rank += chosen[c] < j;
        for (int m = 0; m < pool; ++m) o[rank * pool + m] = j * pool + m;
    }
    int base = budget * pool;
    for (int c = base + threadIdx.x; c < width; c += MEMRA_BLOCK) {
        int pos = n * pool + (c - base);
        o[c] = pos <= p ? pos : -1;
    }
}

// Absorbed MLA attention in three launches (all heads share the latent rows, so each latent row
// is read once per block of positions, not once per head):
//   mla_scores:  s[r, h, j] = scale * (q[r, h] . c_{pos[r, j]}), the dot over R in order;
//   mla_softmax: p[r, h, :] = softmax over the row's valid entries (fixed-tree max and sum);
//   mla_mix:     o[r, h, k] = sum_j p[r, h, j] c_{pos[r, j]}[k], j in list (ascending) order.
// Each value's order depends on R and the row's own list only, never on t or the grid.
static_assert(ATT_POS == 32, "mla_scores: one position per lane");
#define ATT_HEADS (WARPS_PER_BLOCK * 8)  // heads per pass of an mla_scores block: 8 per warp
#define ATT_KT 32                        // in-channels staged per step

// grid (ceil(W / ATT_POS), t), block MEMRA_BLOCK. Lane = position, warp = a group of 8 heads.
extern "C" __global__ void mla_scores(const float* q, const float* latent, const int* positions,
                                      float* scores, int H, int R, int W, float scale) {
    __shared__ float cs[ATT_POS][ATT_KT + 1];  // +1: lanes read different rows, no bank clash
    __shared__ float qs[ATT_HEADS][ATT_KT + 1];
    const int r = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int j = blockIdx.x * ATT_POS + lane;
    const int* pos = positions + (long long)r * W;
    for (int h0 = 0; h0 < H; h0 += ATT_HEADS) {
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
        for (int k0 = 0; k0 < R; k0 += ATT_KT) {
            __syncthreads();  // the previous step is done with the tiles
            for (int e = threadIdx.x; e < ATT_POS * ATT_KT; e += MEMRA_BLOCK) {
                const int jj = blockIdx.x * ATT_POS + e / ATT_KT, k = k0 + e % ATT_KT;
                const int c = jj < W ? pos[jj] : -1;
                cs[e / ATT_KT][e % ATT_KT] = c >= 0 && k < R ? latent[(long long)c * R + k] : 0.0f;
            }
            for (int e = threadIdx.x; e < ATT_HEADS * ATT_KT; e += MEMRA_BLOCK) {
                const int h = h0 + e / ATT_KT, k = k0 + e % ATT_KT;
                qs[e / ATT_KT][e % ATT_KT] = h < H && k < R ? q[((long long)r * H + h) * R + k] : 0.0f;
            }
            __syncthreads();
            const int kn = min(ATT_KT, R - k0);
            for (int k = 0; k < kn; ++k) {
                const float c = cs[lane][k];
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] = acc[i] + qs[warp * 8 + i][k] * c;
            }
        }
        if (j < W && pos[j] >= 0) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int h = h0 + warp * 8 + i;
                if (h < H) scores[((long long)r * H + h) * W + j] = acc[i] * scale;
            }
        }
    }
}

// grid (t * H), block MEMRA_BLOCK: scores -> probabilities in place; invalid entries get 0.
extern "C" __global__ void mla_softmax(float* scores, const int* positions, int H, int W) {
    __shared__ float shm[MEMRA_BLOCK];
    const int* pos = positions + (long long)(blockIdx.x / H) * W;
    float* s = scores + (long long)blockIdx.x * W;
    float mx = neg_inf();
    for (int j = threadIdx.x; j < W; j += MEMRA_BLOCK)
        if (pos[j] >= 0) mx = fmaxf(mx, s[j]);
    mx = block_max(mx, shm);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < W; j += MEMRA_BLOCK) {
        const float e = pos[j] >= 0 ? expf(s[j] - mx) : 0.0f;
        s[j] = e;
        sum += e;
    }
    sum = block_sum(sum, shm);
    for (int j = threadIdx.x; j < W; j += MEMRA_BLOCK) s[j] = s[j] / sum;
}

// MIX_HEADS heads per mla_mix block: one latent read serves MIX_HEADS accumulators.
#define MIX_SPAN 32  // list entries per warp turn; warp w takes turns w, w + 8, w + 16, ...
static_assert(MIX_CHANNELS == 32, "mla_mix: one channel per lane");
static_assert(WARPS_PER_BLOCK == MIX_HEADS, "mla_mix: the combine gives each warp one head");

// grid (ceil(R / MIX_CHANNELS), ceil(H / MIX_HEADS), t), block MEMRA_BLOCK: lane = channel k,
// warp = a fixed share of the list (a split size of MIX_SPAN entries, never a split count). The
// 8 warp partials are added in warp order. Invalid entries have p = 0 and read a zero row value.
extern "C" __global__ void mla_mix(const float* probs, const float* latent, const int* positions,
                                   float* out, int H, int R, int W) {
    __shared__ float part[WARPS_PER_BLOCK][MIX_HEADS][MIX_CHANNELS];
    const int r = blockIdx.z, h0 = blockIdx.y * MIX_HEADS, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int k = blockIdx.x * MIX_CHANNELS + lane;
    const int* pos = positions + (long long)r * W;
    const float* p = probs + ((long long)r * H + h0) * W;
    const int nh = min(MIX_HEADS, H - h0);
    float acc[MIX_HEADS];
#pragma unroll
    for (int i = 0; i < MIX_HEADS; ++i) acc[i] = 0.0f;
    for (int j0 = warp * MIX_SPAN; j0 < W; j0 += WARPS_PER_BLOCK * MIX_SPAN) {
        const int n = min(MIX_SPAN, W - j0);
#pragma unroll 8
        for (int e = 0; e < n; ++e) {
            const int c = pos[j0 + e];
            const float v = c >= 0 && k < R ? latent[(long long)c * R + k] : 0.0f;
#pragma unroll
            for (int i = 0; i < MIX_HEADS; ++i)
                if (i < nh) acc[i] = acc[i] + p[(long long)i * W + j0 + e] * v;
        }
    }
#pragma unroll
    for (int i = 0; i < MIX_HEADS; ++i) part[warp][i][lane] = acc[i];
    __syncthreads();
    const int i = warp;
    if (i < nh && k < R) {
        float sum = part[0][i][lane];
        for (int w = 1; w < WARPS_PER_BLOCK; ++w) sum += part[w][i][lane];
        out[((long long)r * H + h0 + i) * R + k] = sum;
    }
}
