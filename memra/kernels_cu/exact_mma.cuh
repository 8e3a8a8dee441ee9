// bf16 weight x float32 activation dot products on tensor cores, exactly (shared by dense.cu's
// projections and moe.cu's experts).
//
// A float32 activation is the exact sum of three bf16 pieces (each the truncation of what the
// previous ones left: 8 + 8 + 8 significand bits), and a bf16 weight times a bf16 piece is exact
// in the MMA's float32 accumulator. So W x is computed as mma(W, hi) + mma(W, mid) + mma(W, lo)
// per 16 in-features: the m16n8k16 MMA puts 16 weight rows (outputs) on M and 8 activation rows
// on N. Every output's accumulator sees the same MMA sequence whatever the row count t is (an
// MMA's column n depends only on column n of its operands; padded rows are separate columns),
// so row r of a t-row call is bit-identical to the row alone.
//
// Order: the block's SPLIT warps share its 16 J outputs; warp v takes the 32-wide in-feature
// blocks v, v + SPLIT, v + 2 SPLIT, ... (a fixed split size, never a split count), each block
// as k-step 0 then 1, each step as hi, mid, lo; the warps' partials are then added in warp order.
// Lane (g = lane / 4, q = lane % 4) loads 16 bytes of weight rows g and g + 8 at in-features
// kb + 8q .. kb + 8q + 7. MMA k-index 2q + i (i < 2) stands for in-feature kb + 8q + 4s + i and
// 2q + 8 + i for kb + 8q + 4s + 2 + i in k-step s, the same bijection for the weight (A) and
// activation (B) fragments, so each product meets its partner.
#pragma once

#define MMA_WARP 32
#define MMA_SPLIT 8                        // warps per block, each a fixed stride of in-features
#define MMA_THREADS (MMA_SPLIT * MMA_WARP)
#define MMA_KB 32                          // in-features per warp block: 16 bytes of bf16 per lane

static __device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                                unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 2W floats -> three bf16 pieces, packed two per word (element 2j in the low half of word j):
// v = hi + mid + lo exactly (each subtraction is exact; only magnitudes under ~1e-33 flush).
template <int W>
static __device__ __forceinline__ void split_pieces(const float (&v)[2 * W], unsigned (&p)[3][W]) {
#pragma unroll
    for (int j = 0; j < W; ++j) {
        unsigned bits[3][2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float a = v[2 * j + e];
            const unsigned hi = __float_as_uint(a) & 0xffff0000u;
            const float rest = a - __uint_as_float(hi);
            const unsigned mid = __float_as_uint(rest) & 0xffff0000u;
            bits[0][e] = hi;
            bits[1][e] = mid;
            bits[2][e] = __float_as_uint(rest - __uint_as_float(mid));
        }
#pragma unroll
        for (int piece = 0; piece < 3; ++piece)
            p[piece][j] = (bits[piece][0] >> 16) | (bits[piece][1] & 0xffff0000u);
    }
}

