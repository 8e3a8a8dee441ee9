// FP8 (e4m3, 128 x 128 block scales) weight x float32 activation dot products on tensor cores, in
// the FP8 exact class (docs/fp8.md; shared by dense.cu's projection and moe.cu's experts).
//
// Each e4m3 weight widens exactly to bf16 in registers (every e4m3 value has <= 4 significant bits
// and lies in [2^-9, 448]), so the bf16 machinery of exact_mma.cuh applies unchanged: three exact
// bf16 pieces per float32 activation, m16n8k16 MMAs, 16 weight rows on M and 8 activation rows on N.
// What FP8 adds is the block structure: every FP8_BLOCK in-features get a FRESH accumulator
// (the block partial), which is multiplied by the block's scale and added to the running sum.
//
// Order: warp v of the block takes the FP8_BLOCK-wide in-feature blocks v, v + SPLIT, ... in
// ascending order; inside a block each piece has its own accumulator, fed k-steps 0..7 (16
// in-features each) in order, and the block partial is (hi + mid) + lo; the warps' running sums
// are added in warp order (MmaTile, as for bf16). All of it depends on n_in only, never on t, so
// row r of a t-row call is bit-identical to the row alone.
// Loads: lane (g = lane / 4, q = lane % 4) reads 16 bytes of each of its weight rows per 64-wide
// half block: in-features h0 + 16 q .. h0 + 16 q + 15, both halves loaded before the block's
// first MMA. In k-step s of a half, with c = h0 + 16 q + 4 s, MMA k-indices 2q, 2q + 1 stand for
// in-features c, c + 2 and 2q + 8, 2q + 9 for c + 1, c + 3 (the pairs that one 32-bit word of
// bytes widens into most cheaply, see e4m3x4_to_bf16x2), the same bijection for weights and
// activations.
#pragma once

#include "constants.cuh"
#include "exact_mma.cuh"

static_assert(FP8_BLOCK == 128, "a block is two 64-wide halves of 16-byte loads per lane");

// bf16x2 v times 2^120, exactly (bf16 2^120 is 0x7B80; adding -0 keeps every sign, +0 and -0 too).
static __device__ __forceinline__ unsigned times_2_120(unsigned v) {
    unsigned out;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(v), "r"(0x7B807B80u), "r"(0x80008000u));
    return out;
}

// The two bytes of x that selector names, each sign-extended to a 16-bit half: prmt's sign mode
// (a selector nibble 8 + i fills its byte with byte i's top bit).
static __device__ __forceinline__ unsigned sign_extended_pair(unsigned x, unsigned selector) {
    unsigned out;
    asm("prmt.b32 %0, %1, %1, %2;" : "=r"(out) : "r"(x), "r"(selector));
    return out;
}

// Four e4m3 bytes (byte i: in-feature c + i) -> bf16x2 words (c, c + 2) and (c + 1, c + 3), low
// half first, exactly. A byte b sign-extended to 16 bits and shifted left by 4 holds b's sign at
// bit 15 (and 11..14) and its 7 exponent|mantissa bits at 4..10; keeping bits 15 and 4..10
// (0x87F0) makes a bf16 worth the e4m3 value times 2^-120 (biases 7 and 127; an e4m3 subnormal
// lands on the bf16 subnormal of the same scaled value), which times_2_120 restores. The mask
// also drops what the low half shifts into the high one. Load refuses the NaN codes 0x7F / 0xFF
// (checkpoint_fp8.py), so no code here needs them.
static __device__ __forceinline__ void e4m3x4_to_bf16x2(unsigned x, unsigned& even, unsigned& odd) {
    even = times_2_120((sign_extended_pair(x, 0xA280u) << 4) & 0x87f087f0u);  // bytes 0, 2
    odd = times_2_120((sign_extended_pair(x, 0xB391u) << 4) & 0x87f087f0u);   // bytes 1, 3
}

