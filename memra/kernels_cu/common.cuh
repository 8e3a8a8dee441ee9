// Shared helpers for memra's exact-class kernels.
// Reductions run in a fixed order that depends only on the reduced length and on the compile-time
// block size (never on the row count t), so row r of a t-row launch is bit-identical to t = 1.
#pragma once

// MEMRA_BLOCK: threads per block for row reductions, a fixed split size. Constants the host
// shares come from memra/kernels_cu/constants.py: as -D defines in the build, and through the
// header generated from the same table.
#include "constants.cuh"

// Every memra kernel opens with this call. A walk's captured launches carry programmatic dependent
// launch (runtime.dependent_launches, sm_90+): the grid may start while its predecessor in the
// stream still runs, so its launch and block setup hide under the predecessor's tail. The wait holds every read and
// write until the predecessor has completed and its writes are visible (the stream's order, as
// without the attribute); only then does this grid let its own successor launch, so at most two
// grids are in flight. Both instructions are no-ops on a launch without the attribute.
__device__ __forceinline__ void after_predecessor() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float sigmoidf_exact(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float siluf_exact(float x) { return x * sigmoidf_exact(x); }

// The clamped SwiGLU of one unit: silu(min(gate, limit)) * clip(up, -limit, limit).
__device__ __forceinline__ float swiglu_clamped(float gate, float up, float limit) {
    const float g = gate > limit ? limit : gate;
    const float u = up > limit ? limit : (up < -limit ? -limit : up);
    return siluf_exact(g) * u;
}

// The reference's overflow-free sigmoid (hc, KDA gate, MoE scores): exp only ever sees -|x|.
__device__ __forceinline__ float sigmoidf_stable(float x) {
    const float e = expf(-fabsf(x));
    return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// The per-column layout of runtime.columns_grid: a thread per column c < d, rows blockIdx.y,
// + gridDim.y, ... below m (looped past the grid's 65535; no 64-bit division per element);
// f(row, c) for each of the thread's rows.
template <typename F>
__device__ __forceinline__ void for_column_rows(long long m, int d, F f) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    for (long long r = blockIdx.y; r < m; r += gridDim.y) f(r, c);
}

// V adjacent values of p (V = 4: one 16-byte access, p 16-byte aligned; other V one float each).
template <int V>
__device__ __forceinline__ void load_values(const float* p, float (&v)[V]) {
    if constexpr (V == 4) {
        const float4 a = *reinterpret_cast<const float4*>(p);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    } else {
#pragma unroll
        for (int e = 0; e < V; ++e) v[e] = p[e];
    }
}

template <int V>
__device__ __forceinline__ void store_values(float* p, const float (&v)[V]) {
    if constexpr (V == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int e = 0; e < V; ++e) p[e] = v[e];
    }
}

// A warp's 32 lanes combined by a fixed xor butterfly (offsets 16, 8, 4, 2, 1). Each step
// combines a commutative pair, so every lane ends with the same bits.
template <typename Op>
__device__ __forceinline__ float warp_xor_reduce(float v, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_xor_sum(float v) {
    return warp_xor_reduce(v, [](float a, float b) { return a + b; });
}

// Fixed-shape tree sum over MEMRA_BLOCK partials held in shared memory; returns the total to all.
__device__ __forceinline__ float block_sum(float v, float* shm) {
    shm[threadIdx.x] = v;
    __syncthreads();
    for (int s = MEMRA_BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shm[threadIdx.x] += shm[threadIdx.x + s];
        __syncthreads();
    }
    float total = shm[0];
    __syncthreads();
    return total;
}

// The selections' total order (MoE experts and groups, kpool pools): a higher score first, equal
// scores to the lower index; index -1 stands for "no candidate" and ranks after everything.
__device__ __forceinline__ bool ranks_before(float va, int ia, float vb, int ib) {
    if (ia < 0) return false;
    if (ib < 0) return true;
    return va > vb || (va == vb && ia < ib);
}

// Fixed-shape tree over MEMRA_BLOCK (value, index) candidates held in shared sv, si, where
// before(v, i, w, j) says (v, i) wins over (w, j); every thread returns the winner. Under a
// strict total order that is the winner a serial scan finds.
template <typename V, typename I, typename Before>
__device__ void block_best(V& v, I& i, V* sv, I* si, Before before) {
    sv[threadIdx.x] = v;
    si[threadIdx.x] = i;
    __syncthreads();
    for (int s = MEMRA_BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s &&
            before(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x], si[threadIdx.x])) {
            sv[threadIdx.x] = sv[threadIdx.x + s];
            si[threadIdx.x] = si[threadIdx.x + s];
        }
        __syncthreads();
    }
    v = sv[0];
    i = si[0];
    __syncthreads();
}

__device__ __forceinline__ float block_max(float v, float* shm) {
    shm[threadIdx.x] = v;
    __syncthreads();
    for (int s = MEMRA_BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shm[threadIdx.x] = fmaxf(shm[threadIdx.x], shm[threadIdx.x + s]);
        __syncthreads();
    }
    float total = shm[0];
    __syncthreads();
    return total;
}
