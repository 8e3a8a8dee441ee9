// A prompt's delta-rule scan in chunks of KDA_CHUNK rows (prime class: accurate, not row
// invariant). Semantics: NumpyBackend.kda_chunks, chunk_pieces, chunk_step (backend/numpy_kda.py).
// Two launches per span of chunks (backend/cuda/kda_chunks.py):
//  kda_chunk_prep, a block per (chunk, head): the pieces that do not depend on the state at the
//    chunk's start (W, U0, Qm, Qtil, Khat, decay), every chunk at once;
//  kda_chunk_scan, a block per (32 value columns, head): walks the chunks in order with its
//    [dk, 32] slice of the state in registers; per chunk u = U0 - W S, o = Qtil S + Qm u,
//    S = decay S + Khat^T u. The row walk's 16 dependent steps per chunk become one.
// Pieces of a span, chunk ci (from the span's first), head h: w, qtil, khat [ci, h, C, dk];
// u0 [ci, h, C, dv]; qm [ci, h, C, C] (lower triangle and diagonal); decay [ci, h, dk].
// Rows past the prompt's end are zero rows with g = 0 and beta = 0, which leave S as it is.
#include "common.cuh"

static_assert(KDA_CHUNK_MAX_DK % 32 == 0 && KDA_CHUNK_MAX_DK <= MEMRA_BLOCK, "whole warps of keys");
static_assert(KDA_SCAN_KEYS % 4 == 0 && KDA_CHUNK_MAX_DK % KDA_SCAN_KEYS == 0, "float4 reads of whole key groups");

constexpr int CH = KDA_CHUNK;
constexpr int MAX_DK = KDA_CHUNK_MAX_DK;
constexpr int TILE = 32;                  // value columns per scan block: one per lane
constexpr int KEYS = KDA_SCAN_KEYS;       // a scan warp holds KEYS keys of its lanes' columns
constexpr int SCAN_WARPS = MAX_DK / KEYS;
constexpr int SCAN_THREADS = 32 * SCAN_WARPS;