// Sixteen e4m3 bytes of a row from in-feature k (zeros past n_in or for a missing row), raw.
// FULL as for load_x8.
template <bool FULL>
static __device__ __forceinline__ uint4 load_b16(const unsigned char* row, int k, int n_in, bool aligned) {
    if (FULL || (row != nullptr && aligned && k + 16 <= n_in)) return load_weights16<true>(row + k);
    unsigned b[4] = {0u, 0u, 0u, 0u};
    for (int j = 0; j < 16; ++j)
        if (row != nullptr && k + j < n_in) b[j / 4] |= (unsigned)row[k + j] << (8 * (j % 4));
    return make_uint4(b[0], b[1], b[2], b[3]);
}

// Eight activations in the k-order above: (x0, x2, x1, x3, x4, x6, x5, x7), so split_pieces packs
// the words (x0, x2), (x1, x3), (x4, x6), (x5, x7) that meet the widened weight words.
template <bool FULL>
static __device__ __forceinline__ void load_x8_fp8(const float* row, int k, int n_in, bool aligned, float (&v)[8]) {
    float a[8];
    load_x8<FULL>(row, k, n_in, aligned, a);
#pragma unroll
    for (int i = 0; i < 8; i += 4) {
        v[i] = a[i];
        v[i + 1] = a[i + 2];
        v[i + 2] = a[i + 1];
        v[i + 3] = a[i + 3];
    }
}

// This lane's two rows of the 16-row FP8 weight block starting at row o (see mma_rows), and that
// block's row of scales (nullptr past n_rows): the 16 rows share one scale row, as o % 16 == 0.
static __device__ __forceinline__ void mma_rows_fp8(const unsigned char* w, const float* scale, int o,
                                                    int n_rows, long long stride, long long scale_stride,
                                                    const unsigned char* (&rows)[2], const float*& srow) {
    const int g = threadIdx.x % MMA_WARP / 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = o + 8 * h + g;
        rows[h] = r < n_rows ? w + (long long)r * stride : nullptr;
    }
    srow = o < n_rows ? scale + (long long)(o / FP8_BLOCK) * scale_stride : nullptr;
}

// A warp's staged activation words: [16-wide group u][piece][word] of one block of one row, the
// words in the k-order above (word 2i: in-features 4i, 4i + 2 of the group, 2i + 1: 4i + 1, 4i + 3).
typedef unsigned Fp8Stage[FP8_BLOCK / 16][3][8];

// Lane l splits in-features kb + 4 l .. kb + 4 l + 3 of row (aligned, all present) into its two
// words of each piece; then every lane may read any word of the block.
static __device__ __forceinline__ void stage_row(const float* row, int kb, Fp8Stage& stage) {
    const int lane = threadIdx.x % MMA_WARP;
    const float4 a = *reinterpret_cast<const float4*>(row + kb + 4 * lane);
    const float v[4] = {a.x, a.z, a.y, a.w};
    unsigned p[3][2];
    split_pieces(v, p);
    __syncwarp();  // every lane is done reading the previous block's words
#pragma unroll
    for (int piece = 0; piece < 3; ++piece)
        *reinterpret_cast<uint2*>(&stage[lane / 4][piece][2 * (lane % 4)]) = make_uint2(p[piece][0], p[piece][1]);
    __syncwarp();
}

// The block partial of weight rows (g, g + 8) from its pieces' sums (MMA C layout: part[piece][i]
// holds weight row g + 8 (i / 2), column 2q + i % 2): (hi + mid) + lo, the order of the header.
// ONE: the pieces are B columns 0, 1, 2 of one accumulator, so lane q = 0 holds hi and mid of
// its rows and lane q = 1 their lo; slots 0 and 2 of lane q = 0 get the partials (column 0, the
// tile's one row), every other slot something never stored.
template <bool ONE>
static __device__ __forceinline__ void block_partial(const float (&part)[ONE ? 1 : 3][4], float (&out)[4]) {
    if constexpr (ONE) {
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
            const float lo = __shfl_down_sync(0xffffffffu, part[0][i], 1);
            out[i] = out[i + 1] = (part[0][i] + part[0][i + 1]) + lo;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) out[i] = (part[0][i] + part[1][i]) + part[2][i];
    }
}

