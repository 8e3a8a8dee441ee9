// Kimi Delta Attention kernels: causal short conv, log-decay gate, delta-rule recurrence.
// Exact class. A t-row launch performs exactly the arithmetic of t successive one-row launches:
// kda_recurrence walks the rows in order inside one launch, parallel only over (head, value
// column), its state held in registers between rows; short_conv's rows read only inputs (the
// ring is the inputs before the first row), so they run side by side, each with one row's taps.
// Semantics: NumpyBackend.short_conv / kda_gate / kda_recurrence.
#include "common.cuh"

// The wrapper asserts conv taps K <= KDA_MAX_CONV and key dim dk <= KDA_MAX_DK.
// for j = lo .. k - 1 in order: f(j). N = 0: a loop; N > 0: unrolled to N (k <= N) and
// predicated on k, so the arrays f indexes stay in registers.
template <int N, typename F>
static __device__ __forceinline__ void each_tap(int lo, int k, F f) {
    if constexpr (N > 0) {
#pragma unroll
        for (int j = lo; j < N; ++j)
            if (j < k) f(j);
    } else {
        for (int j = lo; j < k; ++j) f(j);
    }
}

// One row of a channel's conv: the K taps in order, tap j meeting input(j) (tap K-1 the row's
// own input, tap 0 the oldest), then SiLU. Every short conv kernel takes it, so the same bits
// (N: each_tap's unrolling).
template <int N = 0, typename Input>
static __device__ __forceinline__ float conv_silu(const float* wc, int k, Input input) {
    float acc = wc[0] * input(0);
    each_tap<N>(1, k, [&](int j) { acc = acc + wc[j] * input(j); });
    return acc * sigmoidf_stable(acc);
}

// x [t, C]; ring [K-1, C] (oldest first, advanced in place); w [C, K], tap K-1 meets the
// current row; out = SiLU(conv), as [C / cg, t, cg]: channel ch's rows at group ch / cg (cg = C
// for [t, C]). A row's conv reads only inputs (the ring holds the K-1 before row 0), so the rows
// need not wait on each other: grid ceil(C / KDA_CONV_LANES), block MEMRA_BLOCK, lane = channel
// of the block's KDA_CONV_LANES, warp v takes rows v, v + 8, ... from the inputs staged in shared
// memory (buf[i]: input i - (K-1) of the chunk, i < K-1 the history before it). Up to VERIFY_CAP
// rows a chunk.
// rows (may be null): the ring before row r < t is written at rows + r * row_stride, so a
// rollback to the first r rows is a copy (r = 0: the ring the walk found; the ring after the
// last row is `ring` itself).
static_assert(VERIFY_CAP >= KDA_MAX_CONV - 1, "a chunk's last K-1 inputs are the next one's history");
static_assert(KDA_CONV_LANES == 32 && MEMRA_BLOCK % 32 == 0, "short_conv: a channel a lane, rows over the warps");
extern "C" __global__ void short_conv(const float* __restrict__ x, float* __restrict__ ring,
                                      const float* __restrict__ w, float* __restrict__ out,
                                      int t, int c, int k, int cg, float* __restrict__ rows,
                                      long long row_stride) {
    after_predecessor();
    constexpr int WARPS = MEMRA_BLOCK / 32;
    __shared__ float buf[KDA_MAX_CONV - 1 + VERIFY_CAP][KDA_CONV_LANES];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, h = k - 1;
    const int ch = blockIdx.x * KDA_CONV_LANES + lane;
    const bool on = ch < c;
    for (int j = warp; j < h; j += WARPS) buf[j][lane] = on ? ring[(long long)j * c + ch] : 0.0f;
    const float* wc = w + (long long)ch * k;
    float* o = out + (long long)(ch / cg) * t * cg + ch % cg;  // row r at o[r * cg]
    int n = 0;
    for (int r0 = 0; r0 < t; r0 += n) {  // more than VERIFY_CAP rows only in a prompt
        if (r0 > 0) {  // the previous chunk's last h inputs become the history (n >= h: disjoint)
            __syncthreads();
            for (int j = warp; j < h; j += WARPS) buf[j][lane] = buf[n + j][lane];
        }
        n = min(VERIFY_CAP, t - r0);
        for (int i = warp; i < n; i += WARPS) buf[h + i][lane] = on ? x[(long long)(r0 + i) * c + ch] : 0.0f;
        __syncthreads();
        for (int i = warp; i < n && on; i += WARPS) {
            o[(long long)(r0 + i) * cg] = conv_silu(wc, k, [&](int j) { return buf[i + j][lane]; });
            if (rows != nullptr)
                for (int j = 0; j < h; ++j) rows[(r0 + i) * row_stride + (long long)j * c + ch] = buf[i + j][lane];
        }
    }
    __syncthreads();
    for (int j = warp; j < h && on; j += WARPS) ring[(long long)j * c + ch] = buf[n + j][lane];
}

