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
//   mla_scores:      s[r, h, j] = scale * (q[r, h] . c_{pos[r, j]}), the dot over R in order;
//   mla_mix:         per split of `split` entries (the wrapper passes MIX_SPLIT): m = the max of
//                    the split's valid scores, l = sum of e_j = exp(s_j - m) and part[k] = sum of
//                    e_j c_{pos[r, j]}[k], each over j ascending;
//   mla_mix_combine: o[r, h, k] = sum_s w_s part_s[k] / sum_s w_s l_s with w_s = exp(m_s - M),
//                    M the max of the m_s, both sums over the splits s ascending (a split of
//                    weight 0, or with no selected entry, skipped).
// Each value's order depends on R, W and the row's own list only, never on t, the tile or the grid.
// In-channels staged per mla_scores step; each step waits on its loads once, so one position a
// thread takes 128 (R = 512 in 4 waits). 256 needs so many registers that one block fits an SM,
// which loses on full lists; two positions a thread keep 64 for the same reason.
template <int PT>
__host__ __device__ constexpr int score_kt() { return PT == 1 ? 128 : 64; }
static_assert(MEMRA_BLOCK == 256, "mla_scores and mla_mix tile 256 threads");
static_assert(ATT_HEADS * ATT_POS == MEMRA_BLOCK, "mla_scores: a thread per (head, position column)");
static_assert(MIX_CHANNELS == 128 && MIX_SPLIT % MIX_STEP == 0, "mla_mix: 4 channels per lane");

// One mla_scores step's loads: q of heads h0.. and the tile's latent rows, channels k0..k0+KT.
template <int PT, int KT = score_kt<PT>()>
struct ScoreLoads {
    float q[ATT_HEADS * KT / MEMRA_BLOCK];
    float c[ATT_POS * PT * KT / MEMRA_BLOCK];

    __device__ void load(const float* qr, const float* latent, const int* ps, int H, int R, int h0,
                         int k0) {
#pragma unroll
        for (int i = 0; i < ATT_HEADS * KT / MEMRA_BLOCK; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK, h = h0 + e / KT, k = k0 + e % KT;
            q[i] = h < H && k < R ? qr[(long long)h * R + k] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < ATT_POS * PT * KT / MEMRA_BLOCK; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK, pos = ps[e / KT], k = k0 + e % KT;
            c[i] = pos >= 0 && k < R ? latent[(long long)pos * R + k] : 0.0f;
        }
    }
};

// grid (ceil(W / (ATT_POS * PT)), t, ceil(H / ATT_HEADS)), block MEMRA_BLOCK. Thread
// (h = tid / ATT_POS, pl = tid % ATT_POS) holds head h0 + h of the block's heads and positions
// pl + ATT_POS i (i < PT) of the tile. PT and the head split only tile: every score is the same
// serial dot, so they may follow t. A block takes ATT_HEADS of the row's heads (a quarter of
// 64), so the blocks of the selected positions spread over the SMs instead of each running every
// head in turn; a tile with no selected position (all -1) returns at once.
template <int PT>
__device__ void mla_scores_tile(const float* q, const float* latent, const int* positions,
                                float* scores, int H, int R, int W, float scale) {
    constexpr int SP = ATT_POS * PT, KT = score_kt<PT>();
    __shared__ float qs[KT][ATT_HEADS + 1];  // +1: the transposing stores spread
    __shared__ float cs[KT][SP + 1];
    __shared__ int ps[SP];
    const int r = blockIdx.y, j0 = blockIdx.x * SP, h0 = blockIdx.z * ATT_HEADS;
    const int h = threadIdx.x / ATT_POS, pl = threadIdx.x % ATT_POS;
    const int* pos = positions + (long long)r * W;
    const float* qr = q + (long long)r * H * R;
    bool any = false;
    if (threadIdx.x < SP) {
        ps[threadIdx.x] = j0 + (int)threadIdx.x < W ? pos[j0 + threadIdx.x] : -1;
        any = ps[threadIdx.x] >= 0;
    }
    if (!__syncthreads_or(any)) return;  // uniform: the whole block sees the same answer
    ScoreLoads<PT> next;
    float acc[PT];
#pragma unroll
    for (int i = 0; i < PT; ++i) acc[i] = 0.0f;
    next.load(qr, latent, ps, H, R, h0, 0);
    for (int k0 = 0; k0 < R; k0 += KT) {
        __syncthreads();  // the previous step is done with the tiles
#pragma unroll
        for (int i = 0; i < ATT_HEADS * KT / MEMRA_BLOCK; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK;
            qs[e % KT][e / KT] = next.q[i];
        }
#pragma unroll
        for (int i = 0; i < SP * KT / MEMRA_BLOCK; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK;
            cs[e % KT][e / KT] = next.c[i];
        }
        __syncthreads();
        if (k0 + KT < R) next.load(qr, latent, ps, H, R, h0, k0 + KT);  // in flight meanwhile
        const int kn = min(KT, R - k0);
        for (int k = 0; k < kn; ++k) {
            const float qv = qs[k][h];
#pragma unroll
            for (int i = 0; i < PT; ++i) acc[i] = acc[i] + qv * cs[k][pl + ATT_POS * i];
        }
    }
#pragma unroll
    for (int i = 0; i < PT; ++i) {
        const int jj = pl + ATT_POS * i;
        if (h0 + h < H && ps[jj] >= 0) scores[((long long)r * H + h0 + h) * W + j0 + jj] = acc[i] * scale;
    }
}