// 16 weight bytes. STREAM: read-only, no L1 line (a decode tile reads each weight byte once) and
// a 256-byte L2 fetch (the sectors the row's next k-steps read). Graph-timed at the bench shapes
// it took 2-5% off the projection tiles (bf16 and FP8) and the FP8 experts, same bits, and 18%
// off the bf16 experts' one-pass down tile (moe_passes.cuh); their gate|up tiles keep plain loads.
// volatile: an asm without it counts as reading no memory, so the compiler may run it ahead of
// the bounds test that guards it (the prefetching 16-row tile did: misaligned and out-of-range
// reads on odd shapes).
template <bool STREAM>
static __device__ __forceinline__ uint4 load_weights16(const void* p) {
    if constexpr (!STREAM) return *reinterpret_cast<const uint4*>(p);
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Eight bf16 weights of a row from in-feature k; zeros past n_in or for a missing row (null).
template <bool STREAM>
static __device__ __forceinline__ uint4 load_w8(const unsigned short* row, int k, int n_in, bool aligned) {
    if (row != nullptr && aligned && k + 8 <= n_in) return load_weights16<STREAM>(row + k);
    unsigned h[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = row != nullptr && k + j < n_in ? row[k + j] : 0u;
    return make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
}

// Eight activations of a row from in-feature k; zeros past n_in or for a padded row (null).
// FULL: the row is present and aligned and k + 8 <= n_in, so the load needs no check.
template <bool FULL = false>
static __device__ __forceinline__ void load_x8(const float* row, int k, int n_in, bool aligned, float (&v)[8]) {
    if (FULL || (row != nullptr && aligned && k + 8 <= n_in)) {
        const float4 a = *reinterpret_cast<const float4*>(row + k);
        const float4 b = *reinterpret_cast<const float4*>(row + k + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
    if constexpr (!FULL) {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = row != nullptr && k + j < n_in ? row[k + j] : 0.0f;
    }
}

static __device__ __forceinline__ unsigned word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// This lane's two rows of the 16-row weight block starting at row o: rows o + g and o + 8 + g
// (g = lane / 4), `stride` elements apart from w; nullptr past n_rows (read as zeros).
static __device__ __forceinline__ void mma_rows(const unsigned short* w, int o, int n_rows,
                                                long long stride, const unsigned short* (&rows)[2]) {
    const int g = threadIdx.x % MMA_WARP / 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = o + 8 * h + g;
        rows[h] = r < n_rows ? w + (long long)r * stride : nullptr;
    }
}

// A warp's accumulators (MMA C layout) set to +0.
template <int J, int NT>
static __device__ __forceinline__ void mma_zero(float (&acc)[J][NT][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][n][i] = 0.0f;
}

// One tile: tile[m][n] = w_m . x_n for the block's 16 J weight rows m and up to 8 NT activation
// rows n. Each lane passes its own operand rows: wrow[j][h] is weight row 16 j + 8 h + g and
// xrow[n] activation row 8 n + g (nullptr: a missing row, read as zeros). w_aligned / x_aligned:
// every passed row starts 16-byte aligned and the loads may be vectors. Call with all
// MMA_THREADS threads of the block (it synchronises); tile is ready when it returns.
template <int J, int NT>
struct MmaTile {
    float part[MMA_SPLIT][J][NT][4][MMA_WARP];
    float tile[16 * J][8 * NT];
};

template <int J, int NT>
static __device__ void mma_tile_reduce(const float (&acc)[J][NT][4], MmaTile<J, NT>& sh);

// One k-block of a lane: its 16-byte weight loads and its NT rows' 8 activations at kb.
template <int J, int NT, bool STREAM>
static __device__ __forceinline__ void mma_loads(const unsigned short* const (&wrow)[J][2],
                                                 const float* const (&xrow)[NT], int kb, int n_in,
                                                 bool w_aligned, bool x_aligned, uint4 (&wv)[J][2],
                                                 float (&xv)[NT][8]) {
    const int q = threadIdx.x % MMA_WARP % 4;
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[j][h] = load_w8<STREAM>(wrow[j][h], kb + 8 * q, n_in, w_aligned);
#pragma unroll
    for (int n = 0; n < NT; ++n) load_x8(xrow[n], kb + 8 * q, n_in, x_aligned, xv[n]);
}

// One activation column's MMAs of a k-block from its pieces' words p (split_pieces of the
// lane's 8 activations), k-step 0 then 1, each step as hi, mid, lo (the order the header states).
template <int J, int NT>
static __device__ __forceinline__ void mma_pieces(float (&acc)[J][NT][4], const uint4 (&wv)[J][2], int n,
                                                  const unsigned (&p)[3][4]) {
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int piece = 0; piece < 3; ++piece)
#pragma unroll
            for (int j = 0; j < J; ++j)
                mma_bf16(acc[j][n], word(wv[j][0], 2 * s), word(wv[j][1], 2 * s), word(wv[j][0], 2 * s + 1),
                         word(wv[j][1], 2 * s + 1), p[piece][2 * s], p[piece][2 * s + 1]);
}

// One k-block's MMAs: each activation row split into its pieces, then mma_pieces.
template <int J, int NT>
static __device__ __forceinline__ void mma_step(float (&acc)[J][NT][4], const uint4 (&wv)[J][2],
                                                const float (&xv)[NT][8]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        unsigned p[3][4];
        split_pieces(xv[n], p);
        mma_pieces<J, NT>(acc, wv, n, p);
    }
}

template <typename T>
static __device__ __forceinline__ const T* lane0_row(const T* row) {
    return reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row), 0));
}