// g = lb * sigmoid(exp(a_log) (f + dt_bias)) when has_lb, else -exp(a_log) softplus(f + dt_bias)
// with the reference's softplus (linear above 20). f, out [t, Hk, dk]; dt_bias [Hk, dk].
static __device__ __forceinline__ float kda_gate_value(float f, float a_log, float dt_bias, int has_lb, float lb) {
    const float z = f + dt_bias;
    const float rate = expf(a_log);
    if (has_lb) return lb * sigmoidf_stable(rate * z);
    const float soft = z > 20.0f ? z : log1pf(expf(fminf(z, 20.0f)));
    return -rate * soft;
}

// Channels c .. c + W - 1 of row r (W divides dk: they share a head).
template <int W>
static __device__ __forceinline__ void gate_channels(const float* f, const float* a_log, const float* dt_bias,
                                                     float* out, long long r, int c, int hk, int dk, int has_lb,
                                                     float lb) {
    const long long idx = r * hk * dk + c;
    float fv[W], bv[W], g[W];
    load_values<W>(f + idx, fv);
    load_values<W>(dt_bias + c, bv);
    const float al = a_log[c / dk];
#pragma unroll
    for (int e = 0; e < W; ++e) g[e] = kda_gate_value(fv[e], al, bv[e], has_lb, lb);
    store_values<W>(out + idx, g);
}

// Grid runtime.columns_grid(t, Hk dk / width): a thread makes `width` channels of a row (1, or
// KDA_GATE_VECTOR for a prompt's rows: a float4 each, more bytes in flight a thread).
extern "C" __global__ void kda_gate(const float* __restrict__ f, const float* __restrict__ a_log,
                                    const float* __restrict__ dt_bias, float* __restrict__ out,
                                    int t, int hk, int dk, int has_lb, float lb, int width) {
    after_predecessor();
    if (width == KDA_GATE_VECTOR)
        for_column_rows(t, hk * dk / KDA_GATE_VECTOR, [&](long long r, int col) {
            gate_channels<KDA_GATE_VECTOR>(f, a_log, dt_bias, out, r, col * KDA_GATE_VECTOR, hk, dk, has_lb, lb);
        });
    else
        for_column_rows(t, hk * dk, [&](long long r, int c) {
            gate_channels<1>(f, a_log, dt_bias, out, r, c, hk, dk, has_lb, lb);
        });
}

