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

// Pool scores of row r (blockIdx.y) at position at + r: thread j computes
// sum_h w_h relu(scale q_h . pk_j) for a complete pool j < n_r, heads in order, each dot over the
// channels in order. Dense rows (n_r <= budget) need no scores. The grid covers every pool the
// plane can hold (nmax), so one launch shape serves every position.
extern "C" __global__ void kpool_scores(const float* q, const float* w, const float* pool_keys,
                                        float* scores, const int* at, int pool, int budget, int Hi,
                                        int Di, int nmax, float scale) {
    after_predecessor();
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
    after_predecessor();
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

// Absorbed MLA attention in three launches; a block serves many heads of its row, so a latent
// row is read once per block of positions and ATT_HEADS heads (scores) or of channels (mix, all
// heads), never per head. The softmax is split with the mix (a split's own max, rescaled when the
// splits combine), so no launch waits on a whole row's scores:
//   mla_scores:      s[r, h, j] = scale * (q[r, h] . c_{pos[r, j]}), the dot over R in 8 fixed
//                    channel slices, added in order;
//   mla_mix:         per split of `split` entries (the wrapper passes MIX_SPLIT): m = the max of
//                    the split's valid scores, l = sum of e_j = exp(s_j - m) and part[k] = sum of
//                    e_j c_{pos[r, j]}[k], each over j ascending;
//   mla_mix_combine: o[r, h, k] = sum_s w_s part_s[k] / sum_s w_s l_s with w_s = exp(m_s - M),
//                    M the max of the m_s, both sums over the splits s ascending.
// Each value's order depends on R, W and the row's own list only, never on t, the tile or the grid.
static_assert(MEMRA_BLOCK == 256, "mla_scores and mla_mix tile 256 threads");
static_assert(ATT_HEADS == 16 && ATT_POS == 16, "mla_scores: 8 warps of 32 lanes, 2 heads x 4 positions a lane");
static_assert(MIX_CHANNELS == 128 && MIX_SPLIT % MIX_STEP == 0, "mla_mix: 4 channels per lane");

// mla_scores stages SCORE_KT in-channels a step; warp w takes channels 16 w .. 16 w + 15 of each.
constexpr int SCORE_KT = 128, SCORE_WARP_KT = SCORE_KT / WARPS_PER_BLOCK;
constexpr int SCORE_ROW = 20;  // a staged channel's 16 heads or positions, padded: 16-byte rows, fewer clashes

// One mla_scores step's loads: q of heads h0.. and the tile's latent rows, channels k0..k0+SCORE_KT
// (entry e: row e / SCORE_KT, channel e % SCORE_KT, so a warp reads 128 contiguous bytes).
struct ScoreLoads {
    static constexpr int N = ATT_HEADS * SCORE_KT / MEMRA_BLOCK;
    static_assert(ATT_POS * SCORE_KT / MEMRA_BLOCK == N, "as many latent loads as q loads");
    float q[N], c[N];

    __device__ void load(const float* qr, const float* latent, const int* ps, int H, int R, int h0, int k0) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK, row = e / SCORE_KT, k = k0 + e % SCORE_KT;
            q[i] = h0 + row < H && k < R ? qr[(long long)(h0 + row) * R + k] : 0.0f;
            c[i] = ps[row] >= 0 && k < R ? latent[(long long)ps[row] * R + k] : 0.0f;
        }
    }
};

