// Absorbed MLA attention of the exact class over a row's position list (the list is kpool.cu's
// selection). Every output is produced by one thread or one block whose loop order depends only
// on that row's own data (its position, its list width), never on t or on the grid, so row r of
// a t-row launch is bit-identical to the same row launched alone.
#include "common.cuh"

// Absorbed MLA attention in four launches; a block serves many heads of its row, so a latent
// row is read once per block of positions and heads (scores) or of channels (mix, all
// heads), never per head:
//   mla_scores:      s[r, h, j] = scale * (q[r, h] . c_{pos[r, j]}), the dot over R in order;
//   mla_softmax:     p[r, h, :] = softmax over the row's valid entries (fixed-tree max and sum);
//   mla_mix:         part[r, s, h, k] = sum of p[r, h, j] c_{pos[r, j]}[k] over the split's
//                    `split` entries j (the wrapper passes MIX_SPLIT), ascending;
//   mla_mix_combine: o[r, h, k] = sum of part[r, s, h, k] over the splits s, ascending.
// A split with no selected entry (a short context pads the list with -1) is skipped: its sum
// would be +0 (every p there is 0), and adding +0 changes no sum, as none is -0 (each starts
// at +0 and x + y rounds to -0 only when both are -0), so the combine leaves it out.
// Each value's order depends on R, W and the row's own list only, never on t, the tile or the grid.
static_assert(MEMRA_BLOCK == 256, "mla_scores and mla_mix tile 256 threads");
static_assert(MIX_CHANNELS == 128 && MIX_SPLIT % MIX_STEP == 0, "mla_mix: 4 channels per lane");

// Component c (0..3, a constant after unrolling) of a 16-byte read: channel k + c of a row.
static __device__ __forceinline__ float channel(const float4& v, int c) {
    return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}

// mla_scores on register tiles. grid (ceil(W / (16 TP)), t, ceil(H / (16 TH))), block
// MEMRA_BLOCK: thread (hy = tid / 16, px = tid % 16) holds heads h0 + hy + 16 a (a < TH) and
// positions j0 + px + 16 b (b < TP) of the block's tile, TH x TP serial dots over R in order (the
// tile only says which thread runs a dot: same bits at every TH, TP). Each step stages
// KT channels of the tile's q rows and latent rows in shared memory in their own layout
// (rows padded by 4 floats: the 8 threads of a 16-byte load phase read 8 consecutive rows, 8
// distinct bank quads) and a thread reads 4 channels of a row at once, so a step costs TH + TP
// shared loads for 4 TH TP products where a thread per score took 8. A tile with no selected
// position (all -1) returns at once.

// guard lets one graph serve walks on both sides of a list length L (mla.py score_launches): 0
// runs; +L runs only where every row's list holds at least L positions, -L only where one holds
// fewer (a list is ascending and -1 padded, so that is its slot L - 1). The host launches the two
// tiles with +L and -L, and exactly one of them scores: the tile changes no score, only the time.
static __device__ __forceinline__ bool guard_passes(const int* positions, int W, int guard) {
    if (guard == 0) return true;
    const int L = guard > 0 ? guard : -guard;
    bool long_lists = L <= W;
    for (int r = 0; r < (int)gridDim.y && long_lists; ++r) long_lists = positions[(long long)r * W + L - 1] >= 0;
    return long_lists == (guard > 0);
}