// Delta rule over the t rows in order, per head h:
//   S <- S * exp(g)[:, None];  S += k (x) beta (v - S^T k);  o = S^T q.
// q, k, g [t, Hk, dk]; v [t, Hk, dv]; beta [t, Hk]; state [Hk, dk, dv] float32 in place;
// out [t, Hk, dv]. Grid (Hk, ceil(dv / KDA_COLS)), block MEMRA_BLOCK: thread (column c = lane,
// key lane kq = warp) holds column j0 + c of S at the keys of its KPT slots: slot m is key
// 16 (8 (m / 16) + kq) + m % 16 (16-key blocks dealt to the 8 key lanes in turn), so a warp is
// one key lane of 32 adjacent columns: its loads and stores of S are whole 128-byte key rows, and
// its reads of a staged row's k and exp(g) are one address for all 32 lanes. Both
// dk-reductions: each thread over its slots in order, then the column's 8 key-lane partials
// through shared memory, added as the xor tree over offsets 4, 2, 1 of the 8 lanes that once
// held a column adds them (key_lanes_sum), so every thread gets the same bits. A slot past dk holds
// zeros (S, k, exp(g) and q staged as +0), so it adds +0 to both sums, which changes neither (a
// sum that starts at +0 is never -0): the row loop tests no slot, and kda_recurrence_k32 does a
// dk <= 128 walk's arithmetic exactly as k16 does.
// The block stages STAGE rows' q, k, exp(g), v and beta in shared memory at a time: exp(g) is
// taken once per key, not once per state entry, and a row's compute waits on no global load.
// A verify walk records what its rollback needs (marks, rec non-null): S after m KDA_MARK_ROWS rows
// at marks + m Hk dk dv while rows follow (m = 0: S as the walk found it), and each row's k, g
// (before exp), v and beta at rec [t, Hk, rw], a (row, head) laid out k | g | v | beta (rw = 2 dk
// + dv + 1). kda_replay walks the rows from the last mark up to keep again with the same staging
// and per-row arithmetic, q and o left out (S never reads them), so it leaves S bit for bit as
// the walk did after those rows: a rollback costs one launch for every layer of a part, walks
// fewer than KDA_MARK_ROWS rows, and the walk writes a state every KDA_MARK_ROWS rows, not one a row.
// Why a warp is a key lane (graph-timed at H 64 x 128 against a warp of 4 columns x 8 key lanes
// whose partials met in an xor tree of shuffles, the same bits): that layout read each staged
// key's k and exp(g) once for each of a warp's 4 columns, 4x the distinct bytes through the
// shared-memory pipe every row, and moved S in 16-byte pieces of 8 key rows (stored through a
// shared slab to make whole rows). Against it, in one run: the step's walk at t = 1 / 8 / 15
// 4.79 / 9.67 / 14.9 -> 4.28 / 8.50 / 13.1 us, a recording walk of 8 / 15 rows 11.6 / 18.2 ->
// 9.2 / 14.7, the replay of 9 layers keeping 1 / 7 / 14 rows 34.1 / 54.9 / 50.8 -> 26.7 / 46.9 / 43.0.
constexpr int KDA_KEY_LANES = MEMRA_BLOCK / KDA_COLS;
static_assert(KDA_KEY_LANES == 8, "a column's key lanes: 8 warps, a 3-level tree");
static_assert(KDA_MAX_DK <= KDA_KEY_LANES * 32, "kda_recurrence_k32 holds 32 keys a thread");
static_assert(KDA_COLS == 32, "a warp's lanes are a key lane's columns");
constexpr int KDA_KEY_BLOCK = 16;  // keys dealt to a key lane at a time

// The key of slot m of key lane kq.
static __device__ __forceinline__ int slot_key(int m, int kq) {
    return KDA_KEY_BLOCK * (KDA_KEY_LANES * (m / KDA_KEY_BLOCK) + kq) + m % KDA_KEY_BLOCK;
}

// s (the thread's KPT slots of column j, key lane kq) -> S [dk, dv] at column j: a warp's store
// of a slot is a whole key row.
template <int KPT>
static __device__ void store_state(const float (&s)[KPT], float* dst, int dk, int dv, int j, int kq) {
    if (j >= dv) return;
#pragma unroll
    for (int m = 0; m < KPT; ++m)
        if (slot_key(m, kq) < dk) dst[(long long)slot_key(m, kq) * dv + j] = s[m];
}

// A column's sum of its 8 key lanes' partials, in every thread: the order an xor butterfly over
// offsets 4, 2, 1 adds them in, ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)). Two buffers
// taken in turn (`turn`, the same in every thread): a sum's writes into one come after the
// barrier of the sum before it, so after every thread's reads of the one before that.
struct KeyLanes {
    float p[2][KDA_KEY_LANES][KDA_COLS];
};

static __device__ __forceinline__ float key_lanes_sum(float v, KeyLanes& kl, int& turn, int c, int kq) {
    float(*p)[KDA_COLS] = kl.p[turn];
    turn ^= 1;
    p[kq][c] = v;
    __syncthreads();
    return ((p[0][c] + p[4][c]) + (p[2][c] + p[6][c])) + ((p[1][c] + p[5][c]) + (p[3][c] + p[7][c]));
}

// Where kda_rows reads its rows: a walk's q, k, g [t, Hk, dk], v [t, Hk, dv], beta [t, Hk], or a
// recorded walk's rows (no q). kw, vw, bw: floats from one (row, head) to the next.
struct KdaRowsIn {
    const float *q, *k, *g, *v, *beta;
    int kw, vw, bw;
};