// grid (ceil(W / ATT_POS), t, ceil(H / ATT_HEADS)), block MEMRA_BLOCK: the scores of ATT_HEADS
// heads at ATT_POS list entries. Lane (hp = lane / 4, pq = lane % 4) of warp w sums heads 2 hp,
// 2 hp + 1 times positions 4 pq .. 4 pq + 3 over its channels (warp w's 16 of each step, steps in
// order), so a channel costs a lane two shared loads for eight products; the block then adds its 8
// warps' partials in warp order. The order depends on R only. A tile with no selected position
// (all -1) returns at once.
extern "C" __global__ void __launch_bounds__(MEMRA_BLOCK, 3) mla_scores(const float* q, const float* latent, const int* positions,
                                      float* scores, int H, int R, int W, float scale) {
    after_predecessor();
    __shared__ __align__(16) float qs[SCORE_KT][SCORE_ROW], cs[SCORE_KT][SCORE_ROW];
    __shared__ float part[WARPS_PER_BLOCK][ATT_HEADS * ATT_POS];
    __shared__ int ps[ATT_POS];
    const int r = blockIdx.y, j0 = blockIdx.x * ATT_POS, h0 = blockIdx.z * ATT_HEADS;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, hp = lane / 4, pq = lane % 4;
    const int* pos = positions + (long long)r * W;
    const float* qr = q + (long long)r * H * R;
    bool any = false;
    if (threadIdx.x < ATT_POS) {
        ps[threadIdx.x] = j0 + (int)threadIdx.x < W ? pos[j0 + threadIdx.x] : -1;
        any = ps[threadIdx.x] >= 0;
    }
    if (!__syncthreads_or(any)) return;  // uniform: the whole block sees the same answer
    ScoreLoads next;
    float acc[2][4] = {};
    next.load(qr, latent, ps, H, R, h0, 0);
    for (int k0 = 0; k0 < R; k0 += SCORE_KT) {
        __syncthreads();  // the previous step is done with the tiles
#pragma unroll
        for (int i = 0; i < ScoreLoads::N; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK;
            qs[e % SCORE_KT][e / SCORE_KT] = next.q[i];
            cs[e % SCORE_KT][e / SCORE_KT] = next.c[i];
        }
        __syncthreads();
        if (k0 + SCORE_KT < R) next.load(qr, latent, ps, H, R, h0, k0 + SCORE_KT);  // in flight meanwhile
#pragma unroll
        for (int kk = 0; kk < SCORE_WARP_KT; ++kk) {
            const int k = warp * SCORE_WARP_KT + kk;
            const float2 qv = *reinterpret_cast<const float2*>(&qs[k][2 * hp]);
            const float4 cv = *reinterpret_cast<const float4*>(&cs[k][4 * pq]);
            const float qa[2] = {qv.x, qv.y}, ca[4] = {cv.x, cv.y, cv.z, cv.w};
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int b = 0; b < 4; ++b) acc[a][b] = acc[a][b] + qa[a] * ca[b];
        }
    }
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) part[warp][(2 * hp + a) * ATT_POS + 4 * pq + b] = acc[a][b];
    __syncthreads();
    const int h = threadIdx.x / ATT_POS, jj = threadIdx.x % ATT_POS;
    float sum = part[0][threadIdx.x];
    for (int w = 1; w < WARPS_PER_BLOCK; ++w) sum += part[w][threadIdx.x];
    if (h0 + h < H && ps[jj] >= 0) scores[((long long)r * H + h0 + h) * W + j0 + jj] = sum * scale;
}

#define MIX_HEADS 64  // heads per mla_mix pass: 8 warps of 8 heads (mla_scores splits its own by ATT_HEADS)
static_assert(MIX_HEADS == 8 * (MEMRA_BLOCK / 32), "mla_mix: a warp holds 8 heads of the pass");

// One mla_mix step's loads: the scores of heads h0.. (-inf at an entry with no position: its
// weight is 0) and the latent channels kb.. of entries j0..j0+MIX_STEP (entry e of the split at ps[e]).
struct MixLoads {
    float p[MIX_HEADS * MIX_STEP / MEMRA_BLOCK];
    float c[MIX_STEP * MIX_CHANNELS / MEMRA_BLOCK];