// The pieces' words of a tile with one activation row (lane 0's): lane l splits in-feature kb + l
// alone into shared memory, then lanes q < 4 (lane group 0, the row's B column) read words
// 8q .. 8q + 7 of each piece: what split_pieces packs from the same 8 activations (element 2i in
// the low half of word i), so the same bits, for a 32nd of the splitting a lane did. The other
// lane groups are the padded columns: zeros, as a missing row reads.
static __device__ __forceinline__ void one_row_pieces(const float* row, int kb, unsigned short (&stage)[3][MMA_KB],
                                                      unsigned (&p)[3][4]) {
    const int lane = threadIdx.x % MMA_WARP;
    const float a = row[kb + lane];
    const unsigned hi = __float_as_uint(a) & 0xffff0000u;
    const float rest = a - __uint_as_float(hi);
    const unsigned mid = __float_as_uint(rest) & 0xffff0000u;
    const unsigned lo = __float_as_uint(rest - __uint_as_float(mid));
    __syncwarp();  // every lane has read the previous k-block's words
    stage[0][lane] = hi >> 16;
    stage[1][lane] = mid >> 16;
    stage[2][lane] = lo >> 16;
    __syncwarp();
#pragma unroll
    for (int piece = 0; piece < 3; ++piece) {
        const uint4 w = lane < 4 ? *reinterpret_cast<const uint4*>(&stage[piece][8 * lane]) : make_uint4(0, 0, 0, 0);
        p[piece][0] = w.x; p[piece][1] = w.y; p[piece][2] = w.z; p[piece][3] = w.w;
    }
}

