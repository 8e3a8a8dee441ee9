// The tensor-core experts of moe.cu (bf16 and FP8 alike): which (row, slot) pairs an expert
// serves, a tile over up to 8 NT of them at a time, the stores of gate|up and down tiles, and the
// gate|up and down tiles of one listed expert (moe.cu's kernels instantiate them). Every order
// here is a scan of idx in (row, slot) order: independent of the other rows.
#pragma once

#include "common.cuh"
#include "exact_mma.cuh"
#include "exact_mma_fp8.cuh"

static_assert(BF16_OUTS % 16 == 0, "a down tile is whole 16-row MMA blocks");

// The next (row, slot) pairs routed to expert e, scanning idx [t * k] from *cursor in order:
// up to cap of them into pairs (as r * k + s). Warp 0 scans 32 entries per ballot; call with
// the whole block; returns the count (0: no more) and moves *cursor past the last one taken.
static __device__ int next_pairs(const long long* idx, int total, int e, int cap, int* pairs,
                                 int* shared_count, int* cursor) {
    __syncthreads();  // the previous pass is done reading pairs
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int taken = 0, pos = *cursor;
        while (pos < total && taken < cap) {
            const int p = pos + lane;
            const bool hit = p < total && idx[p] == e;
            const unsigned hits = __ballot_sync(0xffffffffu, hit);
            const int rank = taken + __popc(hits & ((1u << lane) - 1u));
            if (hit && rank < cap) pairs[rank] = p;
            const int room = cap - taken;
            if (__popc(hits) > room) {  // stop after the room-th hit of this window
                const unsigned last = __ballot_sync(0xffffffffu, hit && rank == cap - 1);
                pos = __shfl_sync(0xffffffffu, p, __ffs(last) - 1) + 1;
                taken = cap;
            } else {
                taken += __popc(hits);
                pos += 32;
            }
        }
        if (lane == 0) {
            *shared_count = taken;
            cursor[1] = min(pos, total);
        }
    }
    __syncthreads();
    const int n = *shared_count;
    if (threadIdx.x == 0) cursor[0] = cursor[1];
    __syncthreads();
    return n;
}

// The block's passes over the (row, slot) pairs routed to expert e, up to 8 NT at a time: each
// pair's activation row x + (pair / div) * stride goes through tile(xrow, sh) (mma_tile or
// mma_tile_fp8 against the lane's weight rows), then store(nr, pairs, tile) writes the pass's nr
// pairs. Call with the whole block.
template <int J, int NT, typename Tile, typename Store>
static __device__ void expert_passes(const long long* idx, int total, int e, const float* x, int div,
                                     long long stride, Tile tile, Store store) {
    __shared__ MmaTile<J, NT> sh;
    __shared__ int pairs[8 * NT], count, cursor[2];
    const int g = threadIdx.x % MMA_WARP / 4;
    if (threadIdx.x == 0) cursor[0] = 0;
    __syncthreads();
    int nr;
    while ((nr = next_pairs(idx, total, e, 8 * NT, pairs, &count, cursor)) > 0) {
        const float* xrow[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n)
            xrow[n] = 8 * n + g < nr ? x + (long long)(pairs[8 * n + g] / div) * stride : nullptr;
        tile(xrow, sh);
        store(nr, pairs, sh.tile);
    }
}

// A gate|up tile's nr pairs: h[pair, i0 + m] = swiglu(gate row m, up row GATE_UP_UNITS + m).
template <typename Tile>
static __device__ void store_swiglu(const Tile& tile, int nr, const int* pairs, float* h, int i0, int I,
                                    float limit) {
    for (int j = threadIdx.x; j < GATE_UP_UNITS * nr; j += MMA_THREADS) {
        const int m = j % GATE_UP_UNITS, n = j / GATE_UP_UNITS;
        if (i0 + m < I) {
            const float a = siluf_exact(fminf(tile[m][n], limit));
            h[(long long)pairs[n] * I + i0 + m] = a * fminf(fmaxf(tile[GATE_UP_UNITS + m][n], -limit), limit);
        }
    }
}