// PLAIN: a walk (decode step); RECORD: a verify walk, which also writes marks and rec; REPLAY: S
// from `from` through the rows, stored to state; no q, no out, nothing recorded. Each its own
// kernel, so a decode step carries none of the recording's code.
enum class KdaWalk { PLAIN, RECORD, REPLAY };

template <int KPT, int STAGE, KdaWalk MODE>
static __device__ void kda_rows(const KdaRowsIn in, const float* from, float* state, float* __restrict__ out,
                                int t, int hk, int dk, int dv, float* __restrict__ marks,
                                float* __restrict__ rec, int rw) {
    // a staged key row: each key lane's KPT keys in slot order (a warp's float4 reads: one address)
    constexpr int LANE = KPT, ROW = KDA_KEY_LANES * LANE;
    static_assert(KPT % KDA_KEY_BLOCK == 0, "float4 reads of whole key blocks");
    constexpr bool REPLAY = MODE == KdaWalk::REPLAY, RECORD = MODE == KdaWalk::RECORD;
    __shared__ __align__(16) float sq[REPLAY ? 1 : STAGE][ROW], sk[STAGE][ROW], se[STAGE][ROW];
    __shared__ float sv[STAGE][KDA_COLS], sb[STAGE];
    __shared__ KeyLanes lanes;
    const int h = blockIdx.x, c = threadIdx.x % KDA_COLS, kq = threadIdx.x / KDA_COLS;
    int turn = 0;
    const int j0 = blockIdx.y * KDA_COLS, j = j0 + c;
    const bool active = j < dv, keys = blockIdx.y == 0;  // the first column block records k, g, beta
    const long long at = (long long)h * dk * dv + j;  // S[0, j]
    float s[KPT];
#pragma unroll
    for (int m = 0; m < KPT; ++m)
        s[m] = active && slot_key(m, kq) < dk ? from[at + (long long)slot_key(m, kq) * dv] : 0.0f;
    const long long plane = (long long)hk * dk * dv;  // one mark of this layer
    if constexpr (RECORD) store_state<KPT>(s, marks + (long long)h * dk * dv, dk, dv, j, kq);
    for (int r0 = 0; r0 < t; r0 += STAGE) {
        const int n = min(STAGE, t - r0);
        __syncthreads();  // the previous stage is read
        for (int idx = threadIdx.x; idx < n * KDA_KEY_LANES * KPT; idx += MEMRA_BLOCK) {
            const int r = idx / (KDA_KEY_LANES * KPT), i = idx % (KDA_KEY_LANES * KPT), b = i / KDA_KEY_BLOCK;
            const int slot = b % KDA_KEY_LANES * LANE + b / KDA_KEY_LANES * KDA_KEY_BLOCK + i % KDA_KEY_BLOCK;
            const long long src = ((long long)(r0 + r) * hk + h) * in.kw + i;
            const float kv = i < dk ? in.k[src] : 0.0f, gv = i < dk ? in.g[src] : 0.0f;
            if constexpr (!REPLAY) sq[r][slot] = i < dk ? in.q[src] : 0.0f;
            sk[r][slot] = kv;
            se[r][slot] = i < dk ? expf(gv) : 0.0f;
            if (RECORD && keys && i < dk) {
                float* to = rec + ((long long)(r0 + r) * hk + h) * rw;
                to[i] = kv;
                to[dk + i] = gv;
            }
        }
        for (int idx = threadIdx.x; idx < n * KDA_COLS; idx += MEMRA_BLOCK) {
            const int r = idx / KDA_COLS, cc = idx % KDA_COLS;
            const float vv = j0 + cc < dv ? in.v[((long long)(r0 + r) * hk + h) * in.vw + j0 + cc] : 0.0f;
            sv[r][cc] = vv;
            if (RECORD && j0 + cc < dv) rec[((long long)(r0 + r) * hk + h) * rw + 2 * dk + j0 + cc] = vv;
        }
        if (threadIdx.x < n) {
            const long long row = (long long)(r0 + threadIdx.x) * hk + h;
            sb[threadIdx.x] = in.beta[row * in.bw];
            if (RECORD && keys) rec[row * rw + 2 * dk + dv] = sb[threadIdx.x];
        }
        __syncthreads();
        for (int r = 0; r < n; ++r) {
            const float4* e4 = reinterpret_cast<const float4*>(&se[r][kq * LANE]);
            const float4* k4 = reinterpret_cast<const float4*>(&sk[r][kq * LANE]);
            float kk[KPT], ks = 0.0f;
#pragma unroll
            for (int m4 = 0; m4 < KPT / 4; ++m4) {
                const float4 e = e4[m4], kv = k4[m4];
                const float ev[4] = {e.x, e.y, e.z, e.w}, kvv[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int m = 4 * m4 + u;
                    kk[m] = kvv[u];
                    s[m] = s[m] * ev[u];
                    ks += kk[m] * s[m];
                }
            }
            ks = key_lanes_sum(ks, lanes, turn, c, kq);
            const float delta = (sv[r][c] - ks) * sb[r];
            float qs = 0.0f;
#pragma unroll
            for (int m4 = 0; m4 < KPT / 4; ++m4) {
                float qvv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                if constexpr (!REPLAY) {
                    const float4 qv = reinterpret_cast<const float4*>(&sq[r][kq * LANE])[m4];
                    qvv[0] = qv.x; qvv[1] = qv.y; qvv[2] = qv.z; qvv[3] = qv.w;
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int m = 4 * m4 + u;
                    s[m] = s[m] + kk[m] * delta;
                    if constexpr (!REPLAY) qs += qvv[u] * s[m];
                }
            }
            if constexpr (!REPLAY) {
                qs = key_lanes_sum(qs, lanes, turn, c, kq);
                if (active && kq == 0) out[((long long)(r0 + r) * hk + h) * dv + j] = qs;
                const int done = r0 + r + 1;  // rows walked: a mark when rows follow
                if (RECORD && done % KDA_MARK_ROWS == 0 && done < t)
                    store_state<KPT>(s, marks + done / KDA_MARK_ROWS * plane + (long long)h * dk * dv, dk, dv, j, kq);
            }
        }
    }
    store_state<KPT>(s, state + (long long)h * dk * dv, dk, dv, j, kq);
}