    __device__ void load(const float* sr, const float* latent, const int* ps, int H, int R, int W,
                         int h0, int kb, int j0, int e0) {
#pragma unroll
        for (int i = 0; i < MIX_HEADS * MIX_STEP / MEMRA_BLOCK; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK, h = h0 + e / MIX_STEP, j = j0 + e % MIX_STEP;
            p[i] = h < H && j < W && ps[e0 + e % MIX_STEP] >= 0 ? sr[(long long)h * W + j] : neg_inf();
        }
#pragma unroll
        for (int i = 0; i < MIX_STEP * MIX_CHANNELS / MEMRA_BLOCK; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK, pos = ps[e0 + e / MIX_CHANNELS];
            const int k = kb + e % MIX_CHANNELS;
            c[i] = pos >= 0 && k < R ? latent[(long long)pos * R + k] : 0.0f;
        }
    }
};

// A score's weight in its split: exp(s - m); 0 for an entry with no position (-inf).
static __device__ __forceinline__ float split_weight(float s, float m) {
    return s == neg_inf() ? 0.0f : expf(s - m);
}

// The split's max m and weight sum l of heads h0 + tid / 4 (MIX_HEADS of them), entries js..js+jn
// of row scores sr: the head's 4 threads take entries tid % 4, + 4, ... each ascending, then an
// xor tree over the 4 (the same bits in each).
static __device__ void split_stats(const float* sr, const int* ps, int H, int W, int h0, int js, int jn,
                                   float* smax, float* ssum) {
    const int h = h0 + threadIdx.x / 4, part = threadIdx.x % 4;
    const float* row = sr + (long long)min(h, H - 1) * W + js;
    float m = neg_inf();
    for (int j = part; j < jn; j += 4)
        if (ps[j] >= 0) m = fmaxf(m, row[j]);
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    float l = 0.0f;
    for (int j = part; j < jn; j += 4) l += split_weight(ps[j] >= 0 ? row[j] : neg_inf(), m);
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (part == 0) {
        smax[threadIdx.x / 4] = m;
        ssum[threadIdx.x / 4] = l;
    }
}

