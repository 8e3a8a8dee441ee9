"""The prime class of the CUDA backend (kernels_cu/prime.cu + cuBLAS): a prompt's rows past the
exact class's cap.

DESIGN.md section 2: a walk of more than VERIFY_CAP rows is a prefill, whose results feed plain
and speculative generation alike, so it needs accuracy, not row invariance. Its projections,
routed experts and attention run as cuBLAS GEMMs instead of the exact tiles (which read every
weight once per 16 rows and run at under 2% of the tensor cores' rate on a long prompt):

* a bf16 weight meets the three exact bf16 pieces of each float32 activation (x = hi + mid +
  lo, the split exact_mma.cuh makes) in three bf16 GEMMs accumulated in float32, so every
  product is a float32-exact one, as in the exact tiles; only the summation order differs;
* the attention's scores and mixes, float32 operands on both sides, run as bf16 GEMMs of the
  six piece products of size at least 2^-16 (backend/pieces.py): float32-accurate, on tensor
  cores (prime_attention.py; an MLA layer attends per head, to keys and values expanded from
  its latent once, where that takes fewer products than the absorbed form);
* an FP8 weight is dequantized (e4m3 times its block scale, one float32 rounding) into the bf16
  pieces of its float32 values, and meets the activation's pieces in the six products of size
  at least 2^-16 (a routed expert's piece rows too: each weight piece meets the row sets of
  the activation pieces it is kept with);
* a routed expert serving fewer than TILE_ROWS of the prompt's slots runs on the exact tiles
  (moe.py's expert_tiles, as in a decode step): few rows do not repay its GEMMs' launches, nor
  an FP8 expert's dequantization; the exact tiles are float32-exact products too;
* the host sizes each routed expert's GEMMs from its slot count, the one wait of an MoE block:
  the counts' copy is started first, and the shared expert (every row's last slot) runs while
  the host waits and issues the rest (cupy's bincount would wait for the GPU twice more);
* a float32 weight (test fixtures) or the remaining float32 x float32 products (router logits,
  pool scores, mHC partials) run as float32 GEMMs (cupy.matmul: no TF32 unless CUPY_TF32 is set;
  the mHC partials call cuBLAS at COMPUTE_32F directly, never TF32).

    y = prime_linear(x, w_bf16)         # x [t, in] float32, t > VERIFY_CAP
"""

from __future__ import annotations

import numpy as np

import cupy as cp
import cupyx
from cupy_backends.cuda.libs import cublas

from memra.backend.cuda.fp8 import DeviceFp8
from memra.backend.cuda.runtime import BLOCK, check, columns_grid, f32, host_copy_later, i32, launch
from memra.backend.pieces import PIECES
from memra.kernels_cu.constants import FP8_PIECES_WIDTH, PIECES_VECTOR
from memra.limits import ATTEND_BYTES, MOE_ROWS, VERIFY_CAP

R_16BF, R_32F = 14, 0                    # cudaDataType
COMPUTE_32F, GEMM_DEFAULT = 68, -1       # cublasComputeType_t, cublasGemmAlgo_t
POINTER_HOST = 0                         # cublasPointerMode_t: alpha and beta live on the host
HC_SPLITS = 16                           # slices of the mHC matvec's flattened axis
# (activation piece, weight piece) of a projection's GEMMs, smallest first (0 hi, 1 mid, 2 lo):
# a bf16 weight is one piece; an FP8 weight's float32 values are three, of which the six
# products of size at least 2^-16 of the product are kept
X_PRODUCTS = ((2, 0), (1, 0), (0, 0))
WEIGHT_PRODUCTS = ((2, 0), (0, 2), (1, 1), (1, 0), (0, 1), (0, 0))
# An expert serving fewer slots of a prompt than this runs on the exact tiles (moe.expert_tiles):
# there it reads its weights once per 16 slots in two launches, where its GEMMs take three
# launches a weight (FP8: fifteen, and a dequantization of the whole expert). The first slot
# count at which the GEMMs were no slower, an expert of bench's widths on the H200 (wall time):
# bf16 67 against 74 us at 32 slots, FP8 290 against 293 us at 128
TILE_ROWS = {"bf16": 32, "fp8": 128}
ONE, ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


def is_prime(t: int) -> bool:
    """A call of t rows is prime class: more rows than any exact-class walk (decode, verify) has."""
    return t > VERIFY_CAP


