// The MoE family of the exact class: sigmoid noaux_tc routing and the routed experts.
// Expert weights are read once per call for all the rows routed to them (not once per row).
// bf16 experts run on tensor cores through exact_mma.cuh, 8 NT routed rows per pass; float32
// experts walk a weight row per warp that loops over the rows, the router a warp per (expert,
// row); each dot lanes striding the reduced axis, then a fixed shuffle tree. Either order
// depends on the reduced length only, never on t or on which other rows picked the expert.
// Expert outputs land in per-(row, slot) scratch and are summed per row in slot order, so no
// float atomics and no order that depends on which other rows exist.
#include "common.cuh"
#include "moe_passes.cuh"  // the tensor-core expert tiles (bf16 and FP8) the kernels below run

static_assert(MMA_THREADS == MEMRA_BLOCK, "the host launches every tensor-core kernel with BLOCK threads");
static_assert(MAX_GROUPS == 64, "moe_route_select keeps the kept groups in a 64-bit mask");
static_assert(MAX_GROUPS <= MEMRA_BLOCK && MAX_TOPK <= MEMRA_BLOCK,
              "moe_route_select: a thread per group and per chosen slot");
static_assert(GATE_UP_UNITS == 16, "a gate|up tile is one 16-row MMA block of gate rows, one of up rows");

// Lane 0 returns the dot of w[0..n) and x[0..n): lane l sums c = l, l+32, ... then a fixed tree.
template <typename T>
static __device__ __forceinline__ float warp_dot(const T* w, const float* x, int n, int lane) {
    float acc = 0.0f;
    for (int c = lane; c < n; c += 32) acc += w[c] * x[c];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    return acc;
}

// Router logits [t, E]: one warp (a block) per (expert, row) logit, grid (E, t). The dot is
// warp_dot's order (lane l sums c = l, l + 32, ... then the same tree), but each lane loads
// ROUTER_BATCH terms before it sums them: a single warp per logit is bound by load latency.
constexpr int ROUTER_BATCH = 64;
extern "C" __global__ void moe_router_logits(const float* __restrict__ x, const float* __restrict__ w_gate,
                                             float* __restrict__ logits, int t, int E, int D) {
    after_predecessor();
    const int lane = threadIdx.x, e = blockIdx.x, r = blockIdx.y;
    const float* we = w_gate + (long long)e * D;
    const float* xr = x + (long long)r * D;
    float acc = 0.0f;
    for (int c0 = lane; c0 < D; c0 += 32 * ROUTER_BATCH) {
        float wv[ROUTER_BATCH], xv[ROUTER_BATCH];
#pragma unroll
        for (int b = 0; b < ROUTER_BATCH; ++b) {
            const int c = c0 + 32 * b;
            wv[b] = c < D ? we[c] : 0.0f;
            xv[b] = c < D ? xr[c] : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < ROUTER_BATCH; ++b)
            if (c0 + 32 * b < D) acc += wv[b] * xv[b];
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) logits[(long long)r * E + e] = acc;
}

// Sum of the two largest biased scores sb in group g (counted with multiplicity).
static __device__ float group_score(const float* sb, int g, int gsize) {
    float m1 = __int_as_float(0xff800000), m2 = m1;
    for (int e = g * gsize; e < (g + 1) * gsize; ++e) {
        const float v = sb[e];
        if (v > m1) {
            m2 = m1;
            m1 = v;
        } else if (v > m2) {
            m2 = v;
        }
    }
    return m1 + m2;
}

// How many of the n candidates (v[j], j) rank before (v0, i0), counting no further than `cap`
// (the caller asks only whether fewer than cap do). Four candidates a step: their shared-memory
// loads issue together instead of one latency per candidate.
static __device__ __forceinline__ int count_before(const float* v, int n, float v0, int i0, int cap) {
    int before = 0;
    for (int j0 = 0; j0 < n && before < cap; j0 += 4)
#pragma unroll
        for (int u = 0; u < 4; ++u)
            if (j0 + u < n && ranks_before(v[j0 + u], j0 + u, v0, i0)) ++before;
    return before;
}

