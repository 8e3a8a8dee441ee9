// Dense family: embedding gather, projections (linear, per-head linear) and elementwise activations.
//
// Projections are exact class: the dot product of output o with row r is reduced in one fixed
// order whatever the row count t or the grid size: lane l of a warp sums the products of
// in-features k = l, l+32, l+64, ... in increasing k (a fixed split SIZE of 32), then the warp's
// fixed shuffle tree adds the 32 partials. The weight tile is read once and applied to every row
// of the block (up to ROW_TILE rows held in shared memory), so a t-row verify costs one weight
// pass, not t.
#include "common.cuh"

#define WARP 32
#define WARPS_PER_BLOCK (MEMRA_BLOCK / WARP)
#define ROW_TILE 16        // rows per weight pass; >= 15, so every exact-class call reads w once
#define OUTS_PER_WARP 4    // outputs per warp: each staged x element serves 4 weight rows
#define K_TILE 256         // in-features per shared-memory stage (a multiple of WARP)
#define OUTS_PER_BLOCK (WARPS_PER_BLOCK * OUTS_PER_WARP)

static __device__ __forceinline__ float widen(float v) { return v; }
static __device__ __forceinline__ float widen(unsigned short v) { return bf16_to_f32(v); }

// Fixed-shape warp tree: lane 0 ends with the sum of the 32 lanes' partials.
static __device__ __forceinline__ float warp_sum(float v) {
    for (int off = WARP / 2; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

// y[r, o] = sum_k w[o, k] x[r, k] for r < t, o < n_out. x rows are x_stride floats apart and y
// rows y_stride floats apart (head_linear interleaves heads within a row).
template <typename W>
static __device__ void project(const float* __restrict__ x, const W* __restrict__ w,
                               float* __restrict__ y, int t, int n_in, int n_out,
                               long long x_stride, long long y_stride) {
    __shared__ float xs[ROW_TILE][K_TILE];
    const int lane = threadIdx.x % WARP;
    const int o0 = (blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP) * OUTS_PER_WARP;
    for (int r0 = 0; r0 < t; r0 += ROW_TILE) {  // more than ROW_TILE rows only in the prime class
        const int nr = min(ROW_TILE, t - r0);
        float acc[ROW_TILE][OUTS_PER_WARP];
#pragma unroll
        for (int r = 0; r < ROW_TILE; ++r)
#pragma unroll
            for (int j = 0; j < OUTS_PER_WARP; ++j) acc[r][j] = 0.0f;
        for (int k0 = 0; k0 < n_in; k0 += K_TILE) {
            const int kn = min(K_TILE, n_in - k0);
            __syncthreads();  // the previous stage is fully consumed
            for (int i = threadIdx.x; i < nr * K_TILE; i += MEMRA_BLOCK) {
                const int r = i / K_TILE, k = i % K_TILE;
                xs[r][k] = k < kn ? x[(r0 + r) * x_stride + k0 + k] : 0.0f;
            }
            __syncthreads();
            for (int k = lane; k < kn; k += WARP) {
#pragma unroll
                for (int j = 0; j < OUTS_PER_WARP; ++j) {
                    const int o = o0 + j;
                    const float wv = o < n_out ? widen(w[(long long)o * n_in + k0 + k]) : 0.0f;
#pragma unroll
                    for (int r = 0; r < ROW_TILE; ++r)
                        if (r < nr) acc[r][j] = acc[r][j] + wv * xs[r][k];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROW_TILE; ++r) {
            if (r >= nr) break;
#pragma unroll
            for (int j = 0; j < OUTS_PER_WARP; ++j) {
                const float s = warp_sum(acc[r][j]);
                if (lane == 0 && o0 + j < n_out) y[(r0 + r) * y_stride + o0 + j] = s;
            }
        }
    }
}

// x [t, in], w [out, in] -> y [t, out]; grid (ceil(out / OUTS_PER_BLOCK)), block MEMRA_BLOCK.
extern "C" __global__ void linear_f32(const float* x, const float* w, float* y, int t, int n_in,
                                      int n_out) {
    project(x, w, y, t, n_in, n_out, n_in, n_out);
}

extern "C" __global__ void linear_bf16(const float* x, const unsigned short* w, float* y, int t,
                                       int n_in, int n_out) {
    project(x, w, y, t, n_in, n_out, n_in, n_out);
}

// x [t, H, in], w [H, out, in] -> y [t, H, out]; grid (ceil(out / OUTS_PER_BLOCK), H).
template <typename W>
static __device__ void head_project(const float* x, const W* w, float* y, int t, int n_in,
                                    int n_out) {
    const long long h = blockIdx.y, heads = gridDim.y;
    project(x + h * n_in, w + h * n_out * n_in, y + h * n_out, t, n_in, n_out, heads * n_in,
            heads * n_out);
}

extern "C" __global__ void head_linear_f32(const float* x, const float* w, float* y, int t,
                                           int n_in, int n_out) {
    head_project(x, w, y, t, n_in, n_out);
}

extern "C" __global__ void head_linear_bf16(const float* x, const unsigned short* w, float* y,
                                            int t, int n_in, int n_out) {
    head_project(x, w, y, t, n_in, n_out);
}

// y[i] = table[ids[i]]; grid (n_ids), block MEMRA_BLOCK. An id outside [0, vocab) gives a NaN
// row (loud downstream) instead of an out-of-bounds read; host ids are checked before launch.
template <typename W>
static __device__ void gather(const W* table, const int* ids, float* y, int vocab, int dim) {
    const int id = ids[blockIdx.x];
    float* out = y + (long long)blockIdx.x * dim;
    const bool ok = id >= 0 && id < vocab;
    for (int k = threadIdx.x; k < dim; k += MEMRA_BLOCK)
        out[k] = ok ? widen(table[(long long)id * dim + k]) : __int_as_float(0x7fc00000);
}

extern "C" __global__ void embed_f32(const float* table, const int* ids, float* y, int vocab,
                                     int dim) {
    gather(table, ids, y, vocab, dim);
}

extern "C" __global__ void embed_bf16(const unsigned short* table, const int* ids, float* y,
                                      int vocab, int dim) {
    gather(table, ids, y, vocab, dim);
}

// Elementwise activations over n floats (grid-stride; no reduction, so trivially row-exact).
extern "C" __global__ void silu_kernel(const float* x, float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = siluf_exact(x[i]);
}

extern "C" __global__ void sigmoid_kernel(const float* x, float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = sigmoidf_exact(x[i]);
}

// silu(min(gate, limit)) * clip(up, -limit, limit); the comparisons let NaN through as numpy does.
extern "C" __global__ void swiglu_kernel(const float* gate, const float* up, float* y, long long n,
                                         float limit) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = gate[i] > limit ? limit : gate[i];
        const float u = up[i] > limit ? limit : (up[i] < -limit ? -limit : up[i]);
        y[i] = siluf_exact(g) * u;
    }
}
