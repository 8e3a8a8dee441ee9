// Prime family: the small kernels around the prime class's cuBLAS GEMMs (DESIGN.md section 2:
// a prompt longer than the exact class's row cap needs accuracy, not row invariance).
//
//   bf16_pieces:    rows of x split into three bf16 pieces, x = hi + mid + lo exactly (the split
//                   exact_mma.cuh makes), so bf16 GEMMs against bf16 weights give float32-exact
//                   products; `rows` gathers (the routed experts' slots), null takes row i.
//   swiglu_pieces:  the routed experts' hidden rows, as pieces, from their gate and up rows.
//   expert_combine: the routed experts' output rows (GEMM pieces or exact tiles') summed back per
//                   prompt row (moe_combine).
//   piece_copies:   rows of x as chosen pieces at chosen strides: the operands of the prime
//                   attention's six-product GEMMs (backend/pieces.py).
//   row_sum_squares: each row's sum of squares into a column of the mHC partials.
//   selection_mask: keep[i, c] = 1 where row i's position list names position c (c < ctx).
//   masked_softmax_pieces: softmax over the kept columns of scale * s[i, h, :ctx] (others 0),
//                   written as the chosen pieces of the probabilities.
#include "common.cuh"

// The three bf16 pieces of a (hi, mid, lo), each the truncation of what the previous ones left
// (exact_mma.cuh's split): a == hi + mid + lo exactly.
static __device__ __forceinline__ void split_pieces(float a, unsigned short piece[3]) {
    const unsigned hi = __float_as_uint(a) & 0xffff0000u;
    const float rest = a - __uint_as_float(hi);
    const unsigned mid = __float_as_uint(rest) & 0xffff0000u;
    piece[0] = (unsigned short)(hi >> 16);
    piece[1] = (unsigned short)(mid >> 16);
    piece[2] = (unsigned short)(__float_as_uint(rest - __uint_as_float(mid)) >> 16);
}

// The pieces of a into p[0], p[d], p[2d] (a row's pieces side by side: [m, 3, d]).
static __device__ __forceinline__ void put_pieces(float a, unsigned short* p, long long d) {
    unsigned short piece[3];
    split_pieces(a, piece);
    p[0] = piece[0];
    p[d] = piece[1];
    p[2 * d] = piece[2];
}

// Copy s < copies of a's pieces to p[s * stride]: piece (map >> 2s) & 3 (pieces.py's piece_map).
static __device__ __forceinline__ void put_piece_copies(float a, unsigned short* p, int copies, int map,
                                                        long long stride) {
    unsigned short piece[3];
    split_pieces(a, piece);
    for (int s = 0; s < copies; ++s) {
        const int k = (map >> (2 * s)) & 3;  // selects, not an indexed local array (no stack)
        p[s * stride] = k == 0 ? piece[0] : (k == 1 ? piece[1] : piece[2]);
    }
}

// A float32 value from its three pieces' GEMM rows p[0] (hi), p[d] (mid), p[2d] (lo): the
// small ones first.
static __device__ __forceinline__ float sum_pieces(const float* p, int d) {
    return (p[2 * d] + p[d]) + p[0];
}

// sum_pieces of four adjacent columns: 16-byte loads.
static __device__ __forceinline__ float4 sum_pieces4(const float* p, long long d) {
    const float4 hi = *reinterpret_cast<const float4*>(p), mid = *reinterpret_cast<const float4*>(p + d),
                 lo = *reinterpret_cast<const float4*>(p + 2 * d);
    return make_float4((lo.x + mid.x) + hi.x, (lo.y + mid.y) + hi.y, (lo.z + mid.z) + hi.z, (lo.w + mid.w) + hi.w);
}

// The pieces of a's four values into p[0..3] (hi), p[d..] (mid), p[2d..] (lo): 8-byte stores.
static __device__ __forceinline__ void put_pieces4(float4 a, unsigned short* p, long long d) {
    unsigned short x[3], y[3], z[3], w[3];
    split_pieces(a.x, x);
    split_pieces(a.y, y);
    split_pieces(a.z, z);
    split_pieces(a.w, w);
#pragma unroll
    for (int k = 0; k < 3; ++k) *reinterpret_cast<ushort4*>(p + k * d) = make_ushort4(x[k], y[k], z[k], w[k]);
}

// The elementwise kernels below: grid runtime.columns_grid(rows, d / width), for_column_rows's
// layout over columns of `width` values: PIECES_VECTOR (one 16-byte load, 8-byte stores) where
// d is a multiple of it, else 1. The same bits either way.

