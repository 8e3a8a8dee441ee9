// The DSA kpool indexer of the exact class: pool keys, pool scores and position selection.
// Every output is produced by one thread or one block whose loop order depends only on that
// row's own data (its position), never on t or on the grid, so row r of a t-row launch is
// bit-identical to the same row launched alone. Semantics: NumpyBackend.kpool_compress /
// kpool_select; the attention over the chosen positions is mla.cu's.
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
    after_predecessor();
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
    after_predecessor();
    long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long j = at[0] / P + id / Di;
    if (j >= (at[0] + t) / P) return;
    int d = (int)(id % Di);
    pool_keys[j * Di + d] = pool_channel(keys + j * P * Di + d, gates + j * P * Di + d, ape + d, P, Di);
}

// Pool scores of row r (blockIdx.y) at position at + r: score_j = sum_h w_h relu(scale q_h . pk_j)
// for each complete pool j < n_r, the heads in order, each dot over the channels in order. Dense
// rows (n_r <= budget) need no scores. A block takes KPOOL_POOLS pools of its row: the row's q
// in shared memory (rows padded by one float, so a warp's 32 heads read 32 banks), a thread a
// (pool, head) dot, then a thread a pool adds its heads' terms in order: the operations of one
// serial loop a pool, so its bits. The grid covers every pool the plane can hold (nmax), so one
// launch shape serves every position. Dynamic shared memory: Hi (Di + 1) + KPOOL_POOLS Hi floats.
extern "C" __global__ void kpool_scores(const float* q, const float* w, const float* pool_keys,
                                        float* scores, const int* at, int pool, int budget, int Hi,
                                        int Di, int nmax, float scale) {
    after_predecessor();
    extern __shared__ float kpool_shared[];
    float* qs = kpool_shared;                   // [Hi][Di + 1]
    float* terms = kpool_shared + Hi * (Di + 1);  // [KPOOL_POOLS][Hi]
    const int r = blockIdx.y, j0 = blockIdx.x * KPOOL_POOLS;
    const int n = (at[0] + r + 1) / pool;
    if (n <= budget || j0 >= n) return;  // uniform over the block
    const float* qr = q + (long long)r * Hi * Di;
    for (int i = threadIdx.x; i < Hi * Di; i += MEMRA_BLOCK) qs[i / Di * (Di + 1) + i % Di] = qr[i];
    __syncthreads();
    for (int e = threadIdx.x; e < KPOOL_POOLS * Hi; e += MEMRA_BLOCK) {
        const int j = j0 + e / Hi, h = e % Hi;
        if (j >= n) continue;
        const float* pk = pool_keys + (long long)j * Di;
        const float* qh = qs + h * (Di + 1);
        float dot = 0.0f;
        for (int d = 0; d < Di; ++d) dot += qh[d] * pk[d];
        terms[e] = w[r * Hi + h] * fmaxf(dot * scale, 0.0f);
    }
    __syncthreads();
    const int j = j0 + (int)threadIdx.x;
    if (threadIdx.x < KPOOL_POOLS && j < n) {
        float acc = 0.0f;
        for (int h = 0; h < Hi; ++h) acc += terms[threadIdx.x * Hi + h];
        scores[(long long)r * nmax + j] = acc;
    }
}

// ranks_before's total order as one 64-bit key, larger first: the score's bits made monotone
// (-0 read as +0, which it equals), then the lower index.
static __device__ __forceinline__ unsigned long long rank_key(float v, int j) {
    unsigned int u = __float_as_uint(v == 0.0f ? 0.0f : v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (0xFFFFFFFFu - (unsigned int)j);
}

// The k-th largest (k >= 1) of the keys rank_key(s[j], j), j < n, all distinct: eight passes of
// a byte each from the top, each counting into 256 bins the keys that share the bytes found so
// far (shared integer atomics: exact counts, in any order) and keeping the bin where the count
// from the top reaches k. Warp 0 finds the bin: lane l sums bins 255 - 8 l down to 248 - 8 l,
// a scan across the lanes, then the lane that holds the k-th walks its 8. Call with the block.
static __device__ unsigned long long kth_key(const float* s, int n, int k, int* bins) {
    int* found = bins + 256;  // the pass's bin and the rank left in it
    unsigned long long prefix = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        const unsigned long long high = shift == 56 ? 0ull : ~0ull << (shift + 8);
        for (int b = threadIdx.x; b < 256; b += MEMRA_BLOCK) bins[b] = 0;
        __syncthreads();
        for (int j = threadIdx.x; j < n; j += MEMRA_BLOCK) {
            const unsigned long long key = rank_key(s[j], j);
            if ((key & high) == prefix) atomicAdd(&bins[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            int c[8], sum = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                c[i] = bins[255 - 8 * lane - i];
                sum += c[i];
            }
            int upto = sum;  // keys in the bins of lanes 0..lane
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, upto, off);
                if (lane >= off) upto += v;
            }
            int above = upto - sum;
            if (above < k && k <= upto) {
                for (int i = 0; i < 8; ++i) {
                    if (above + c[i] >= k) {
                        found[0] = 255 - 8 * lane - i;
                        found[1] = k - above;
                        break;
                    }
                    above += c[i];
                }
            }
        }
        __syncthreads();
        prefix |= (unsigned long long)found[0] << shift;
        k = found[1];
        __syncthreads();  // found is rewritten next pass
    }
    return prefix;
}

// Positions of row r (one block): dense rows attend 0..p; sparse rows take the `budget` best
// pools under ranks_before (those whose key is at least the budget-th largest: kth_key), write
// their positions in ascending pool order (a block prefix count over the pools, MEMRA_BLOCK at a
// time), the tail n*pool..p, and -1 padding.
extern "C" __global__ void kpool_select(const float* scores, int* out, const int* at, int pool,
                                        int budget, int width, int nmax) {
    after_predecessor();
    __shared__ int bins[256 + 2];
    __shared__ int taken[MEMRA_BLOCK / 32];
    int r = blockIdx.x;
    int p = at[0] + r;
    int n = (p + 1) / pool;
    int* o = out + (long long)r * width;
    if (n <= budget) {
        for (int c = threadIdx.x; c < width; c += MEMRA_BLOCK) o[c] = c <= p ? c : -1;
        return;
    }
    const float* s = scores + (long long)r * nmax;
    const unsigned long long kth = kth_key(s, n, budget, bins);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int base = 0;  // chosen pools below j0
    for (int j0 = 0; j0 < n; j0 += MEMRA_BLOCK) {
        const int j = j0 + (int)threadIdx.x;
        const bool take = j < n && rank_key(s[j], j) >= kth;
        const unsigned int ballot = __ballot_sync(0xffffffffu, take);
        if (lane == 0) taken[warp] = __popc(ballot);
        __syncthreads();
        int rank = base + __popc(ballot & ((1u << lane) - 1u));
        for (int w = 0; w < MEMRA_BLOCK / 32; ++w) {
            rank += w < warp ? taken[w] : 0;
            base += taken[w];
        }
        if (take)
            for (int m = 0; m < pool; ++m) o[rank * pool + m] = j * pool + m;
        __syncthreads();  // taken is rewritten next
    }
    int first = budget * pool;
    for (int c = first + threadIdx.x; c < width; c += MEMRA_BLOCK) {
        int pos = n * pool + (c - first);
        o[c] = pos <= p ? pos : -1;
    }
}