extern "C" __global__ void mla_scores_p1(const float* q, const float* latent, const int* positions,
                                         float* scores, int H, int R, int W, float scale) {
    after_predecessor();
    mla_scores_tile<1>(q, latent, positions, scores, H, R, W, scale);
}

extern "C" __global__ void mla_scores_p2(const float* q, const float* latent, const int* positions,
                                         float* scores, int H, int R, int W, float scale) {
    after_predecessor();
    mla_scores_tile<2>(q, latent, positions, scores, H, R, W, scale);
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

// grid (t * H), block MEMRA_BLOCK, 12 nsplit bytes of dynamic shared memory: row r = blockIdx.x / H,
// head h's outputs, each the split parts rescaled to the row's max and added in split order,
// over the weight sums added in the same order. A split with no selected entry (m = -inf) is
// skipped. The block first lists the splits that count and their weights w_s = exp(m_s - M),
// so each weight is taken once, not once per channel.
extern "C" __global__ void mla_mix_combine(const float* part, const float* stats, float* out, int H, int R,
                                           int nsplit) {
    after_predecessor();
    extern __shared__ float split_w[];  // [nsplit] weights, then [nsplit] weight sums, [nsplit] split ids
    float* split_l = split_w + nsplit;
    int* split_at = reinterpret_cast<int*>(split_l + nsplit);
    __shared__ float red[MEMRA_BLOCK], total;
    __shared__ int counted;
    const long long r = blockIdx.x / H, h = blockIdx.x % H, hr = (long long)H * R;
    const float* st = stats + (r * nsplit * H + h) * 2;  // split s at st[2 H s]
    float mx = neg_inf();
    for (int s = threadIdx.x; s < nsplit; s += MEMRA_BLOCK) {
        split_w[s] = st[2LL * H * s];
        split_l[s] = st[2LL * H * s + 1];
        mx = fmaxf(mx, split_w[s]);
    }
    mx = block_max(mx, red);  // a max: the same value in any order (its barriers publish split_w)
    for (int s = threadIdx.x; s < nsplit; s += MEMRA_BLOCK)
        split_w[s] = split_w[s] == neg_inf() ? 0.0f : expf(split_w[s] - mx);
    __syncthreads();
    if (threadIdx.x == 0) {
        int n = 0;
        float l = 0.0f;
        for (int s = 0; s < nsplit; ++s) {
            if (split_w[s] == 0.0f) continue;  // no selected entry (its part was never written), or no weight
            l += split_w[s] * split_l[s];
            split_w[n] = split_w[s];
            split_at[n++] = s;
        }
        counted = n;
        total = l;
    }
    __syncthreads();
    const float* p = part + r * nsplit * hr + h * R;
    for (int k = threadIdx.x; k < R; k += MEMRA_BLOCK) {
        float sum = 0.0f;
        for (int i = 0; i < counted; ++i) sum += split_w[i] * p[split_at[i] * hr + k];
        out[r * hr + h * R + k] = sum / total;
    }
}
