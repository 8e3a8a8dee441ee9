// The sparse-attention family of the exact class: DSA kpool indexer (pool keys, pool scores,
// position selection) and absorbed MLA attention over a row's position list.
// Every output is produced by one thread or one block whose loop order depends only on that
// row's own data (its position, its list width), never on t or on the grid, so row r of a
// t-row launch is bit-identical to the same row launched alone.
#include "common.cuh"

static __device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Pool keys: thread (pool j, channel d) mixes the P slot keys by a softmax over the slots of
// gate + ape, slots taken in order (max, then the sum, then the weighted sum).
extern "C" __global__ void kpool_compress(const float* keys, const float* gates, const float* ape,
                                          float* out, int npool, int P, int Di) {
    long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)npool * Di) return;
    long long j = id / Di;
    int d = (int)(id % Di);
    const float* k = keys + j * P * Di + d;
    const float* g = gates + j * P * Di + d;
    float mx = neg_inf();
    for (int m = 0; m < P; ++m) mx = fmaxf(mx, g[m * Di] + ape[m * Di + d]);
    float sum = 0.0f;
    for (int m = 0; m < P; ++m) sum += expf(g[m * Di] + ape[m * Di + d] - mx);
    float acc = 0.0f;
    for (int m = 0; m < P; ++m) {
        float p = expf(g[m * Di] + ape[m * Di + d] - mx) / sum;
        acc = acc + p * k[m * Di];
    }
    out[id] = acc;
}

// Pool scores of row r (blockIdx.y): thread j computes sum_h w_h relu(scale q_h . pk_j) for a
// complete pool j < n_r, heads in order, each dot over the channels in order.
extern "C" __global__ void kpool_scores(const float* q, const float* w, const float* pool_keys,
                                        float* scores, int pos0, int pool, int Hi, int Di,
                                        int nmax, float scale) {
    int r = blockIdx.y;
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int n = (pos0 + r + 1) / pool;
    if (j >= n) return;
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

// The selection's total order: a higher score first, equal scores to the lower pool index.
// Index -1 stands for "no candidate" and ranks after everything.
static __device__ __forceinline__ bool ranks_before(float va, int ia, float vb, int ib) {
    if (ia < 0) return false;
    if (ib < 0) return true;
    return va > vb || (va == vb && ia < ib);
}

// Fixed-shape tree over MEMRA_BLOCK (score, index) candidates; every thread gets the winner.
static __device__ void block_best(float& v, int& i, float* sv, int* si) {
    sv[threadIdx.x] = v;
    si[threadIdx.x] = i;
    __syncthreads();
    for (int s = MEMRA_BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && ranks_before(sv[threadIdx.x + s], si[threadIdx.x + s],
                                            sv[threadIdx.x], si[threadIdx.x])) {
            sv[threadIdx.x] = sv[threadIdx.x + s];
            si[threadIdx.x] = si[threadIdx.x + s];
        }
        __syncthreads();
    }
    v = sv[0];
    i = si[0];
    __syncthreads();
}

// Positions of row r (one block): dense rows attend 0..p; sparse rows take the `budget` best
// pools one at a time (each round the best candidate ranking after the previous winner, so
// the result is the exact top-`budget` set under the total order), then write the chosen
// pools' positions in ascending pool order, the tail n*pool..p, and -1 padding.
// Dynamic shared memory: budget ints.
extern "C" __global__ void kpool_select(const float* scores, int* out, int pos0, int pool,
                                        int budget, int width, int nmax) {
    __shared__ float sv[MEMRA_BLOCK];
    __shared__ int si[MEMRA_BLOCK];
    extern __shared__ int chosen[];
    int r = blockIdx.x;
    int p = pos0 + r;
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
        block_best(best_v, best_i, sv, si);
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

// Absorbed MLA attention, one block per (row, head): scores over the valid entries of the
// row's list (threads stride the list, each dot over R in order), fixed-tree max and sum,
// then each thread owns output channels and accumulates p_j c_j in list (ascending) order.
// scores: scratch [t*H, W].
extern "C" __global__ void mla_attend(const float* q, const float* latent, const int* positions,
                                      float* scores, float* out, int H, int R, int W,
                                      float scale) {
    __shared__ float shm[MEMRA_BLOCK];
    int r = blockIdx.x / H;
    const float* qh = q + (long long)blockIdx.x * R;
    const int* pos = positions + (long long)r * W;
    float* s = scores + (long long)blockIdx.x * W;
    float mx = neg_inf();
    for (int j = threadIdx.x; j < W; j += MEMRA_BLOCK) {
        int c = pos[j];
        if (c < 0) continue;
        const float* cj = latent + (long long)c * R;
        float dot = 0.0f;
        for (int k = 0; k < R; ++k) dot += qh[k] * cj[k];
        float v = dot * scale;
        s[j] = v;
        mx = fmaxf(mx, v);
    }
    mx = block_max(mx, shm);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < W; j += MEMRA_BLOCK) {
        if (pos[j] < 0) continue;
        float e = expf(s[j] - mx);
        s[j] = e;
        sum += e;
    }
    sum = block_sum(sum, shm);  // its barriers also publish every s[j] to the whole block
    float* o = out + (long long)blockIdx.x * R;
    for (int k = threadIdx.x; k < R; k += MEMRA_BLOCK) {
        float acc = 0.0f;
        for (int j = 0; j < W; ++j) {
            int c = pos[j];
            if (c < 0) continue;
            acc += (s[j] / sum) * latent[(long long)c * R + k];
        }
        o[k] = acc;
    }
}