// The lane's MMAs over its blocks into acc (see mma_tile_fp8). FULL: every operand row present
// and aligned and n_in a multiple of FP8_BLOCK, so no load checks anything. ONE (FULL, NT = 1):
// the tile has one activation row (lane 0's), staged once a block by the warp into shared memory
// (instead of split by every lane group g for its own B column, 7 of 8 of them padded), and its
// three pieces ride in B columns 0, 1, 2 of ONE MMA per k-step (lane group g reads piece g; the
// groups past 2 repeat hi, never kept) where a tile of more rows runs three, one per piece, each
// into its own accumulator: a column's sums depend on that column's operands only, so both give
// every piece's sum the same bits, and a one-row tile runs a third of the MMAs.
template <int J, int NT, bool FULL, bool ONE = false>
static __device__ __forceinline__ void mma_steps_fp8(const unsigned char* const (&wrow)[J][2],
                                                     const float* const (&srow)[J], const float* const (&xrow)[NT],
                                                     int n_in, bool w_aligned, bool x_aligned,
                                                     float (&acc)[J][NT][4], Fp8Stage* stage = nullptr) {
    static_assert(!ONE || (FULL && NT == 1), "a staged tile is whole and has one activation column");
    constexpr int P = ONE ? 1 : 3;  // accumulators per (j, n): the pieces' sums, apart
    const int q = threadIdx.x % MMA_WARP % 4, g = threadIdx.x % MMA_WARP / 4, warp = threadIdx.x / MMA_WARP;
    for (int kb = warp * FP8_BLOCK; kb < n_in; kb += MMA_SPLIT * FP8_BLOCK) {
        float part[J][NT][P][4];
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int piece = 0; piece < P; ++piece)
#pragma unroll
                    for (int i = 0; i < 4; ++i) part[j][n][piece][i] = 0.0f;
        uint4 raw[2][J][2];  // the whole block's bytes in flight before the first MMA: [half][j][h]
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int j = 0; j < J; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    raw[half][j][h] = load_b16<FULL>(wrow[j][h], kb + 64 * half + 16 * q, n_in, w_aligned);
        if constexpr (ONE) stage_row(xrow[0], kb, *stage);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int k = kb + 64 * half + 16 * q;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                unsigned pa[P][4], pb[P][4];
                if constexpr (ONE) {
                    const uint4* words = reinterpret_cast<const uint4*>((*stage)[4 * half + q][g < 3 ? g : 0]);
                    const uint4 a = words[0], b = words[1];
                    pa[0][0] = a.x; pa[0][1] = a.y; pa[0][2] = a.z; pa[0][3] = a.w;
                    pb[0][0] = b.x; pb[0][1] = b.y; pb[0][2] = b.z; pb[0][3] = b.w;
                } else {
                    float xa[8], xb[8];
                    load_x8_fp8<FULL>(xrow[n], k, n_in, x_aligned, xa);
                    load_x8_fp8<FULL>(xrow[n], k + 8, n_in, x_aligned, xb);
                    split_pieces(xa, pa);
                    split_pieces(xb, pb);
                }
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    unsigned wv[J][2][2];  // word 0: in-features (c, c + 2), word 1: (c + 1, c + 3)
#pragma unroll
                    for (int j = 0; j < J; ++j)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            e4m3x4_to_bf16x2(word(raw[half][j][h], s), wv[j][h][0], wv[j][h][1]);
#pragma unroll
                    for (int piece = 0; piece < P; ++piece) {
                        const unsigned b0 = s < 2 ? pa[piece][2 * s] : pb[piece][2 * s - 4];
                        const unsigned b1 = s < 2 ? pa[piece][2 * s + 1] : pb[piece][2 * s - 3];
#pragma unroll
                        for (int j = 0; j < J; ++j)
                            mma_bf16(part[j][n][piece], wv[j][0][0], wv[j][1][0], wv[j][0][1], wv[j][1][1], b0, b1);
                    }
                }
            }
        }
        const int b = kb / FP8_BLOCK;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const float sc = FULL || srow[j] != nullptr ? srow[j][b] : 0.0f;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                float p[4];
                block_partial<ONE>(part[j][n], p);
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[j][n][i] = acc[j][n][i] + p[i] * sc;
            }
        }
    }
}