// The walk: grid (Hk, ceil(dv / KDA_COLS)), block MEMRA_BLOCK; NAME##_record also writes marks and rec.
// The replay: grid (Hk, ceil(dv / KDA_COLS), layers): layer z's rec at rec + z cap Hk rw (k | g | v
// | beta), its nmarks marks [nmarks, Hk, dk, dv] at marks + z nmarks Hk dk dv, its state plane
// [Hk, dk, dv] at state + z Hk dk dv; it walks from mark keep / KDA_MARK_ROWS. Its blocks outnumber what the GPU
// holds at once (every layer's heads), so REPLAY_BLOCKS of them share an SM: k16's replay fits 4
// in 64 registers without spilling (bench's 9 layers, graph-timed against 3 an SM in one run,
// the same bits: keeping 1, 7 and 14 rows 39.7 -> 38.2, 63.4 -> 60.2 and 91.2 -> 85.3 us).
#define KDA_RECURRENCE(NAME, KPT, STAGE, REPLAY_BLOCKS)                                                  \
    extern "C" __global__ void NAME(const float* __restrict__ q, const float* __restrict__ k,            \
                                    const float* __restrict__ v, const float* __restrict__ g,            \
                                    const float* __restrict__ beta, float* state,                        \
                                    float* __restrict__ out, int t, int hk, int dk, int dv) {            \
        after_predecessor();                                                                             \
        kda_rows<KPT, STAGE, KdaWalk::PLAIN>(KdaRowsIn{q, k, g, v, beta, dk, dv, 1}, state, state, out,  \
                                             t, hk, dk, dv, nullptr, nullptr, 0);                        \
    }                                                                                                    \
    extern "C" __global__ void NAME##_record(const float* __restrict__ q, const float* __restrict__ k,   \
                                             const float* __restrict__ v, const float* __restrict__ g,   \
                                             const float* __restrict__ beta, float* state,               \
                                             float* __restrict__ out, int t, int hk, int dk, int dv,     \
                                             float* __restrict__ marks, float* __restrict__ rec, int rw) { \
        after_predecessor();                                                                             \
        kda_rows<KPT, STAGE, KdaWalk::RECORD>(KdaRowsIn{q, k, g, v, beta, dk, dv, 1}, state, state, out, \
                                              t, hk, dk, dv, marks, rec, rw);                            \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(MEMRA_BLOCK, REPLAY_BLOCKS)                             \
        NAME##_replay(const float* __restrict__ rec, const float* marks, float* state, int keep, int hk, \
                      int dk, int dv, int rw, int cap, int nmarks) {                                     \
        after_predecessor();                                                                             \
        const int mark = keep / KDA_MARK_ROWS, first = mark * KDA_MARK_ROWS;                             \
        const float* r = rec + ((long long)blockIdx.z * cap + first) * hk * rw;                          \
        const long long plane = (long long)hk * dk * dv;                                                 \
        const KdaRowsIn in{nullptr, r, r + dk, r + 2 * dk, r + 2 * dk + dv, rw, rw, rw};                 \
        kda_rows<KPT, STAGE, KdaWalk::REPLAY>(in, marks + ((long long)blockIdx.z * nmarks + mark) * plane, \
                                              state + blockIdx.z * plane, nullptr, keep - first, hk, dk, \
                                              dv, nullptr, nullptr, rw);                                 \
    }