// out [m, 3, d] = the pieces of x[rows[i]] (rows null: x[i]).
extern "C" __global__ void bf16_pieces(const float* x, const long long* rows, unsigned short* out,
                                       long long m, int d, int width) {
    after_predecessor();
    if (width == 1) {
        for_column_rows(m, d, [&](long long i, int c) {
            const long long src = rows != nullptr ? rows[i] : i;
            put_pieces(x[src * d + c], out + i * 3 * d + c, d);
        });
        return;
    }
    for_column_rows(m, d / PIECES_VECTOR, [&](long long i, int col) {
        const long long src = rows != nullptr ? rows[i] : i;
        const int c = col * PIECES_VECTOR;
        put_pieces4(*reinterpret_cast<const float4*>(x + src * d + c), out + i * 3 * d + c, d);
    });
}

// The routed experts' hidden rows: gate, up [m, 3, I] are GEMM rows of the input's pieces;
// out [m, 3, I] = the pieces of swiglu_clamped (dense.cu's swiglu_kernel) of their sums.
extern "C" __global__ void swiglu_pieces(const float* gate, const float* up, unsigned short* out,
                                         long long m, int d, float limit, int width) {
    after_predecessor();
    if (width == 1) {
        for_column_rows(m, d, [&](long long i, int c) {
            const long long at = i * 3 * d + c;
            put_pieces(swiglu_clamped(sum_pieces(gate + at, d), sum_pieces(up + at, d), limit), out + at, d);
        });
        return;
    }
    for_column_rows(m, d / PIECES_VECTOR, [&](long long i, int col) {
        const long long at = i * 3 * d + col * PIECES_VECTOR;
        const float4 g = sum_pieces4(gate + at, d), u = sum_pieces4(up + at, d);
        const float4 h = make_float4(swiglu_clamped(g.x, u.x, limit), swiglu_clamped(g.y, u.y, limit),
                                     swiglu_clamped(g.z, u.z, limit), swiglu_clamped(g.w, u.w, limit));
        put_pieces4(h, out + at, d);
    });
}

// out [t, D]: row r's expert outputs weighted in slot order (moe.cu's moe_combine), slot
// s = r * k + j read at its sorted row at[s]: from down [gemm_rows, 3, D] (GEMM rows of the hidden
// pieces), or past gemm_rows from tiled (the exact tiles' output rows of the experts of few slots).
extern "C" __global__ void expert_combine(const float* down, long long gemm_rows, const float* tiled,
                                          const long long* at, const float* wts, float* out, int t, int k,
                                          int D) {
    after_predecessor();
    for_column_rows(t, D, [&](long long r, int c) {
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) {
            const long long a = at[r * k + j];
            const float v = a < gemm_rows ? sum_pieces(down + a * 3 * D + c, D) : tiled[(a - gemm_rows) * D + c];
            acc = acc + v * wts[r * k + j];
        }
        out[r * D + c] = acc;
    });
}

// out[i * row_stride + s * copy_stride + c] = copy s of x[i, c]'s pieces (put_piece_copies).
extern "C" __global__ void piece_copies(const float* x, unsigned short* out, long long m, int d, int copies,
                                        int map, long long row_stride, long long copy_stride) {
    after_predecessor();
    for_column_rows(m, d, [&](long long i, int c) {
        put_piece_copies(x[i * d + c], out + i * row_stride + c, copies, map, copy_stride);
    });
}

// grid (rows), block MEMRA_BLOCK: out[r * stride + at] = sum over x[r, :n] of x^2 (one pass
// over the streams, no squared copy).
extern "C" __global__ void row_sum_squares(const float* x, float* out, long long n, int stride, int at) {
    after_predecessor();
    __shared__ float shm[MEMRA_BLOCK];
    const float* row = x + (long long)blockIdx.x * n;
    float acc = 0.0f;
    for (long long j = threadIdx.x; j < n; j += MEMRA_BLOCK) acc = acc + row[j] * row[j];
    acc = block_sum(acc, shm);
    if (threadIdx.x == 0) out[(long long)blockIdx.x * stride + at] = acc;
}

// grid-stride over rows * W list entries; keep [rows, ctx] arrives zeroed.
extern "C" __global__ void selection_mask(const int* positions, unsigned char* keep, int rows, int W,
                                          int ctx) {
    after_predecessor();
    const long long n = (long long)rows * W;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const int c = positions[e];
        if (c >= 0 && c < ctx) keep[(e / W) * ctx + c] = 1;
    }
}