// A tile whose operands are all whole (every row 16-byte aligned, n_in a multiple of FP8_BLOCK)
// runs its loads without checks (compares, branches and their address arithmetic were a third of
// a checked tile's instructions, which bound it more than its bytes): a missing row (nullptr) reads
// lane 0's first row, which every tile has (its first weight row, its pass's first activation
// row), and a missing 16-row block the first block's scales. Such a row's MMA row or column is
// never stored, and an MMA's output row m (column n) depends on its A row m (B column n) only,
// so what it reads there changes nothing that is kept. (The bf16 tile keeps its checked loads
// but in its one-row case, exact_mma.cuh's ONE: unchecked, its tiles of several rows ran its large
// projections 13% slower, and again 4-13% at 1 and 8 rows when re-measured.)
template <typename T, int N>
static __device__ __forceinline__ void present_rows(const T* const (&in)[N], const T* first, const T* (&out)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = in[i] != nullptr ? in[i] : first;
}

// One tile: tile[m][n] = sum over blocks b of scale_j[b] * (w_m . x_n over block b) for the
// block's 16 J weight rows m and up to 8 NT activation rows n. wrow as in mma_tile (e4m3 bytes),
// srow[j] the scale row of weight rows 16 j .. 16 j + 15 (scale of block b at srow[j][b]).
// ONE: the caller vouches that the tile is whole and has one activation row (lane 0's), so only
// the staged path is compiled (a kernel of its own keeps the registers of that path alone).
// Call with all MMA_THREADS threads of the block (it synchronises); tile is ready when it returns.
template <int J, int NT, bool ONE = false>
static __device__ void mma_tile_fp8(const unsigned char* const (&wrow)[J][2], const float* const (&srow)[J],
                                    const float* const (&xrow)[NT], int n_in, bool w_aligned, bool x_aligned,
                                    MmaTile<J, NT>& sh) {
    static_assert(!ONE || NT == 1, "a one-row tile has one activation column");
    float acc[J][NT][4];
    mma_zero<J, NT>(acc);
    if (ONE || (w_aligned && x_aligned && n_in % FP8_BLOCK == 0)) {
        const unsigned char* w[J][2];
        const float* s[J];
        const float* x[NT];
        const unsigned char* w0 = lane0_row(wrow[0][0]);
#pragma unroll
        for (int j = 0; j < J; ++j) present_rows(wrow[j], w0, w[j]);
        present_rows(srow, srow[0], s);
        present_rows(xrow, lane0_row(xrow[0]), x);
        __shared__ __align__(16) Fp8Stage stage[MMA_SPLIT];
        const int g = threadIdx.x % MMA_WARP / 4;
        if (ONE || (NT == 1 && __all_sync(0xffffffffu, g == 0 || xrow[0] == nullptr))) {  // the same in every warp
            mma_steps_fp8<J, NT, true, NT == 1>(w, s, x, n_in, true, true, acc, &stage[threadIdx.x / MMA_WARP]);
        } else if constexpr (!ONE) {
            mma_steps_fp8<J, NT, true>(w, s, x, n_in, true, true, acc);
        }
    } else if constexpr (!ONE) {
        mma_steps_fp8<J, NT, false>(wrow, srow, xrow, n_in, w_aligned, x_aligned, acc);
    }
    mma_tile_reduce<J, NT>(acc, sh);
}