// One block per row (grid t, block MEMRA_BLOCK): sigmoid scores biased, the topk_group best
// groups, then the k best experts in them, ascending, with weights from the unbiased scores.
// ranks_before is a strict total order, so "fewer than k kept candidates rank before it" picks
// the same k as choosing the best one at a time, with no chain of k warp reductions: each
// thread counts for its own experts. The chosen take their places in ascending order from a
// block prefix count, and their weights' sum runs in that order. k <= MAX_TOPK, n_group <=
// MAX_GROUPS (wrapper checks). Dynamic shared memory: E floats.
extern "C" __global__ void moe_route_select(const float* logits, const float* bias,
                                            long long* experts, float* weights, int t, int E,
                                            int n_group, int topk_group, int k, int renormalize,
                                            float scaling, int shared) {
    after_predecessor();
    extern __shared__ float sb[];
    __shared__ float group_v[MAX_GROUPS], chosen_score[MAX_TOPK];
    __shared__ int chosen_expert[MAX_TOPK], warp_chosen[WARPS_PER_BLOCK];
    __shared__ unsigned long long kept_groups;
    const int r = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32, gsize = E / n_group;
    const float* lg = logits + (long long)r * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) sb[e] = sigmoidf_stable(lg[e]) + bias[e];
    if (threadIdx.x < MAX_TOPK) {  // read only if a NaN score breaks the order: no stray index
        chosen_expert[threadIdx.x] = 0;
        chosen_score[threadIdx.x] = 0.0f;
    }
    if (threadIdx.x == 0) kept_groups = topk_group < n_group ? 0ull : ~0ull;  // all groups: no ranking
    __syncthreads();
    if (topk_group < n_group) {
        if (threadIdx.x < n_group) group_v[threadIdx.x] = group_score(sb, threadIdx.x, gsize);
        __syncthreads();
        if (threadIdx.x < n_group &&
            count_before(group_v, n_group, group_v[threadIdx.x], threadIdx.x, topk_group) < topk_group)
            atomicOr(&kept_groups, 1ull << threadIdx.x);
        __syncthreads();
        // an expert outside the kept groups scores -inf: it ranks before no kept expert (their
        // scores are finite), so the counts below need no group test per candidate
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            if (!((kept_groups >> (e / gsize)) & 1ull)) sb[e] = neg_inf();
        __syncthreads();
    }
    const unsigned long long keep = kept_groups;
    int placed = 0;  // chosen experts below this pass's
    for (int e0 = 0; e0 < E; e0 += blockDim.x) {  // uniform across the block
        const int e = e0 + threadIdx.x;
        const bool chosen = e < E && ((keep >> (e / gsize)) & 1ull) && count_before(sb, E, sb[e], e, k) < k;
        const unsigned ballot = __ballot_sync(0xffffffffu, chosen);
        if (lane == 0) warp_chosen[warp] = __popc(ballot);
        __syncthreads();
        int at = placed + __popc(ballot & ((1u << lane) - 1u));
        for (int w = 0; w < warp; ++w) at += warp_chosen[w];
        if (chosen && at < MAX_TOPK) {
            chosen_expert[at] = e;
            chosen_score[at] = sigmoidf_stable(lg[e]);  // the unbiased score
        }
        for (int w = 0; w < WARPS_PER_BLOCK; ++w) placed += warp_chosen[w];
        __syncthreads();
    }
    const long long slots = k + (shared >= 0), at = r * slots;
    if (threadIdx.x < k) {
        const int b = threadIdx.x;
        float sum = 0.0f;
        for (int c = 0; c < k; ++c) sum += chosen_score[c];
        float wt = chosen_score[b];
        if (renormalize) wt = wt / (sum + 1e-20f);
        experts[at + b] = chosen_expert[b];
        weights[at + b] = wt * scaling;
    }
    if (shared >= 0 && threadIdx.x == 0) {
        experts[at + k] = shared;
        weights[at + k] = 1.0f;
    }
}

// h[r, s, i] = swiglu(gate_e[i] . x_r, up_e[i] . x_r) for every (row, slot) routed to expert e
// (blockIdx.y); warp per intermediate unit i. h: [t, k, I].
template <typename T>
static __device__ void gate_up(const float* x, const long long* idx, const T* gate_w,
                               const T* up_w, float* h, int t, int k, int I, int D, float limit) {
    int lane = threadIdx.x & 31;
    int i = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    int e = blockIdx.y;
    if (i >= I) return;
    const T* g = gate_w + ((long long)e * I + i) * D;
    const T* u = up_w + ((long long)e * I + i) * D;
    for (int r = 0; r < t; ++r) {
        for (int sl = 0; sl < k; ++sl) {
            if (idx[r * k + sl] != e) continue;
            float gv = warp_dot(g, x + (long long)r * D, D, lane);
            float uv = warp_dot(u, x + (long long)r * D, D, lane);
            if (lane == 0) {
                float a = siluf_exact(fminf(gv, limit));
                h[((long long)r * k + sl) * I + i] = a * fminf(fmaxf(uv, -limit), limit);
            }
        }
    }
}

// y[r, s, c] = down_e[c] . h[r, s] for the (row, slot) pairs routed to expert e; warp per c.
template <typename T>
static __device__ void down(const float* h, const long long* idx, const T* down_w, float* y,
                            int t, int k, int I, int D) {
    int lane = threadIdx.x & 31;
    int c = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    int e = blockIdx.y;
    if (c >= D) return;
    const T* wr = down_w + ((long long)e * D + c) * I;
    for (int r = 0; r < t; ++r) {
        for (int sl = 0; sl < k; ++sl) {
            if (idx[r * k + sl] != e) continue;
            float v = warp_dot(wr, h + ((long long)r * k + sl) * I, I, lane);
            if (lane == 0) y[((long long)r * k + sl) * D + c] = v;
        }
    }
}

extern "C" __global__ void moe_gate_up_f32(const float* x, const long long* idx, const float* gw,
                                           const float* uw, float* h, int t, int k, int I, int D,
                                           float limit) {
    after_predecessor();
    gate_up(x, idx, gw, uw, h, t, k, I, D, limit);
}

