// Shared helpers for memra's exact-class kernels.
// Reductions run in a fixed order that depends only on the reduced length and on the compile-time
// block size (never on the row count t), so row r of a t-row launch is bit-identical to t = 1.
#pragma once

#define MEMRA_BLOCK 256  // threads per block for row reductions: a fixed split size

__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

__device__ __forceinline__ float sigmoidf_exact(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float siluf_exact(float x) { return x * sigmoidf_exact(x); }

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