// A down tile's nr pairs: y[pair, c0 + m] = tile row m < BF16_OUTS.
template <typename Tile>
static __device__ void store_down(const Tile& tile, int nr, const int* pairs, float* y, int c0, int D) {
    for (int j = threadIdx.x; j < BF16_OUTS * nr; j += MMA_THREADS) {
        const int m = j % BF16_OUTS, n = j / BF16_OUTS;
        if (c0 + m < D) y[(long long)pairs[n] * D + c0 + m] = tile[m][n];
    }
}

// bf16 experts, tensor cores. gate_up: block (i-tile of GATE_UP_UNITS, listed expert e = list[y]):
// weight rows 0..15 are gate rows i0.., 16..31 the up rows, so the SwiGLU pairs meet in one tile.
// down: block (c-tile of BF16_OUTS, listed expert). grid (ceil(I / GATE_UP_UNITS), min(E, t k))
// and (ceil(D / BF16_OUTS), ..), block MMA_THREADS; block rows past *listed exit at once. The
// down tile of one pass (NT = 1, up to 8 rows) streams its weights (load_weights16): graph-timed
// at bench's 9 experts of 2048 -> 4096, a decode step's call 53.0 -> 43.5 us and 8 rows' 203 ->
// 198 us, against 64 outputs a block with plain loads (the same bits); the gate|up tile keeps
// plain loads (streamed: 82 -> 97 us).
template <int NT>
static __device__ void gate_up_bf16(const float* x, const long long* idx, const int* list,
                                    const int* listed, const unsigned short* gate_w,
                                    const unsigned short* up_w, float* h, int t, int k, int I, int D,
                                    float limit) {
    if (blockIdx.y >= *listed) return;
    const int e = list[blockIdx.y], i0 = blockIdx.x * GATE_UP_UNITS;
    const bool w_aligned = (reinterpret_cast<unsigned long long>(gate_w) % 16) == 0 &&
                           (reinterpret_cast<unsigned long long>(up_w) % 16) == 0 && D % 8 == 0;
    const bool x_aligned = (reinterpret_cast<unsigned long long>(x) % 16) == 0 && D % 4 == 0;
    const int g = threadIdx.x % MMA_WARP / 4;
    const unsigned short* wrow[2][2];  // the gate row and the up row of unit i meet in one lane
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int i = i0 + 8 * hh + g;
        const long long off = ((long long)e * I + i) * D;
        wrow[0][hh] = i < I ? gate_w + off : nullptr;
        wrow[1][hh] = i < I ? up_w + off : nullptr;
    }
    auto mma = [&](const float* const (&xrow)[NT], MmaTile<2, NT>& sh) {
        mma_tile<2, NT, false, false, NT == 1>(wrow, xrow, D, w_aligned, x_aligned, sh);
    };
    expert_passes<2, NT>(idx, t * k, e, x, k, D, mma, [&](int nr, const int* pairs, const auto& tile) {
        store_swiglu(tile, nr, pairs, h, i0, I, limit);
    });
}

template <int NT>
static __device__ void down_bf16(const float* h, const long long* idx, const int* list,
                                 const int* listed, const unsigned short* down_w, float* y, int t,
                                 int k, int I, int D) {
    constexpr int J = BF16_OUTS / 16;
    if (blockIdx.y >= *listed) return;
    const int e = list[blockIdx.y], c0 = blockIdx.x * BF16_OUTS;
    const bool w_aligned = (reinterpret_cast<unsigned long long>(down_w) % 16) == 0 && I % 8 == 0;
    const bool x_aligned = (reinterpret_cast<unsigned long long>(h) % 16) == 0 && I % 4 == 0;
    const unsigned short* wrow[J][2];
#pragma unroll
    for (int j = 0; j < J; ++j) mma_rows(down_w + (long long)e * D * I, c0 + 16 * j, D, I, wrow[j]);
    auto mma = [&](const float* const (&xrow)[NT], MmaTile<J, NT>& sh) {
        mma_tile<J, NT, NT == 1, false, NT == 1>(wrow, xrow, I, w_aligned, x_aligned, sh);
    };
    expert_passes<J, NT>(idx, t * k, e, h, 1, I, mma, [&](int nr, const int* pairs, const auto& tile) {
        store_down(tile, nr, pairs, y, c0, D);
    });
}