template <int TH, int TP, int KT>
__device__ void mla_scores_regs(const float* q, const float* latent, const int* positions,
                                float* scores, int H, int R, int W, float scale, int guard) {
    constexpr int HB = 16 * TH, PB = 16 * TP, LD = KT + 4;
    constexpr int QL = HB * KT / MEMRA_BLOCK, CL = PB * KT / MEMRA_BLOCK;
    static_assert(KT % 4 == 0 && QL * MEMRA_BLOCK == HB * KT, "16 x 16 threads, 16-byte reads");
    __shared__ __align__(16) float qs[HB][LD];
    __shared__ __align__(16) float cs[PB][LD];
    __shared__ int ps[PB];
    const int r = blockIdx.y, j0 = blockIdx.x * PB, h0 = blockIdx.z * HB;
    const int hy = threadIdx.x / 16, px = threadIdx.x % 16;
    if (!guard_passes(positions, W, guard)) return;  // uniform: every block reads the same slots
    const int* pos = positions + (long long)r * W;
    const float* qr = q + (long long)r * H * R;
    bool any = false;
    if (threadIdx.x < PB) {
        ps[threadIdx.x] = j0 + (int)threadIdx.x < W ? pos[j0 + threadIdx.x] : -1;
        any = ps[threadIdx.x] >= 0;
    }
    if (!__syncthreads_or(any)) return;  // uniform: the whole block sees the same answer
    float nq[QL], nc[CL];  // the next step's loads, in flight while the current step runs
    auto load = [&](int k0) {
#pragma unroll
        for (int i = 0; i < QL; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK, h = h0 + e / KT, k = k0 + e % KT;
            nq[i] = h < H && k < R ? qr[(long long)h * R + k] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < CL; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK, p = ps[e / KT], k = k0 + e % KT;
            nc[i] = p >= 0 && k < R ? latent[(long long)p * R + k] : 0.0f;
        }
    };
    float acc[TH][TP];
#pragma unroll
    for (int a = 0; a < TH; ++a)
#pragma unroll
        for (int b = 0; b < TP; ++b) acc[a][b] = 0.0f;
    auto madd = [&](const float (&qv)[TH], const float (&cv)[TP]) {
#pragma unroll
        for (int a = 0; a < TH; ++a)
#pragma unroll
            for (int b = 0; b < TP; ++b) acc[a][b] = acc[a][b] + qv[a] * cv[b];
    };
    load(0);
    for (int k0 = 0; k0 < R; k0 += KT) {
        __syncthreads();  // the previous step is done with the tiles
#pragma unroll
        for (int i = 0; i < QL; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK;
            qs[e / KT][e % KT] = nq[i];
        }
#pragma unroll
        for (int i = 0; i < CL; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK;
            cs[e / KT][e % KT] = nc[i];
        }
        __syncthreads();
        if (k0 + KT < R) load(k0 + KT);
        const int kn = min(KT, R - k0), k4 = kn & ~3;
        for (int k = 0; k < k4; k += 4) {
            float4 q4[TH], c4[TP];
#pragma unroll
            for (int a = 0; a < TH; ++a) q4[a] = *reinterpret_cast<const float4*>(&qs[hy + 16 * a][k]);
#pragma unroll
            for (int b = 0; b < TP; ++b) c4[b] = *reinterpret_cast<const float4*>(&cs[px + 16 * b][k]);
#pragma unroll
            for (int c = 0; c < 4; ++c) {  // channel k + c
                float qv[TH], cv[TP];
#pragma unroll
                for (int a = 0; a < TH; ++a) qv[a] = channel(q4[a], c);
#pragma unroll
                for (int b = 0; b < TP; ++b) cv[b] = channel(c4[b], c);
                madd(qv, cv);
            }
        }
        for (int k = k4; k < kn; ++k) {  // R not a multiple of 4: the last channels one at a time
            float qv[TH], cv[TP];
#pragma unroll
            for (int a = 0; a < TH; ++a) qv[a] = qs[hy + 16 * a][k];
#pragma unroll
            for (int b = 0; b < TP; ++b) cv[b] = cs[px + 16 * b][k];
            madd(qv, cv);
        }
    }
#pragma unroll
    for (int a = 0; a < TH; ++a)
#pragma unroll
        for (int b = 0; b < TP; ++b) {
            const int h = h0 + hy + 16 * a, jj = px + 16 * b;
            if (h < H && ps[jj] >= 0) scores[((long long)r * H + h) * W + j0 + jj] = acc[a][b] * scale;
        }
}

// Two blocks an SM (at most 128 registers): measured faster for the 4 x 2 tile (t = 8: 96.7 -> 71.1
// us) and for a dot a thread on a short list (16.4 -> 12.2 us), the same on a full one. KT, the
// channels a step stages, was measured per tile at 32, 64 and 128 (graph-timed, H 64, R 512):
// the 2 x 2 tile is fastest at 32 (one row's full list 14.7 us, 15.8 at 64, 17.7 at 128, where it
// spills), the others within 3% of their best at 64.
#define MLA_SCORES(TH, TP, KT)                                                                     \
    extern "C" __global__ void __launch_bounds__(MEMRA_BLOCK, 2)                                   \
        mla_scores_h##TH##p##TP(const float* q, const float* latent, const int* positions,         \
                                float* scores, int H, int R, int W, float scale, int guard) {      \
        after_predecessor();                                                                       \
        mla_scores_regs<TH, TP, KT>(q, latent, positions, scores, H, R, W, scale, guard);          \
    }
MLA_SCORES(1, 1, 64)  // one dot a thread (mla.py score_tile says which tile a walk takes)
MLA_SCORES(2, 2, 32)
MLA_SCORES(4, 2, 64)

