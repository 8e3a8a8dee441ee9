// The tensor-core expert passes of moe.cu (bf16 and FP8 experts alike): which (row, slot) pairs
// an expert serves, a tile over up to 8 NT of them at a time, and the stores of gate|up and down
// tiles. Every order here is a scan of idx in (row, slot) order: independent of the other rows.
#pragma once

#include "common.cuh"
#include "exact_mma.cuh"

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

// A down tile's nr pairs: y[pair, c0 + m] = tile row m < OUTS.
template <int OUTS, typename Tile>
static __device__ void store_down(const Tile& tile, int nr, const int* pairs, float* y, int c0, int D) {
    for (int j = threadIdx.x; j < OUTS * nr; j += MMA_THREADS) {
        const int m = j % OUTS, n = j / OUTS;
        if (c0 + m < D) y[(long long)pairs[n] * D + c0 + m] = tile[m][n];
    }
}
