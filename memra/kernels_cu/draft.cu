// Kernels of the draft networks (memra/drafters). A drafter is not in the exact class: the target
// verifies every token it proposes, so these kernels need only be deterministic. They exist so a
// draft round runs as one CUDA graph: CuPy refuses cuBLAS calls while a stream is captured.
#include "common.cuh"

// Block attention of a block drafter (drafters/dflash2/model.py): b query rows over the n cached
// context keys and the block's own b keys, GQA (query head h reads kv head h / (nh / nkv)).
// Cache index: context key j at j, block key i at n + i, query row i at n + i; a key is visible
// unless causal hides it (key > query) or the window does (|query - key| >= window; window 0:
// none). n is read from the device (`n_ctx`), so a captured graph serves every context length.
// Grid (nh, b), MEMRA_BLOCK threads: warp w takes keys w, w + WARPS_PER_BLOCK, ... with an online
// softmax (lane l holds dims l, l + 32, ...), then the warps' partial sums merge in warp order.
extern "C" __global__ void block_attention(const float* q, const float* k_ctx, const float* v_ctx,
                                           const float* k_blk, const float* v_blk, const int* n_ctx,
                                           float* out, int b, int nh, int nkv, int hd, int causal,
                                           int window, float scale) {
    after_predecessor();
    constexpr int PER_LANE = DRAFT_MAX_HD / 32;
    __shared__ float warp_max[WARPS_PER_BLOCK], warp_sum[WARPS_PER_BLOCK];
    __shared__ float warp_acc[WARPS_PER_BLOCK][DRAFT_MAX_HD];
    const int h = blockIdx.x, row = blockIdx.y, kvh = h / (nh / nkv);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n = n_ctx[0], query = n + row;
    float qv[PER_LANE], acc[PER_LANE];
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) {
        const int d = lane + 32 * e;
        qv[e] = d < hd ? q[((long long)row * nh + h) * hd + d] : 0.0f;
        acc[e] = 0.0f;
    }
    float m = neg_inf(), l = 0.0f;
    const int first = window > 0 && query - window + 1 > 0 ? query - window + 1 : 0;
    const int last = causal ? query : n + b - 1;  // inclusive
    for (int j = first + warp; j <= last; j += WARPS_PER_BLOCK) {
        if (window > 0 && j - query >= window) break;
        const long long at = j < n ? ((long long)j * nkv + kvh) * hd : ((long long)(j - n) * nkv + kvh) * hd;
        const float* kr = (j < n ? k_ctx : k_blk) + at;
        const float* vr = (j < n ? v_ctx : v_blk) + at;
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int d = lane + 32 * e;
            if (d < hd) s += qv[e] * kr[d];
        }
        s = warp_xor_sum(s) * scale;
        const float m_new = fmaxf(m, s), carry = expf(m - m_new), p = expf(s - m_new);
        l = l * carry + p;
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int d = lane + 32 * e;
            acc[e] = acc[e] * carry + (d < hd ? p * vr[d] : 0.0f);
        }
        m = m_new;
    }
    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) {
        const int d = lane + 32 * e;
        if (d < hd) warp_acc[warp][d] = acc[e];
    }
    __syncthreads();
    // the query's own key is always visible, so some warp's max is finite
    float top = neg_inf();
    for (int w = 0; w < WARPS_PER_BLOCK; ++w) top = fmaxf(top, warp_max[w]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        for (int w = 0; w < WARPS_PER_BLOCK; ++w) {
            if (warp_max[w] == neg_inf()) continue;  // a warp that saw no visible key
            const float f = expf(warp_max[w] - top);
            num += warp_acc[w][d] * f;
            den += warp_sum[w] * f;
        }
        out[((long long)row * nh + h) * hd + d] = num / den;
    }
}