// grid (ceil(R / MIX_CHANNELS), ceil(W / split), t), block MEMRA_BLOCK: split s = blockIdx.y's
// part over its entries in order, and (blocks of channel 0) its stats [t, nsplit, H, 2] = (m, l);
// a split with no selected entry writes m = -inf and no part.
// split <= MIX_SPLIT, a multiple of MIX_STEP. Thread (warp w, lane l) holds heads 8 w .. 8 w + 7
// of the pass and channels kb + 4 l .. + 3.
extern "C" __global__ void mla_mix(const float* scores, const float* latent, const int* positions,
                                   float* part, float* stats, int H, int R, int W, int split) {
    after_predecessor();
    static_assert(MIX_HEADS * 4 == MEMRA_BLOCK, "split_stats: 4 threads a head");
    __shared__ __align__(16) float cs[MIX_STEP][MIX_CHANNELS];
    __shared__ __align__(16) float pt[MIX_STEP][MIX_HEADS + 4];  // +4: float4 rows, fewer clashes
    __shared__ float smax[MIX_HEADS], ssum[MIX_HEADS];
    __shared__ int ps[MIX_SPLIT];
    const int r = blockIdx.z, s = blockIdx.y, kb = blockIdx.x * MIX_CHANNELS;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, js = s * split;
    const int jn = min(split, W - js), nsplit = (W + split - 1) / split;
    const int* pos = positions + (long long)r * W;
    const float* sr = scores + (long long)r * H * W;
    bool any = false;
    if (threadIdx.x < MIX_SPLIT) {
        ps[threadIdx.x] = (int)threadIdx.x < jn ? pos[js + threadIdx.x] : -1;
        any = ps[threadIdx.x] >= 0;
    }
    if (!__syncthreads_or(any)) {  // no selected entry (a short context's tail): the combine skips it
        if (blockIdx.x == 0)
            for (int h = threadIdx.x; h < H; h += MEMRA_BLOCK) {
                float* st = stats + (((long long)r * nsplit + s) * H + h) * 2;
                st[0] = neg_inf();
                st[1] = 0.0f;
            }
        return;
    }
    MixLoads next;
    for (int h0 = 0; h0 < H; h0 += MIX_HEADS) {
        float acc[8][4];
#pragma unroll
        for (int a = 0; a < 8; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) acc[a][b] = 0.0f;
        next.load(sr, latent, ps, H, R, W, h0, kb, js, 0);
        __syncthreads();  // the previous pass is done with smax
        split_stats(sr, ps, H, W, h0, js, jn, smax, ssum);
        for (int e0 = 0; e0 < jn; e0 += MIX_STEP) {
            __syncthreads();  // the previous step is done with the tiles; smax is written
#pragma unroll
            for (int i = 0; i < MIX_HEADS * MIX_STEP / MEMRA_BLOCK; ++i) {
                const int e = threadIdx.x + i * MEMRA_BLOCK;
                pt[e % MIX_STEP][e / MIX_STEP] = split_weight(next.p[i], smax[e / MIX_STEP]);
            }
#pragma unroll
            for (int i = 0; i < MIX_STEP * MIX_CHANNELS / MEMRA_BLOCK; ++i) {
                const int e = threadIdx.x + i * MEMRA_BLOCK;
                cs[e / MIX_CHANNELS][e % MIX_CHANNELS] = next.c[i];
            }
            __syncthreads();
            const int e1 = e0 + MIX_STEP;
            if (e1 < jn) next.load(sr, latent, ps, H, R, W, h0, kb, js + e1, e1);  // in flight meanwhile
            const int en = min(MIX_STEP, jn - e0);
            for (int e = 0; e < en; ++e) {
                const float4 c = *reinterpret_cast<const float4*>(&cs[e][4 * lane]);
                const float4 pa = *reinterpret_cast<const float4*>(&pt[e][8 * warp]);
                const float4 pb = *reinterpret_cast<const float4*>(&pt[e][8 * warp + 4]);
                const float p[8] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
                for (int a = 0; a < 8; ++a) {
                    acc[a][0] = acc[a][0] + p[a] * c.x;
                    acc[a][1] = acc[a][1] + p[a] * c.y;
                    acc[a][2] = acc[a][2] + p[a] * c.z;
                    acc[a][3] = acc[a][3] + p[a] * c.w;
                }
            }
        }
#pragma unroll
        for (int a = 0; a < 8; ++a) {
            const int h = h0 + 8 * warp + a;
            if (h >= H) continue;
            float* o = part + (((long long)r * nsplit + s) * H + h) * R;
#pragma unroll
            for (int b = 0; b < 4; ++b)
                if (kb + 4 * lane + b < R) o[kb + 4 * lane + b] = acc[a][b];
        }
        if (blockIdx.x == 0 && threadIdx.x < MIX_HEADS && h0 + (int)threadIdx.x < H) {
            float* st = stats + (((long long)r * nsplit + s) * H + h0 + threadIdx.x) * 2;
            st[0] = smax[threadIdx.x];
            st[1] = ssum[threadIdx.x];
        }
    }
}

// grid blocks_of(t * H * R), thread = one output: the split parts rescaled to the row's max and
// added in split order, over the weight sums added in the same order; a split with no selected
// entry (m = -inf) is skipped.
extern "C" __global__ void mla_mix_combine(const float* part, const float* stats, float* out, int t, int H,
                                           int R, int nsplit) {
    after_predecessor();
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long hr = (long long)H * R;
    if (id >= t * hr) return;
    const long long r = id / hr, h = (id - r * hr) / R;
    const float* p = part + r * nsplit * hr + (id - r * hr);
    const float* st = stats + (r * nsplit * H + h) * 2;  // split s at st[2 H s]
    float mx = neg_inf();
    for (int s = 0; s < nsplit; ++s) mx = fmaxf(mx, st[2LL * H * s]);
    float sum = 0.0f, l = 0.0f;
    for (int s = 0; s < nsplit; ++s) {
        const float m = st[2LL * H * s];
        if (m == neg_inf()) continue;  // no selected entry: its part was never written
        const float w = expf(m - mx);
        sum += w * p[s * hr];
        l += w * st[2LL * H * s + 1];
    }
    out[id] = sum / l;
}