// q, k, g [t, Hk, dk]; v [t, Hk, dv]; beta [t, Hk]. Grid (chunks of the span, Hk), MEMRA_BLOCK
// threads. G (the chunk's cumulative g) is kept as hi + lo by two-sum, so a difference G_r - G_j
// is accurate relative to itself, not to |G|; every exponent is <= 0.
extern "C" __global__ void __launch_bounds__(MEMRA_BLOCK, 3)
kda_chunk_prep(const float* __restrict__ q, const float* __restrict__ k,
                                          const float* __restrict__ v, const float* __restrict__ g,
                                          const float* __restrict__ beta, float* __restrict__ w,
                                          float* __restrict__ u0, float* __restrict__ qm,
                                          float* __restrict__ qtil, float* __restrict__ khat,
                                          float* __restrict__ decay, int row0, int t, int hk, int dk, int dv) {
    after_predecessor();
    __shared__ float sq[CH][MAX_DK], sk[CH][MAX_DK], hi[CH][MAX_DK], lo[CH][MAX_DK];
    __shared__ float sb[CH], sa[CH][CH];
    const int ci = blockIdx.x, h = blockIdx.y;
    const int first = row0 + ci * CH, n = min(CH, t - first);
    const long long piece = (long long)ci * hk + h;
    auto at = [&](int r, int width) { return ((long long)(first + r) * hk + h) * width; };
    for (int idx = threadIdx.x; idx < CH * dk; idx += blockDim.x) {
        const int r = idx / dk, d = idx % dk;
        sq[r][d] = r < n ? q[at(r, dk) + d] : 0.0f;
        sk[r][d] = r < n ? k[at(r, dk) + d] : 0.0f;
    }
    if (threadIdx.x < CH) sb[threadIdx.x] = (int)threadIdx.x < n ? beta[at(threadIdx.x, 1)] : 0.0f;
    for (int d = threadIdx.x; d < dk; d += blockDim.x) {
        float acc = 0.0f, err = 0.0f;
        for (int r = 0; r < CH; ++r) {
            const float x = r < n ? g[at(r, dk) + d] : 0.0f;
            const float total = acc + x, back = total - acc;
            err = err + ((acc - (total - back)) + (x - back));
            acc = total;
            hi[r][d] = acc;
            lo[r][d] = err;
        }
    }
    __syncthreads();
    // A and Qm: a warp per pair j <= r (p = r (r + 1) / 2 + j), lanes over the keys; (r, j)
    // follows p forward (j past r wraps into the next rows) instead of being searched anew
    const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int p = threadIdx.x / 32, r = 0, j = p; p < CH * (CH + 1) / 2; p += warps) {
        for (; j > r; ++r) j -= r + 1;
        float kk = 0.0f, qk = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DK / 32; ++i) {  // unrolled: the keys' loads and exponentials fly together
            const int d = lane + 32 * i;
            if (d >= dk) break;
            const float e = expf(fminf((hi[r][d] - hi[j][d]) + (lo[r][d] - lo[j][d]), 0.0f));
            const float kj = sk[j][d] * e;
            kk = fmaf(sk[r][d], kj, kk);
            qk = fmaf(sq[r][d], kj, qk);
        }
        kk = warp_xor_sum(kk);
        qk = warp_xor_sum(qk);
        if (lane == 0) {
            sa[r][j] = j < r ? sb[r] * kk : 0.0f;
            qm[piece * CH * CH + r * CH + j] = qk;
        }
        j += warps;
    }
    for (int idx = threadIdx.x; idx < CH * CH; idx += blockDim.x)
        if (idx % CH > idx / CH) qm[piece * CH * CH + idx] = 0.0f;
    __syncthreads();
    // W and U0 by forward substitution, a thread per column: X_r = beta_r B_r - sum_j<r A[r, j] X_j.
    // B is read whole first (its loads fly together), then solved in place.
    for (int col = threadIdx.x; col < dk + dv; col += blockDim.x) {
        float x[CH];
        if (col < dk) {
#pragma unroll
            for (int r = 0; r < CH; ++r) x[r] = expf(hi[r][col]) * (1.0f + lo[r][col]) * sk[r][col];
        } else {
#pragma unroll
            for (int r = 0; r < CH; ++r) x[r] = r < n ? v[at(r, dv) + (col - dk)] : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < CH; ++r) {
            float acc = sb[r] * x[r];
#pragma unroll
            for (int j = 0; j < r; ++j) acc = fmaf(-sa[r][j], x[j], acc);
            x[r] = acc;
            asm volatile("" ::: "memory");  // row by row: hoisting every A load spills
        }
        float* dst = col < dk ? w + piece * CH * dk + col : u0 + piece * CH * dv + (col - dk);
        const int stride = col < dk ? dk : dv;
#pragma unroll
        for (int r = 0; r < CH; ++r) dst[r * stride] = x[r];
    }
    for (int idx = threadIdx.x; idx < CH * dk; idx += blockDim.x) {
        const int r = idx / dk, d = idx % dk;
        qtil[piece * CH * dk + idx] = expf(hi[r][d]) * (1.0f + lo[r][d]) * sq[r][d];
        khat[piece * CH * dk + idx] =
            expf(fminf((hi[CH - 1][d] - hi[r][d]) + (lo[CH - 1][d] - lo[r][d]), 0.0f)) * sk[r][d];
    }
    for (int d = threadIdx.x; d < dk; d += blockDim.x)
        decay[piece * dk + d] = expf(hi[CH - 1][d]) * (1.0f + lo[CH - 1][d]);
}

// One chunk's pieces in a scan block's shared memory: W, Qtil, Khat rows [CH][MAX_DK], the
// block's U0 columns [CH][TILE], Qm [CH][CH], decay [MAX_DK]. The scan holds two, so the next
// chunk's copy (cp.async) flies while this one is used.
constexpr int STAGE_W = 0, STAGE_Q = CH * MAX_DK, STAGE_K = 2 * CH * MAX_DK, STAGE_U = 3 * CH * MAX_DK;
constexpr int STAGE_QM = STAGE_U + CH * TILE, STAGE_DECAY = STAGE_QM + CH * CH;
constexpr int STAGE_FLOATS = STAGE_DECAY + MAX_DK;