// FP8 experts (e4m3 bytes [E, rows, cols], scales [E, ceil(rows / FP8_BLOCK), ceil(cols / FP8_BLOCK)]):
// the bf16 expert tiles with exact_mma_fp8.cuh's blockwise tile, one byte read per weight. Same
// grids; a gate|up tile's 16 units share one scale row (GATE_UP_UNITS divides FP8_BLOCK).
static_assert(FP8_BLOCK % GATE_UP_UNITS == 0 && FP8_BLOCK % 16 == 0, "a tile's rows share one scale row");
template <int NT>
static __device__ void gate_up_fp8(const float* x, const long long* idx, const int* list, const int* listed,
                                   const unsigned char* gate_w, const float* gate_s, const unsigned char* up_w,
                                   const float* up_s, float* h, int t, int k, int I, int D, float limit) {
    if (blockIdx.y >= *listed) return;
    const int e = list[blockIdx.y], i0 = blockIdx.x * GATE_UP_UNITS;
    const bool w_aligned = (reinterpret_cast<unsigned long long>(gate_w) % 16) == 0 &&
                           (reinterpret_cast<unsigned long long>(up_w) % 16) == 0 && D % 16 == 0;
    const bool x_aligned = (reinterpret_cast<unsigned long long>(x) % 16) == 0 && D % 4 == 0;
    const long long rows = (I + FP8_BLOCK - 1) / FP8_BLOCK, cols = (D + FP8_BLOCK - 1) / FP8_BLOCK;
    const unsigned char* wrow[2][2];
    const float* srow[2];
    mma_rows_fp8(gate_w + (long long)e * I * D, gate_s + e * rows * cols, i0, I, D, cols, wrow[0], srow[0]);
    mma_rows_fp8(up_w + (long long)e * I * D, up_s + e * rows * cols, i0, I, D, cols, wrow[1], srow[1]);
    // mma_rows_fp8 gives rows i0 + g and i0 + 8 + g: the gate row and the up row of a unit meet in one lane
    auto mma = [&](const float* const (&xrow)[NT], MmaTile<2, NT>& sh) {
        mma_tile_fp8<2, NT>(wrow, srow, xrow, D, w_aligned, x_aligned, sh);
    };
    expert_passes<2, NT>(idx, t * k, e, x, k, D, mma, [&](int nr, const int* pairs, const auto& tile) {
        store_swiglu(tile, nr, pairs, h, i0, I, limit);
    });
}

template <int NT>
static __device__ void down_fp8(const float* h, const long long* idx, const int* list, const int* listed,
                                const unsigned char* down_w, const float* down_s, float* y, int t, int k, int I,
                                int D) {
    constexpr int J = BF16_OUTS / 16;
    if (blockIdx.y >= *listed) return;
    const int e = list[blockIdx.y], c0 = blockIdx.x * BF16_OUTS;
    const bool w_aligned = (reinterpret_cast<unsigned long long>(down_w) % 16) == 0 && I % 16 == 0;
    const bool x_aligned = (reinterpret_cast<unsigned long long>(h) % 16) == 0 && I % 4 == 0;
    const long long rows = (D + FP8_BLOCK - 1) / FP8_BLOCK, cols = (I + FP8_BLOCK - 1) / FP8_BLOCK;
    const unsigned char* wrow[J][2];
    const float* srow[J];
#pragma unroll
    for (int j = 0; j < J; ++j)
        mma_rows_fp8(down_w + (long long)e * D * I, down_s + e * rows * cols, c0 + 16 * j, D, I, cols,
                     wrow[j], srow[j]);
    auto mma = [&](const float* const (&xrow)[NT], MmaTile<J, NT>& sh) {
        mma_tile_fp8<J, NT>(wrow, srow, xrow, I, w_aligned, x_aligned, sh);
    };
    expert_passes<J, NT>(idx, t * k, e, h, 1, I, mma, [&](int nr, const int* pairs, const auto& tile) {
        store_down(tile, nr, pairs, y, c0, D);
    });
}