def vector_width(n: int, vector: int, *arrays) -> int:
    """Values a thread of an elementwise kernel over rows of n: `vector` where the rows
    split so and every array starts aligned to a vector of its items (then every row does), else one."""
    aligned = all(a.data.ptr % (a.itemsize * vector) == 0 for a in arrays)
    return vector if n % vector == 0 and aligned else 1


def prompt_width(t: int, n: int, vector: int, *arrays) -> int:
    """vector_width for a prompt's t rows (more values a thread: more bytes in flight), one for a
    decode walk's few rows (more blocks for a row). The sums per value do not change, nor the bits."""
    return vector_width(n, vector, *arrays) if is_prime(t) else 1


def pieces(x, rows=None):
    """[m, PIECES, d] bf16 bits of x [t, d] float32 (or of x[rows], rows int64 [m]): row i's
    hi, mid and lo side by side, so a GEMM can take one piece (row stride 3d) or all three."""
    check(x, cp.float32, "x")
    if rows is not None:
        check(rows, cp.int64, "rows")
    m, d = (x.shape[0] if rows is None else rows.size), x.shape[1]
    out = cp.empty((m, PIECES, d), cp.uint16)
    if m * d:
        width = vector_width(d, PIECES_VECTOR, x, out)
        launch("prime", "bf16_pieces", columns_grid(m, d // width), (BLOCK,),
               (x, rows, out, np.int64(m), i32(d), i32(width)))
    return out


def cublas_handle() -> int:
    """cupy's cuBLAS handle on the current stream, alpha and beta read from the host."""
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    cublas.setPointerMode(handle, POINTER_HOST)
    return handle


def gemm_bf16(handle: int, m: int, n: int, k: int, left: int, ld_left: int, right: int, ld_right: int,
               c: int, ldc: int, right_is_kn: bool = False, accumulate: bool = False) -> None:
    """C [m, n] (+)= L [m, k] @ R.T for R [n, k], or L @ R for R [k, n] (right_is_kn); row-major
    bf16 bits at addresses left, right with row strides ld_left, ld_right, C float32 at c with
    row stride ldc (cuBLAS is column-major: C^T = op(R) L^T)."""
    op_right = cublas.CUBLAS_OP_N if right_is_kn else cublas.CUBLAS_OP_T
    cublas.gemmEx(handle, op_right, cublas.CUBLAS_OP_N, n, m, k, ONE.ctypes.data, right, R_16BF, ld_right,
                  left, R_16BF, ld_left, (ONE if accumulate else ZERO).ctypes.data, c, R_32F, ldc,
                  COMPUTE_32F, GEMM_DEFAULT)


def gemm_bf16_batched(handle: int, op_a: int, op_b: int, m: int, n: int, k: int, a: int, lda: int, stride_a: int,
                      b: int, ldb: int, stride_b: int, c: int, ldc: int, stride_c: int, batch: int,
                      accumulate: bool = False) -> None:
    """cuBLAS's column-major C_i [m, n] (+)= op_a(A_i) op_b(B_i) for i < batch: A and B bf16 bits,
    C float32, each operand i at its address + i * its stride (in items)."""
    cublas.gemmStridedBatchedEx(
        handle, op_a, op_b, m, n, k, ONE.ctypes.data, a, R_16BF, lda, stride_a, b, R_16BF, ldb, stride_b,
        (ONE if accumulate else ZERO).ctypes.data, c, R_32F, ldc, stride_c, batch, COMPUTE_32F, GEMM_DEFAULT)


def _gemm(handle: int, b: int, ldb: int, m: int, w, c: int, accumulate: bool = False) -> None:
    """C [m, n_out] (+)= B [m, n_in] @ w.T: B bf16 bits at address b with row stride ldb, w [n_out,
    n_in] bf16 bits, C float32 at address c."""
    n_out, n_in = w.shape
    gemm_bf16(handle, m, n_out, n_in, b, ldb, w.data.ptr, n_in, c, n_out, accumulate=accumulate)


def gemm_pieces(xp, w):
    """[t, n_out] = the sum over the pieces of xp [t, 3, n_in] of piece @ w.T, accumulated in
    float32 from the smallest piece up; w [n_out, n_in] bf16 bits."""
    check(w, cp.uint16, "w")
    assert w.shape[1] == xp.shape[2], f"w {w.shape} for pieces {xp.shape}"
    return _gemm_products(xp, w[None], X_PRODUCTS)


def prime_linear(x, w, xp=None):
    """y = x @ w.T for prime-class rows; w [out, in] float32, bf16 bits or DeviceFp8; xp: x's
    pieces, when the caller shares them between the projections of one input."""
    check(x, cp.float32, "x")
    assert x.ndim == 2 and x.shape[1] == w.shape[1], f"x: expected [t, {w.shape[1]}], got {x.shape}"
    fp8 = isinstance(w, DeviceFp8)
    if not fp8 and w.dtype == cp.float32:
        return cp.ascontiguousarray(cp.matmul(x, w.T))
    xp = pieces(x) if xp is None else xp
    return _gemm_products(xp, fp8_pieces(w.data, w.scale_inv), WEIGHT_PRODUCTS) if fp8 else gemm_pieces(xp, w)


def fp8_pieces(data, scale_inv):
    """[3, out, in] planes of bf16 bits: the pieces of an FP8 matrix's float32 values (each e4m3
    times its 128 x 128 block's scale, one rounding: backend/fp8.py's dequantize)."""
    check(data, cp.uint8, "fp8 data")
    check(scale_inv, cp.float32, "fp8 scale_inv")
    n_out, n_in = data.shape
    out = cp.empty((PIECES, n_out, n_in), cp.uint16)
    if data.size:
        width = vector_width(n_in, FP8_PIECES_WIDTH, data, out)
        launch("prime", "fp8_pieces", columns_grid(n_out, n_in // width), (BLOCK,),
               (data, scale_inv, out, i32(n_out), i32(n_in), i32(width)))
    return out


def _gemm_products(xp, planes, products):
    """[t, n_out] = the sum of products (x piece a, weight plane b) of xp [t, 3, n_in] and planes
    [*, n_out, n_in] (bf16 bits), one GEMM each, accumulated in float32 in the order given."""
    (t, _, n_in), n_out = xp.shape, planes.shape[1]
    if not (t and n_out and n_in):
        return cp.zeros((t, n_out), cp.float32)
    out = cp.empty((t, n_out), cp.float32)
    handle = cublas_handle()
    for i, (a, b) in enumerate(products):
        _gemm(handle, xp.data.ptr + 2 * a * n_in, PIECES * n_in, t, planes[b], out.data.ptr, accumulate=i > 0)
    return out


def _expert_gemm(handle: int, b: int, ldb: int, m: int, stack, ex: int, c: int) -> None:
    """C [3m, out] (+)= B @ stack[ex].T for B's 3m piece rows of bf16 bits (each of m slots' hi,
    mid and lo rows, row stride ldb): a bf16 expert in one GEMM. An FP8 expert adds, into C the
    caller zeroed, the six products of size at least 2^-16, smallest weight piece first: the lo
    plane meets the hi rows, the mid plane the hi and the mid rows (row sets of stride 3), the
    hi plane every row; 6m rows' GEMMs instead of 9m."""
    if not isinstance(stack, DeviceFp8):
        _gemm(handle, b, ldb, PIECES * m, stack[ex], c)
        return
    planes = fp8_pieces(stack.data[ex], stack.scale_inv[ex])
    n_out, n_in = planes.shape[1:]
    for piece in reversed(range(1, PIECES)):
        for rows in range(PIECES - piece):  # the activation pieces this weight piece is kept with
            gemm_bf16(handle, m, n_out, n_in, b + 2 * rows * ldb, PIECES * ldb, planes[piece].data.ptr, n_in,
                       c + 4 * rows * n_out, PIECES * n_out, accumulate=True)
    _gemm(handle, b, ldb, PIECES * m, planes[0], c, accumulate=True)


def _expert_rows(shape, stack):
    """The float32 GEMM rows of an expert matrix: zeroed when its FP8 products accumulate into them."""
    return cp.zeros(shape, cp.float32) if isinstance(stack, DeviceFp8) else cp.empty(shape, cp.float32)


def prime_head_linear(x, w):
    """y[r, h] = w[h] @ x[r, h] for prime-class rows; x [t, H, in] float32, w [H, out, in] float32
    or bf16 bits: one GEMM batched over the heads (bf16: per piece of x, smallest first)."""
    check(x, cp.float32, "x")
    (t, heads, n_in), n_out = x.shape, w.shape[1]
    if w.dtype == cp.float32:
        return cp.ascontiguousarray(cp.matmul(x.transpose(1, 0, 2), w.transpose(0, 2, 1)).transpose(1, 0, 2))
    out = cp.zeros((t, heads, n_out), cp.float32)
    if not (t and heads and n_out and n_in):
        return out
    xp, handle = pieces(x.reshape(t * heads, n_in)), cublas_handle()  # [t, H, 3, in]
    for i, piece in enumerate(reversed(range(PIECES))):
        # column-major per head: out_h^T [out, t] (+)= w_h [out, in] x_h^T [in, t]
        gemm_bf16_batched(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n_out, t, n_in, w.data.ptr, n_in,
                          n_out * n_in, xp.data.ptr + 2 * piece * n_in, heads * PIECES * n_in, PIECES * n_in,
                          out.data.ptr, heads * n_out, n_out, heads, accumulate=i > 0)
    return out


def prime_experts(x, idx, wts, gate_w, up_w, down_w, limit: float, tiles, shared: bool = False):
    """The routed experts of a prompt's rows -> [t, D], MOE_ROWS rows at a time (the hidden rows
    of t * k slots in three pieces: about 1.2 KB per slot and hidden unit); `tiles`: moe.py's
    expert_tiles, for the experts of few slots. shared: every row's last slot is the stacks' last
    expert (moe_route's shared slot), whose rows are known without reading any count."""
    out = cp.empty_like(x)
    for r0 in range(0, x.shape[0], MOE_ROWS):
        rows = slice(r0, r0 + MOE_ROWS)
        _experts(x[rows], idx[rows], wts[rows], (gate_w, up_w, down_w), limit, tiles, shared, out[rows])
    return out


def _experts(x, idx, wts, stacks, limit: float, tiles, shared: bool, out) -> None:
    """out [t, D] (a row slice: contiguous) = the experts of x's rows. The host needs the routed
    slot counts to size each expert's GEMMs: their copy is started first, and while the host
    waits for it and issues the routed GEMMs, the GPU sorts the (row, slot) pairs by expert (the
    experts of at least TILE_ROWS slots first) and runs the shared expert over every row. Each
    GEMM expert runs as 3m piece rows, one GEMM per weight (the hidden rows one kernel); the rest
    run on the exact tiles, their pairs gathered as rows of one slot. The weighted sum per row
    reads each slot's output where it was made: the shared expert's rows first, then the sorted
    GEMM rows, then the tiles'."""
    (t, k), (e, _, d) = idx.shape, stacks[0].shape
    min_rows = TILE_ROWS["fp8" if isinstance(stacks[0], DeviceFp8) else "bf16"]
    ahead = shared and t >= min_rows  # few rows: the shared expert is one more tiled expert
    routed = k - ahead
    flat = idx[:, :routed].reshape(-1)
    counts = cp.zeros(e, cp.int32)
    cupyx.scatter_add(counts, flat, 1)  # cp.bincount would wait for the GPU (it reads flat's max)
    read_counts = host_copy_later(counts)
    # sort keys: a tiled expert's pairs after every GEMM expert's
    order = cp.argsort((cp.arange(e) + e * (counts < min_rows))[flat])
    at = cp.empty((t, k), order.dtype)  # slot -> the row its output is read from
    base = t if ahead else 0            # the shared expert's rows
    sorted_row = cp.empty_like(order)
    sorted_row[order] = cp.arange(base, base + order.size, dtype=order.dtype)
    at[:, :routed] = sorted_row.reshape(t, routed)
    down = cp.empty((t * k, PIECES, d), cp.float32)  # every slot's output rows at most
    handle = cublas_handle()
    if ahead:
        at[:, routed] = cp.arange(t, dtype=order.dtype)
        _gemm_experts(handle, pieces(x), [(e - 1, t, 0)], stacks, limit, down)
    gemm = [(ex, int(m)) for ex, m in enumerate(read_counts()) if m and m >= min_rows]
    starts = np.cumsum([base] + [m for _, m in gemm]).tolist()
    gemm_rows = starts[-1]  # the shared and the GEMM experts' rows of down
    slots = gemm_rows - base
    if slots:
        plan = [(ex, m, start - base) for (ex, m), start in zip(gemm, starts)]
        _gemm_experts(handle, pieces(x, order[:slots] // routed), plan, stacks, limit, down, base)
    pairs = order[slots:]
    tile_out = None if not pairs.size else tiles(x[pairs // routed], flat[pairs].reshape(-1, 1), *stacks, limit)
    launch("prime", "expert_combine", columns_grid(t, d), (BLOCK,),
           (down, np.int64(gemm_rows), tile_out, at, wts, out, i32(t), i32(k), i32(d)))


def _gemm_experts(handle: int, xp, plan, stacks, limit: float, down, base: int = 0) -> None:
    """Experts on GEMMs: plan [(expert, m, first row)] over the piece rows xp [slots, 3, D] of
    their slots, expert by expert; each slot's output pieces into down's row base + its row."""
    gate_w, up_w, down_w = stacks
    slots, (_, inter, d) = xp.shape[0], gate_w.shape
    gate, up = _expert_rows((slots, PIECES, inter), gate_w), _expert_rows((slots, PIECES, inter), up_w)
    for ex, m, start in plan:
        src = xp.data.ptr + 2 * PIECES * start * d
        _expert_gemm(handle, src, d, m, gate_w, ex, gate.data.ptr + 4 * PIECES * start * inter)
        _expert_gemm(handle, src, d, m, up_w, ex, up.data.ptr + 4 * PIECES * start * inter)
    hidden = cp.empty((slots, PIECES, inter), cp.uint16)
    if isinstance(down_w, DeviceFp8):  # its products accumulate: zero the rows they go to, no others
        down[base:base + slots] = 0
    width = vector_width(inter, PIECES_VECTOR, gate, up, hidden)
    launch("prime", "swiglu_pieces", columns_grid(slots, inter // width), (BLOCK,),
           (gate, up, hidden, np.int64(slots), i32(inter), f32(limit), i32(width)))
    for ex, m, start in plan:
        _expert_gemm(handle, hidden.data.ptr + 2 * PIECES * start * inter, inter, m, down_w, ex,
                     down.data.ptr + 4 * PIECES * (base + start) * d)


def prime_hc_partials(streams, fn):
    """hc_weights' partials [t, 1, outs + 1] as one chunk: each flattened row's dots with the
    outs rows of fn, then its sum of squares (one kernel pass). The dots run as HC_SPLITS slices
    of the flattened axis, one float32 GEMM batched over the slices (read in place: the rows'
    stride spans the whole axis), then summed: one GEMM of few outputs and a long axis fills few blocks."""
    check(streams, cp.float32, "streams")
    t, outs = streams.shape[0], fn.shape[0]
    flat = streams.reshape(t, -1)
    nd = flat.shape[1]
    splits = HC_SPLITS if nd % HC_SPLITS == 0 else 1
    span = nd // splits
    out = cp.empty((t, 1, outs + 1), cp.float32)
    if not t:
        return out
    dots = cp.empty((splits, t, outs), cp.float32)
    # column-major per slice s: dots_s^T [outs, t] = fn_s [outs, span] x_s^T [span, t], the
    # slices span apart in both operands
    cublas.gemmStridedBatchedEx(
        cublas_handle(), cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, outs, t, span, ONE.ctypes.data,
        fn.data.ptr, R_32F, nd, span, flat.data.ptr, R_32F, nd, span,
        ZERO.ctypes.data, dots.data.ptr, R_32F, outs, t * outs, splits, COMPUTE_32F, GEMM_DEFAULT)
    out[:, 0, :outs] = dots.sum(axis=0)
    launch("prime", "row_sum_squares", (t,), (BLOCK,),
           (flat, out, np.int64(nd), i32(outs + 1), i32(outs)))
    return out


def prime_pool_scores(q, w, pool_keys, scale: float):
    """kpool_scores for a prompt [t, nmax]: sum_h w[r, h] relu(scale q[r, h] . pk_j) for every
    pool slot of the plane (kpool_select reads only a row's complete pools), in row chunks."""
    t, hi, di = q.shape
    nmax = pool_keys.shape[0]
    out = cp.empty((t, nmax), cp.float32)
    chunk = max(1, ATTEND_BYTES // (4 * hi * nmax))
    for r0 in range(0, t, chunk):
        n = min(chunk, t - r0)
        dots = cp.matmul(q[r0:r0 + n].reshape(n * hi, di), pool_keys.T).reshape(n, hi, nmax)
        relu = cp.maximum(dots * cp.float32(scale), cp.float32(0))
        out[r0:r0 + n] = cp.matmul(w[r0:r0 + n, None, :], relu)[:, 0, :]
    return out
