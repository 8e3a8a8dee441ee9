// Prime family: the small kernels around the prime class's cuBLAS GEMMs (DESIGN.md section 2:
// a prompt longer than the exact class's row cap needs accuracy, not row invariance).
//
//   bf16_pieces:    rows of x split into three bf16 pieces, x = hi + mid + lo exactly (the split
//                   exact_mma.cuh makes), so three bf16 GEMMs against bf16 weights add up to
//                   float32 products; `rows` gathers (a routed expert's slots), null takes row i.
//   swiglu_pieces:  the pieces of swiglu(gate, up) (a routed expert's down-projection input).
//   selection_mask: keep[i, c] = 1 where row i's position list names position c (c < ctx).
//   masked_softmax: s[i, h, :ctx] = softmax over the kept columns of scale * s (others 0).
#include "common.cuh"

// The three bf16 pieces of a, each the truncation of what the previous ones left (exact_mma.cuh).
static __device__ __forceinline__ void put_pieces(float a, unsigned short* out, long long e, long long n) {
    const unsigned hi = __float_as_uint(a) & 0xffff0000u;
    const float rest = a - __uint_as_float(hi);
    const unsigned mid = __float_as_uint(rest) & 0xffff0000u;
    out[e] = (unsigned short)(hi >> 16);
    out[n + e] = (unsigned short)(mid >> 16);
    out[2 * n + e] = (unsigned short)(__float_as_uint(rest - __uint_as_float(mid)) >> 16);
}

extern "C" __global__ void bf16_pieces(const float* x, const long long* rows, unsigned short* out,
                                       long long m, int d) {
    const long long n = m * d;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const long long i = e / d, src = rows != nullptr ? rows[i] : i;
        put_pieces(x[src * d + e % d], out, e, n);
    }
}

// dense.cu's swiglu_kernel, written as pieces: silu(min(gate, limit)) * clip(up, -limit, limit).
extern "C" __global__ void swiglu_pieces(const float* gate, const float* up, unsigned short* out,
                                         long long n, float limit) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = gate[i] > limit ? limit : gate[i];
        const float u = up[i] > limit ? limit : (up[i] < -limit ? -limit : up[i]);
        put_pieces(siluf_exact(g) * u, out, i, n);
    }
}

// grid-stride over rows * W list entries; keep [rows, ctx] arrives zeroed.
extern "C" __global__ void selection_mask(const int* positions, unsigned char* keep, int rows, int W,
                                          int ctx) {
    const long long n = (long long)rows * W;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const int c = positions[e];
        if (c >= 0 && c < ctx) keep[(e / W) * ctx + c] = 1;
    }
}

// grid (rows * H), block MEMRA_BLOCK: one (row, head) of scores [rows, H, ctx] in place.
extern "C" __global__ void masked_softmax(float* s, const unsigned char* keep, int H, int ctx,
                                          float scale) {
    __shared__ float shm[MEMRA_BLOCK];
    const unsigned char* kp = keep + (long long)(blockIdx.x / H) * ctx;
    float* row = s + (long long)blockIdx.x * ctx;
    float mx = neg_inf();
    for (int j = threadIdx.x; j < ctx; j += MEMRA_BLOCK)
        if (kp[j]) mx = fmaxf(mx, row[j] * scale);
    mx = block_max(mx, shm);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < ctx; j += MEMRA_BLOCK) {
        const float e = kp[j] ? expf(row[j] * scale - mx) : 0.0f;
        row[j] = e;
        sum += e;
    }
    sum = block_sum(sum, shm);
    // a row that lists no position (never one of a prompt: it sees itself) attends nothing
    for (int j = threadIdx.x; j < ctx; j += MEMRA_BLOCK) row[j] = sum > 0.0f ? row[j] / sum : 0.0f;
}