// 4 bytes global -> shared without a register; ok false writes a zero instead (padding)
static __device__ __forceinline__ void copy_async(float* dst, const float* src, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 4 : 0));
}

static __device__ __forceinline__ void stage_chunk(float* st, const float* __restrict__ w,
                                                   const float* __restrict__ u0, const float* __restrict__ qm,
                                                   const float* __restrict__ qtil,
                                                   const float* __restrict__ khat,
                                                   const float* __restrict__ decay, long long piece, int c0,
                                                   int dk, int dv) {
    for (int idx = threadIdx.x; idx < CH * MAX_DK; idx += blockDim.x) {
        const int r = idx / MAX_DK, d = idx % MAX_DK;
        const bool ok = d < dk;
        const long long src = ok ? (piece * CH + r) * dk + d : 0;
        copy_async(st + STAGE_W + idx, w + src, ok);
        copy_async(st + STAGE_Q + idx, qtil + src, ok);
        copy_async(st + STAGE_K + idx, khat + src, ok);
    }
    for (int idx = threadIdx.x; idx < CH * TILE; idx += blockDim.x) {
        const int r = idx / TILE, col = idx % TILE;
        const bool ok = c0 + col < dv;
        copy_async(st + STAGE_U + idx, u0 + (ok ? (piece * CH + r) * dv + c0 + col : 0), ok);
    }
    for (int idx = threadIdx.x; idx < CH * CH; idx += blockDim.x)
        copy_async(st + STAGE_QM + idx, qm + piece * CH * CH + idx, true);
    for (int d = threadIdx.x; d < MAX_DK; d += blockDim.x)
        copy_async(st + STAGE_DECAY + d, decay + (d < dk ? piece * dk + d : 0), d < dk);
    asm volatile("cp.async.commit_group;\n" ::);
}