// put_piece_copies of V adjacent values (V = 4: 8-byte stores, p 8-byte aligned).
template <int V>
static __device__ __forceinline__ void put_piece_copies_v(const float (&a)[V], unsigned short* p, int copies,
                                                          int map, long long stride) {
    if constexpr (V == 4) {
        unsigned short x[3], y[3], z[3], w[3];
        split_pieces(a[0], x), split_pieces(a[1], y), split_pieces(a[2], z), split_pieces(a[3], w);
        for (int s = 0; s < copies; ++s) {
            const int k = (map >> (2 * s)) & 3;  // selects, not an indexed local array (no stack)
            const ushort4 v = k == 0 ? make_ushort4(x[0], y[0], z[0], w[0])
                                     : (k == 1 ? make_ushort4(x[1], y[1], z[1], w[1]) : make_ushort4(x[2], y[2], z[2], w[2]));
            *reinterpret_cast<ushort4*>(p + s * stride) = v;
        }
    } else {
        put_piece_copies(a[0], p, copies, map, stride);
    }
}

// The prompt softmax's block reductions (op: max or sum): each warp by warp_xor_reduce, then the
// warps' results in order: two barriers where block_max / block_sum's tree takes nine. The max is
// exact in any order; the sum is prime class's own order.
template <typename Op>
static __device__ __forceinline__ float warps_reduce(float v, float* shm, Op op) {
    v = warp_xor_reduce(v, op);
    if (threadIdx.x % 32 == 0) shm[threadIdx.x / 32] = v;
    __syncthreads();
    float total = shm[0];
#pragma unroll
    for (int w = 1; w < WARPS_PER_BLOCK; ++w) total = op(total, shm[w]);
    __syncthreads();  // read by every thread before shm's next use
    return total;
}

// keep's V bytes at j (V = 4: one 4-byte load; ctx % 4 == 0 keeps every row's start aligned).
template <int V>
static __device__ __forceinline__ void load_keep(const unsigned char* p, bool (&k)[V]) {
    if constexpr (V == 4) {
        const uchar4 b = *reinterpret_cast<const uchar4*>(p);
        k[0] = b.x, k[1] = b.y, k[2] = b.z, k[3] = b.w;
    } else {
        k[0] = p[0];
    }
}

// One (row, head) of masked_softmax_pieces, V adjacent columns a thread at a time.
template <int V>
static __device__ __forceinline__ void softmax_row_pieces(float* row, const unsigned char* kp, unsigned short* out,
                                                          int ctx, float scale, int map, float* cache, float* shm) {
    float* e = cache != nullptr ? cache : row;
    // scale * s where listed, -inf (weight 0) elsewhere
    auto scaled = [&](int j, float (&a)[V]) {
        bool kept[V];
        load_values<V>(row + j, a);
        load_keep<V>(kp + j, kept);
#pragma unroll
        for (int i = 0; i < V; ++i) a[i] = kept[i] ? a[i] * scale : neg_inf();
    };
    float mx = neg_inf();
    for (int j = V * threadIdx.x; j < ctx; j += V * MEMRA_BLOCK) {
        float a[V];
        scaled(j, a);
        if (cache != nullptr) store_values<V>(cache + j, a);
#pragma unroll
        for (int i = 0; i < V; ++i) mx = fmaxf(mx, a[i]);
    }
    mx = warps_reduce(mx, shm, [](float a, float b) { return fmaxf(a, b); });
    float sum = 0.0f;
    for (int j = V * threadIdx.x; j < ctx; j += V * MEMRA_BLOCK) {
        float a[V];
        if (cache != nullptr)
            load_values<V>(cache + j, a);
        else
            scaled(j, a);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            a[i] = a[i] == neg_inf() ? 0.0f : expf(a[i] - mx);
            sum += a[i];
        }
        store_values<V>(e + j, a);
    }
    sum = warps_reduce(sum, shm, [](float a, float b) { return a + b; });
    // a row that lists no position (never one of a prompt: it sees itself) attends nothing
    for (int j = V * threadIdx.x; j < ctx; j += V * MEMRA_BLOCK) {
        float a[V];
        load_values<V>(e + j, a);
#pragma unroll
        for (int i = 0; i < V; ++i) a[i] = sum > 0.0f ? a[i] / sum : 0.0f;
        put_piece_copies_v<V>(a, out + j, 3, map, ctx);
    }
}