// STREAM: the kind of the weight loads (load_weights16); the bf16 gate|up expert tiles pass false.
// PREFETCH: a k-block's loads are issued before the previous block's MMAs, so a warp keeps two
// blocks in flight (the projection groups' 16-row tiles at 9 to 16 rows, the same bits); the
// other tiles keep one (with two, their extra registers cost blocks an SM and the experts ran
// 7-40% slower at 1, 8 and 15 rows).
// ONE (NT = 1, no PREFETCH): a tile whose only activation row is lane 0's, whose weight rows are
// all present and 16-byte aligned and whose in-features are whole k-blocks splits that row once
// a k-block for the warp (one_row_pieces) and loads its weights unchecked; any other tile runs
// the checked loop. Graph-timed at the bench shapes, the same bits: a one-row projection group
// 1-9% faster, the experts 4% at 1 row and 2% at 8 (most of 8 rows' experts serve one row).
template <int J, int NT, bool STREAM = true, bool PREFETCH = false, bool ONE = false>
static __device__ void mma_tile(const unsigned short* const (&wrow)[J][2], const float* const (&xrow)[NT],
                                int n_in, bool w_aligned, bool x_aligned, MmaTile<J, NT>& sh) {
    static_assert(!ONE || (NT == 1 && !PREFETCH), "a one-row tile has one activation column and one k-block in flight");
    const int warp = threadIdx.x / MMA_WARP, stride = MMA_SPLIT * MMA_KB;
    float acc[J][NT][4];
    mma_zero<J, NT>(acc);
    uint4 wv[J][2];
    float xv[NT][8];
    if constexpr (PREFETCH) {
        mma_loads<J, NT, STREAM>(wrow, xrow, warp * MMA_KB, n_in, w_aligned, x_aligned, wv, xv);
        for (int kb = warp * MMA_KB; kb < n_in; kb += stride) {
            uint4 wn[J][2];
            float xn[NT][8];  // past n_in: zeros, never used
            mma_loads<J, NT, STREAM>(wrow, xrow, kb + stride, n_in, w_aligned, x_aligned, wn, xn);
            mma_step<J, NT>(acc, wv, xv);
#pragma unroll
            for (int j = 0; j < J; ++j) wv[j][0] = wn[j][0], wv[j][1] = wn[j][1];
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 8; ++e) xv[n][e] = xn[n][e];
        }
    } else {
        if constexpr (ONE) {
            bool present = true;
#pragma unroll
            for (int j = 0; j < J; ++j) present = present && wrow[j][0] != nullptr && wrow[j][1] != nullptr;
            const float* x0 = lane0_row(xrow[0]);
            const bool lone = threadIdx.x % MMA_WARP < 4 || xrow[0] == nullptr;  // lane group 0 or a padded column
            if (__all_sync(0xffffffffu, present && lone) && x0 != nullptr && w_aligned && n_in % MMA_KB == 0) {
                __shared__ __align__(16) unsigned short stage[MMA_SPLIT][3][MMA_KB];
                const int q = threadIdx.x % MMA_WARP % 4;
                for (int kb = warp * MMA_KB; kb < n_in; kb += stride) {
#pragma unroll
                    for (int j = 0; j < J; ++j)
#pragma unroll
                        for (int h = 0; h < 2; ++h) wv[j][h] = load_weights16<STREAM>(wrow[j][h] + kb + 8 * q);
                    unsigned p[3][4];
                    one_row_pieces(x0, kb, stage[warp], p);
                    mma_pieces<J, NT>(acc, wv, 0, p);
                }
                mma_tile_reduce<J, NT>(acc, sh);
                return;
            }
        }
        for (int kb = warp * MMA_KB; kb < n_in; kb += stride) {
            mma_loads<J, NT, STREAM>(wrow, xrow, kb, n_in, w_aligned, x_aligned, wv, xv);
            mma_step<J, NT>(acc, wv, xv);
        }
    }
    mma_tile_reduce<J, NT>(acc, sh);
}

// The block's warp partials acc (MMA C layout) into sh.tile, added in warp order (mma_tile and
// the FP8 tile of exact_mma_fp8.cuh end here). Call with all MMA_THREADS threads of the block.
template <int J, int NT>
static __device__ void mma_tile_reduce(const float (&acc)[J][NT][4], MmaTile<J, NT>& sh) {
    const int lane = threadIdx.x % MMA_WARP, warp = threadIdx.x / MMA_WARP;
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) sh.part[warp][j][n][i][lane] = acc[j][n][i];
    __syncthreads();
    // slot (j, n, i, l) of the MMA's C layout: weight row 16 j + l / 4 + 8 (i / 2),
    // activation row 8 n + 2 (l % 4) + i % 2; the SPLIT partials added in warp order
    for (int slot = threadIdx.x; slot < J * NT * 4 * MMA_WARP; slot += MMA_THREADS) {
        const int l = slot % MMA_WARP, i = (slot / MMA_WARP) % 4;
        const int n = (slot / (4 * MMA_WARP)) % NT, j = slot / (4 * MMA_WARP * NT);
        float sum = sh.part[0][j][n][i][l];
        for (int v = 1; v < MMA_SPLIT; ++v) sum += sh.part[v][j][n][i][l];
        sh.tile[16 * j + l / 4 + 8 * (i >> 1)][8 * n + 2 * (l % 4) + (i & 1)] = sum;
    }
    __syncthreads();
}