extern "C" __global__ void moe_down_f32(const float* h, const long long* idx, const float* dw,
                                        float* y, int t, int k, int I, int D) {
    after_predecessor();
    down(h, idx, dw, y, t, k, I, D);
}

// The distinct experts that idx [n] routes to, ascending, into list; their number into *count.
// One block. The bf16 expert kernels run one block row per listed expert, so a decode step
// launches blocks only for the k experts it reads instead of for all E.
extern "C" __global__ void moe_expert_list(const long long* idx, int n, int E, int* list, int* count) {
    after_predecessor();
    __shared__ int used[MOE_MAX_EXPERTS];
    __shared__ int warp_hits[WARPS_PER_BLOCK];
    __shared__ int listed;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int e = threadIdx.x; e < E; e += MEMRA_BLOCK) used[e] = 0;
    if (threadIdx.x == 0) listed = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n; p += MEMRA_BLOCK)
        if (idx[p] >= 0 && idx[p] < E) used[idx[p]] = 1;
    __syncthreads();
    for (int e0 = 0; e0 < E; e0 += MEMRA_BLOCK) {
        const int e = e0 + threadIdx.x;
        const bool on = e < E && used[e];
        const unsigned hits = __ballot_sync(0xffffffffu, on);
        if (lane == 0) warp_hits[warp] = __popc(hits);
        __syncthreads();
        int at = listed;
        for (int v = 0; v < warp; ++v) at += warp_hits[v];
        if (on) list[at + __popc(hits & ((1u << lane) - 1u))] = e;
        __syncthreads();
        if (threadIdx.x == 0)
            for (int v = 0; v < WARPS_PER_BLOCK; ++v) listed += warp_hits[v];
        __syncthreads();
    }
    if (threadIdx.x == 0) *count = listed;
}

// The launch bounds keep three blocks an SM for a pass of 8 rows (NT = 1): with the one-row loop
// beside the checked one (exact_mma.cuh's ONE) the down tile took 81 registers, which left two.
#define EXPERTS_BF16(NT)                                                                           \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, 4 - NT)                              \
    moe_gate_up_bf16_n##NT(const float* x, const long long* idx, const int* list, const int* listed, \
                           const unsigned short* gw, const unsigned short* uw, float* h, int t,    \
                           int k, int I, int D, float limit) {                                     \
        after_predecessor();                                                                       \
        gate_up_bf16<NT>(x, idx, list, listed, gw, uw, h, t, k, I, D, limit);                      \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, 4 - NT)                              \
    moe_down_bf16_n##NT(const float* h, const long long* idx, const int* list, const int* listed,  \
                        const unsigned short* dw, float* y, int t, int k, int I, int D) {          \
        after_predecessor();                                                                       \
        down_bf16<NT>(h, idx, list, listed, dw, y, t, k, I, D);                                    \
    }

EXPERTS_BF16(1) EXPERTS_BF16(2)

// The launch bounds keep two blocks an SM for a pass of 8 rows (NT = 1): without them the pieces'
// accumulators of a pass of several rows (exact_mma_fp8.cuh) took registers enough to leave one,
// and the experts ran 14-16% slower at t = 1 and 8 (bench_fp8, graph-timed at the bench shapes).
#define EXPERTS_FP8(NT)                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, 3 - NT) moe_gate_up_fp8_n##NT(       \
        const float* x, const long long* idx, const int* list, const int* listed,                  \
        const unsigned char* gw, const float* gs, const unsigned char* uw, const float* us,        \
        float* h, int t, int k, int I, int D, float limit) {                                       \
        after_predecessor();                                                                       \
        gate_up_fp8<NT>(x, idx, list, listed, gw, gs, uw, us, h, t, k, I, D, limit);               \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, 3 - NT)                              \
    moe_down_fp8_n##NT(const float* h, const long long* idx, const int* list, const int* listed,   \
                       const unsigned char* dw, const float* ds, float* y, int t, int k, int I,    \
                       int D) {                                                                    \
        after_predecessor();                                                                       \
        down_fp8<NT>(h, idx, list, listed, dw, ds, y, t, k, I, D);                                 \
    }

EXPERTS_FP8(1) EXPERTS_FP8(2)

// out[r, c] = sum over the row's slots in order of y[r, s, c] * wt[r, s]. A slot whose expert id
// is outside [0, E) was served by no expert block (its y row is unwritten) and adds 0 * wt.
extern "C" __global__ void moe_combine(const float* y, const long long* idx, const float* wts, float* out,
                                       int t, int k, int D, int E) {
    after_predecessor();
    long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)t * D) return;
    long long r = id / D;
    int c = (int)(id % D);
    float acc = 0.0f;
    for (int sl = 0; sl < k; ++sl) {
        const long long e = idx[r * k + sl];
        const float v = e >= 0 && e < E ? y[(r * k + sl) * D + c] : 0.0f;
        acc = acc + v * wts[r * k + sl];
    }
    out[id] = acc;
}
