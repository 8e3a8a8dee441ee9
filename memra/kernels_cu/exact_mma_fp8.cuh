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
// ascending order; inside a block, k-steps 0..7 (16 in-features each), each as hi, mid, lo; the
// warps' running sums are added in warp order (MmaTile, as for bf16). All of it depends on n_in
// only, never on t, so row r of a t-row call is bit-identical to the row alone.
// Loads: lane (g = lane / 4, q = lane % 4) reads 16 bytes of each of its weight rows per 64-wide
// half block: in-features h0 + 16 q .. h0 + 16 q + 15. In k-step s of that half, MMA k-index 2q + i
// (i < 2) stands for in-feature h0 + 16 q + 4 s + i and 2q + 8 + i for h0 + 16 q + 4 s + 2 + i,
// the same bijection for weights and activations.
#pragma once

#include "constants.cuh"
#include "exact_mma.cuh"

static_assert(FP8_BLOCK == 128, "a block is two 64-wide halves of 16-byte loads per lane");

// Two e4m3 bytes (low byte: the lower in-feature) -> two bf16 in one word, low half first, exactly:
// the cvt gives normal f16 values whose low 7 mantissa bits are zero, rebased to bf16's exponent.
static __device__ __forceinline__ unsigned e4m3x2_to_bf16x2(unsigned short pair) {
    unsigned h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
    unsigned out = 0u;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const unsigned h = (h2 >> (16 * e)) & 0xffffu, mag = h & 0x7fffu;
        const unsigned b = (h & 0x8000u) | (mag ? (mag >> 3) + (112u << 7) : 0u);  // 112 = 127 - 15
        out |= b << (16 * e);
    }
    return out;
}

// Sixteen e4m3 weights of a row from in-feature k (zeros past n_in or for a missing row) as
// eight bf16 pairs: word j holds in-features k + 2j (low) and k + 2j + 1.
static __device__ __forceinline__ void load_w16_fp8(const unsigned char* row, int k, int n_in, bool aligned,
                                                   unsigned (&w)[8]) {
    uint4 v;
    if (row != nullptr && aligned && k + 16 <= n_in) {
        v = *reinterpret_cast<const uint4*>(row + k);
    } else {
        unsigned b[4] = {0u, 0u, 0u, 0u};
        for (int j = 0; j < 16; ++j)
            if (row != nullptr && k + j < n_in) b[j / 4] |= (unsigned)row[k + j] << (8 * (j % 4));
        v = make_uint4(b[0], b[1], b[2], b[3]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned x = word(v, i);
        w[2 * i] = e4m3x2_to_bf16x2((unsigned short)(x & 0xffffu));
        w[2 * i + 1] = e4m3x2_to_bf16x2((unsigned short)(x >> 16));
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

// One tile: tile[m][n] = sum over blocks b of scale_j[b] * (w_m . x_n over block b) for the
// block's 16 J weight rows m and up to 8 NT activation rows n. wrow as in mma_tile (e4m3 bytes),
// srow[j] the scale row of weight rows 16 j .. 16 j + 15 (scale of block b at srow[j][b]).
// Call with all MMA_THREADS threads of the block (it synchronises); tile is ready when it returns.
template <int J, int NT>
static __device__ void mma_tile_fp8(const unsigned char* const (&wrow)[J][2], const float* const (&srow)[J],
                                    const float* const (&xrow)[NT], int n_in, bool w_aligned, bool x_aligned,
                                    MmaTile<J, NT>& sh) {
    const int lane = threadIdx.x % MMA_WARP, q = lane % 4, warp = threadIdx.x / MMA_WARP;
    float acc[J][NT][4];
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][n][i] = 0.0f;
    for (int kb = warp * FP8_BLOCK; kb < n_in; kb += MMA_SPLIT * FP8_BLOCK) {
        float part[J][NT][4];
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) part[j][n][i] = 0.0f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int k = kb + 64 * half + 16 * q;
            unsigned wv[J][2][8];
#pragma unroll
            for (int j = 0; j < J; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) load_w16_fp8(wrow[j][h], k, n_in, w_aligned, wv[j][h]);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                float xa[8], xb[8];
                load_x8(xrow[n], k, n_in, x_aligned, xa);
                load_x8(xrow[n], k + 8, n_in, x_aligned, xb);
                unsigned pa[3][4], pb[3][4];
                split_pieces(xa, pa);
                split_pieces(xb, pb);
#pragma unroll
                for (int s = 0; s < 4; ++s)
#pragma unroll
                    for (int piece = 0; piece < 3; ++piece) {
                        const unsigned b0 = s < 2 ? pa[piece][2 * s] : pb[piece][2 * s - 4];
                        const unsigned b1 = s < 2 ? pa[piece][2 * s + 1] : pb[piece][2 * s - 3];
#pragma unroll
                        for (int j = 0; j < J; ++j)
                            mma_bf16(part[j][n], wv[j][0][2 * s], wv[j][1][2 * s], wv[j][0][2 * s + 1],
                                     wv[j][1][2 * s + 1], b0, b1);
                    }
            }
        }
        const int b = kb / FP8_BLOCK;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const float sc = srow[j] != nullptr ? srow[j][b] : 0.0f;
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[j][n][i] = acc[j][n][i] + part[j][n][i] * sc;
        }
    }
    mma_tile_reduce<J, NT>(acc, sh);
}