// dk <= 128 (every KDA checkpoint so far): a verify walk in one stage
KDA_RECURRENCE(kda_recurrence_k16, 16, VERIFY_CAP, 4)
KDA_RECURRENCE(kda_recurrence_k32, 32, 8, 1)   // up to KDA_MAX_DK; shared memory holds 8 rows of 256 keys

// short_conv for a prompt (prime class): the rows split into spans of KDA_CONV_SPAN, a thread
// per (channel, span), each output conv_silu's (so the same bits). The taps and the K-1 inputs
// before a row stay in registers (loops unrolled to K and predicated on k <= K; k == K for the
// checkpoints' 4 taps), and CONV_BATCH rows' inputs load before any is used: one load in flight
// a thread, a row at a time, left the kernel latency-bound at ~40% of the copy bandwidth. The
// ring is only read: the wrapper copies the last K-1 rows of x into it.
constexpr int CONV_BATCH = 8;

template <int K>
static __device__ void conv_spans(const float* __restrict__ x, const float* __restrict__ ring,
                                  const float* __restrict__ w, float* __restrict__ out, int t, int c, int k,
                                  int cg) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int r0 = blockIdx.y * KDA_CONV_SPAN, r1 = min(r0 + KDA_CONV_SPAN, t);
    if (ch >= c) return;
    float* o = out + (long long)(ch / cg) * t * cg + ch % cg;
    float wc[K], hist[K];  // hist[0 .. k - 2]: the K-1 inputs before the next row, oldest first
#pragma unroll
    for (int j = 0; j < K; ++j) {
        wc[j] = j < k ? w[(long long)ch * k + j] : 0.0f;
        const int src = r0 - (k - 1) + j;  // before row r0: rows of x, or the ring's
        hist[j] = j >= k - 1 ? 0.0f : src >= 0 ? x[(long long)src * c + ch] : ring[(long long)(src + k - 1) * c + ch];
    }
    for (int r = r0; r < r1; r += CONV_BATCH) {
        float xb[CONV_BATCH];
#pragma unroll
        for (int b = 0; b < CONV_BATCH; ++b) xb[b] = r + b < r1 ? x[(long long)(r + b) * c + ch] : 0.0f;
#pragma unroll
        for (int b = 0; b < CONV_BATCH; ++b) {
            if (r + b < r1)
                o[(long long)(r + b) * cg] = conv_silu<K>(wc, k, [&](int j) { return j < k - 1 ? hist[j] : xb[b]; });
#pragma unroll
            for (int j = 0; j < K - 1; ++j)  // the window moves on by one row
                if (j < k - 2) hist[j] = hist[j + 1];
                else if (j == k - 2) hist[j] = xb[b];
        }
    }
}

extern "C" __global__ void short_conv_spans(const float* __restrict__ x, const float* __restrict__ ring,
                                            const float* __restrict__ w, float* __restrict__ out,
                                            int t, int c, int k, int cg) {
    after_predecessor();
    if (k == 4) conv_spans<4>(x, ring, w, out, t, c, 4, cg);
    else conv_spans<KDA_MAX_CONV>(x, ring, w, out, t, c, k, cg);
}