// state [Hk, dk, dv] advances in place over the span's nc chunks; out [t, Hk, dv]. Grid
// (ceil(dv / 32), Hk), SCAN_THREADS threads, SCAN_SHARED bytes of dynamic shared memory (two
// stages): lane = value column, warp = KEYS keys, so S stays in registers and W S0, Qtil S0 are
// warp-partial sums (shared W / Qtil rows broadcast as float4) added over the warps in a fixed
// order. Three barriers a chunk: its copies landed (and the previous chunk is done with the
// stage the next copy takes), the partial sums written, u and Qtil S0 summed.
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
kda_chunk_scan(const float* __restrict__ w, const float* __restrict__ u0, const float* __restrict__ qm,
               const float* __restrict__ qtil, const float* __restrict__ khat, const float* __restrict__ decay,
               float* __restrict__ state, float* __restrict__ out, int row0, int nc, int t, int hk,
               int dk, int dv) {
    after_predecessor();
    extern __shared__ __align__(16) float stages[];  // 2 * STAGE_FLOATS
    __shared__ float sp[CH][TILE];                    // Qtil S0
    __shared__ float partial[SCAN_WARPS][2 * CH][TILE];
    static_assert(CH % SCAN_WARPS == 0 && (2 * CH * TILE) % SCAN_THREADS == 0, "whole rows a warp, whole sums a thread");
    constexpr int OUT_ROWS = CH / SCAN_WARPS;  // output rows a thread: warp, warp + SCAN_WARPS, ...
    const int h = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int c0 = blockIdx.x * TILE, c = c0 + lane, d0 = warp * KEYS;
    const bool keys = d0 < dk;  // warp-uniform
    float* sh = state + (long long)h * dk * dv;
    float s[KEYS];
#pragma unroll
    for (int i = 0; i < KEYS; ++i) s[i] = c < dv && d0 + i < dk ? sh[(long long)(d0 + i) * dv + c] : 0.0f;
    stage_chunk(stages, w, u0, qm, qtil, khat, decay, h, c0, dk, dv);
    for (int ci = 0; ci < nc; ++ci) {
        float* st = stages + (ci & 1) * STAGE_FLOATS;
        asm volatile("cp.async.wait_group 0;\n" ::);  // this chunk's copies, the one group in flight
        __syncthreads();  // ... landed for every thread; every thread is past the previous chunk
        if (ci + 1 < nc)
            stage_chunk(stages + ((ci + 1) & 1) * STAGE_FLOATS, w, u0, qm, qtil, khat, decay,
                        (long long)(ci + 1) * hk + h, c0, dk, dv);
        const float* wq = st + STAGE_W;  // W rows then Qtil rows
        const float* kh = st + STAGE_K;
        const float* sdecay = st + STAGE_DECAY;
        float* su = st + STAGE_U;  // U0, then u = U0 - W S0 in place
        const float* sqm = st + STAGE_QM;
        // rows 0 .. CH-1: (W S0)[r, c]; rows CH .. 2CH-1: (Qtil S0)[r - CH, c], over this warp's keys
        float acc[2 * CH];
#pragma unroll
        for (int r = 0; r < 2 * CH; ++r) acc[r] = 0.0f;
        if (keys) {
#pragma unroll
            for (int i = 0; i < KEYS; i += 4) {
#pragma unroll
                for (int r = 0; r < 2 * CH; ++r) {
                    const float4 a = *reinterpret_cast<const float4*>(&wq[r * MAX_DK + d0 + i]);
                    acc[r] = fmaf(a.x, s[i], acc[r]);
                    acc[r] = fmaf(a.y, s[i + 1], acc[r]);
                    acc[r] = fmaf(a.z, s[i + 2], acc[r]);
                    acc[r] = fmaf(a.w, s[i + 3], acc[r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 2 * CH; ++r) partial[warp][r][lane] = acc[r];
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 2 * CH * TILE / SCAN_THREADS; ++i) {
            const int idx = threadIdx.x + i * SCAN_THREADS, r = idx / TILE, col = idx % TILE;
            float sum = 0.0f;
#pragma unroll
            for (int ww = 0; ww < SCAN_WARPS; ++ww) sum += partial[ww][r][col];
            if (r < CH) su[r * TILE + col] = su[r * TILE + col] - sum;  // u = U0 - W S0
            else sp[r - CH][col] = sum;                                 // Qtil S0
        }
        __syncthreads();
        // o = Qtil S0 + Qm u, Qm's upper triangle zero: each row's terms in the order j = 0, 1, ..
        float o[OUT_ROWS];
#pragma unroll
        for (int m = 0; m < OUT_ROWS; ++m) o[m] = sp[warp + m * SCAN_WARPS][lane];
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            const float uj = su[j * TILE + lane];
#pragma unroll
            for (int m = 0; m < OUT_ROWS; ++m) o[m] = fmaf(sqm[(warp + m * SCAN_WARPS) * CH + j], uj, o[m]);
        }
#pragma unroll
        for (int m = 0; m < OUT_ROWS; ++m) {
            const int row = row0 + ci * CH + warp + m * SCAN_WARPS;
            if (row < t && c < dv) out[((long long)row * hk + h) * dv + c] = o[m];
        }
        if (keys) {  // S = decay S + Khat^T u on this thread's KEYS keys of column c
            float uc[CH];
#pragma unroll
            for (int j = 0; j < CH; ++j) uc[j] = su[j * TILE + lane];
#pragma unroll
            for (int i = 0; i < KEYS; i += 4) {
                const float4 dc = *reinterpret_cast<const float4*>(&sdecay[d0 + i]);
                float n0 = dc.x * s[i], n1 = dc.y * s[i + 1], n2 = dc.z * s[i + 2], n3 = dc.w * s[i + 3];
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    const float4 kv = *reinterpret_cast<const float4*>(&kh[j * MAX_DK + d0 + i]);
                    n0 = fmaf(kv.x, uc[j], n0);
                    n1 = fmaf(kv.y, uc[j], n1);
                    n2 = fmaf(kv.z, uc[j], n2);
                    n3 = fmaf(kv.w, uc[j], n3);
                }
                s[i] = n0;
                s[i + 1] = n1;
                s[i + 2] = n2;
                s[i + 3] = n3;
            }
        }
    }
    if (c >= dv) return;
#pragma unroll
    for (int i = 0; i < KEYS; ++i)
        if (d0 + i < dk) sh[(long long)(d0 + i) * dv + c] = s[i];
}