// grid (t * H), block MEMRA_BLOCK: scores -> probabilities in place; invalid entries get 0.
extern "C" __global__ void mla_softmax(float* scores, const int* positions, int H, int W) {
    after_predecessor();
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

#define MIX_HEADS 64  // heads per mla_mix pass: 8 warps of 8 heads
static_assert(MIX_HEADS == 8 * (MEMRA_BLOCK / 32), "mla_mix: a warp holds 8 heads of the pass");

// One mla_mix step's loads: the probabilities of heads h0.. and the latent channels kb.. of
// entries j0..j0+MIX_STEP (entry e of the split at ps[e]).
struct MixLoads {
    float p[MIX_HEADS * MIX_STEP / MEMRA_BLOCK];
    float c[MIX_STEP * MIX_CHANNELS / MEMRA_BLOCK];

    __device__ void load(const float* pr, const float* latent, const int* ps, int H, int R, int W,
                         int h0, int kb, int j0, int e0) {
#pragma unroll
        for (int i = 0; i < MIX_HEADS * MIX_STEP / MEMRA_BLOCK; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK, h = h0 + e / MIX_STEP, j = j0 + e % MIX_STEP;
            p[i] = h < H && j < W ? pr[(long long)h * W + j] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < MIX_STEP * MIX_CHANNELS / MEMRA_BLOCK; ++i) {
            const int e = threadIdx.x + i * MEMRA_BLOCK, pos = ps[e0 + e / MIX_CHANNELS];
            const int k = kb + e % MIX_CHANNELS;
            c[i] = pos >= 0 && k < R ? latent[(long long)pos * R + k] : 0.0f;
        }
    }
};

// grid (ceil(R / MIX_CHANNELS), ceil(W / split), t), block MEMRA_BLOCK: the partial sums of
// split s = blockIdx.y over its entries in order; split <= MIX_SPLIT, a multiple of MIX_STEP.
// Thread (warp w, lane l) holds heads 8 w .. 8 w + 7 of the pass and channels kb + 4 l .. + 3.
// filled [t, nsplit]: whether split s of row r has a selected entry (blocks x = 0 write it).
extern "C" __global__ void mla_mix(const float* probs, const float* latent, const int* positions,
                                   float* part, int* filled, int H, int R, int W, int split) {
    after_predecessor();
    __shared__ __align__(16) float cs[MIX_STEP][MIX_CHANNELS];
    __shared__ __align__(16) float pt[MIX_STEP][MIX_HEADS + 4];  // +4: float4 rows, fewer clashes
    __shared__ int ps[MIX_SPLIT];
    const int r = blockIdx.z, s = blockIdx.y, kb = blockIdx.x * MIX_CHANNELS;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, js = s * split;
    const int jn = min(split, W - js);
    const int* pos = positions + (long long)r * W;
    const float* pr = probs + (long long)r * H * W;
    bool any = false;
    if (threadIdx.x < MIX_SPLIT) {
        ps[threadIdx.x] = (int)threadIdx.x < jn ? pos[js + threadIdx.x] : -1;
        any = ps[threadIdx.x] >= 0;
    }
    any = __syncthreads_or(any);  // uniform
    if (blockIdx.x == 0 && threadIdx.x == 0) filled[r * gridDim.y + s] = any;
    if (!any) return;
    MixLoads next;
    for (int h0 = 0; h0 < H; h0 += MIX_HEADS) {
        float acc[8][4];
#pragma unroll
        for (int a = 0; a < 8; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) acc[a][b] = 0.0f;
        next.load(pr, latent, ps, H, R, W, h0, kb, js, 0);
        for (int e0 = 0; e0 < jn; e0 += MIX_STEP) {
            __syncthreads();  // the previous step is done with the tiles
#pragma unroll
            for (int i = 0; i < MIX_HEADS * MIX_STEP / MEMRA_BLOCK; ++i) {
                const int e = threadIdx.x + i * MEMRA_BLOCK;
                pt[e % MIX_STEP][e / MIX_STEP] = next.p[i];
            }
#pragma unroll
            for (int i = 0; i < MIX_STEP * MIX_CHANNELS / MEMRA_BLOCK; ++i) {
                const int e = threadIdx.x + i * MEMRA_BLOCK;
                cs[e / MIX_CHANNELS][e % MIX_CHANNELS] = next.c[i];
            }
            __syncthreads();
            const int e1 = e0 + MIX_STEP;
            if (e1 < jn) next.load(pr, latent, ps, H, R, W, h0, kb, js + e1, e1);  // in flight meanwhile
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
        const int nsplit = (W + split - 1) / split;
#pragma unroll
        for (int a = 0; a < 8; ++a) {
            const int h = h0 + 8 * warp + a;
            if (h >= H) continue;
            float* o = part + (((long long)r * nsplit + s) * H + h) * R;
#pragma unroll
            for (int b = 0; b < 4; ++b)
                if (kb + 4 * lane + b < R) o[kb + 4 * lane + b] = acc[a][b];
        }
    }
}

// grid blocks_of(t * H * R), thread = one output: the filled splits' partials added in split
// order (+0 when none is).
extern "C" __global__ void mla_mix_combine(const float* part, const int* filled, float* out, int t,
                                           int H, int R, int nsplit) {
    after_predecessor();
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long hr = (long long)H * R;
    if (id >= t * hr) return;
    const long long r = id / hr;
    const float* p = part + r * nsplit * hr + (id - r * hr);
    const int* f = filled + r * nsplit;
    float sum = 0.0f;
    bool first = true;
    for (int s = 0; s < nsplit; ++s) {
        if (!f[s]) continue;
        sum = first ? p[s * hr] : sum + p[s * hr];
        first = false;
    }
    out[id] = sum;
}