// grid (rows * H), block MEMRA_BLOCK: one (row, head) of scores [rows, H, ctx]; out [rows * H,
// 3, ctx] gets the probabilities' pieces in `map`'s order. cached: the row's scaled scores, then
// its exponentials, live in 4 * ctx bytes of dynamic shared memory, so the scores are read from
// global memory once; else the exponentials are kept in place and the row is read three times.
// The same bits either way. width: columns a thread takes at a time, 4 where ctx is a multiple of
// 4 (every row then starts 16-byte aligned), else 1.
extern "C" __global__ void masked_softmax_pieces(float* s, const unsigned char* keep, unsigned short* out,
                                                 int H, int ctx, float scale, int map, int cached, int width) {
    after_predecessor();
    extern __shared__ float4 cache4[];  // float4: 16-byte aligned
    __shared__ float shm[MEMRA_BLOCK];
    const unsigned char* kp = keep + (long long)(blockIdx.x / H) * ctx;
    float* row = s + (long long)blockIdx.x * ctx;
    float* cache = cached ? reinterpret_cast<float*>(cache4) : nullptr;
    unsigned short* o = out + (long long)blockIdx.x * 3 * ctx;
    if (width == 4)
        softmax_row_pieces<4>(row, kp, o, ctx, scale, map, cache, shm);
    else
        softmax_row_pieces<1>(row, kp, o, ctx, scale, map, cache, shm);
}

// An e4m3fn byte as float32, exactly: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0
// is subnormal (m * 2^-9); S.1111.111 is NaN (the format has no infinities).
static __device__ __forceinline__ float e4m3_value(unsigned char b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float mag = (e == 15 && m == 7) ? __int_as_float(0x7fc00000)  // NaN
                      : e == 0 ? (float)m * __int_as_float((127 - 9) << 23)   // m * 2^-9
                               : (float)(8 + m) * __int_as_float((127 + e - 10) << 23);
    return (b & 0x80) ? -mag : mag;
}

// An FP8 matrix [n_out, n_in] with its 128 x 128 block scales, dequantized (one float32 rounding
// of e4m3 * scale, as backend/fp8.py's dequantize) and split into planes out [3, n_out, n_in] of
// its bf16 pieces: a prompt's FP8 projections then run as bf16 GEMMs. `width` weights a thread:
// FP8_PIECES_WIDTH (one 8-byte load, one 16-byte store a plane) where n_in is a multiple of it,
// else 1; the grid's columns are n_in / width.
static_assert(FP8_BLOCK % FP8_PIECES_WIDTH == 0, "a thread's weights share one block scale");
extern "C" __global__ void fp8_pieces(const unsigned char* data, const float* scale, unsigned short* out,
                                      int n_out, int n_in, int width) {
    after_predecessor();
    const long long n = (long long)n_out * n_in;
    const int scale_cols = (n_in + FP8_BLOCK - 1) / FP8_BLOCK;
    if (width == 1) {
        for_column_rows(n_out, n_in, [&](long long o, int i) {
            const long long e = o * n_in + i;
            put_pieces(e4m3_value(data[e]) * scale[(o / FP8_BLOCK) * scale_cols + i / FP8_BLOCK], out + e, n);
        });
        return;
    }
    for_column_rows(n_out, n_in / FP8_PIECES_WIDTH, [&](long long o, int col) {
        const long long e = o * n_in + (long long)col * FP8_PIECES_WIDTH;
        const float s = scale[(o / FP8_BLOCK) * scale_cols + col * FP8_PIECES_WIDTH / FP8_BLOCK];
        const uint2 bytes = *reinterpret_cast<const uint2*>(data + e);
        unsigned short planes[3][FP8_PIECES_WIDTH];
#pragma unroll
        for (int u = 0; u < FP8_PIECES_WIDTH; ++u) {
            const unsigned b = ((u < 4 ? bytes.x : bytes.y) >> (8 * (u % 4))) & 0xffu;
            unsigned short piece[3];
            split_pieces(e4m3_value((unsigned char)b) * s, piece);
#pragma unroll
            for (int p = 0; p < 3; ++p) planes[p][u] = piece[p];
        }
#pragma unroll
        for (int p = 0; p < 3; ++p)
            *reinterpret_cast<uint4*>(out + p * n + e) = *reinterpret_cast<const uint4*>(planes[p]);
    });
}
