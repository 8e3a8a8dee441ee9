"""The prime class's attention (kernels_cu/prime.cu + cuBLAS): a prompt's MLA attention over
each row's selected positions, as bf16 GEMMs of the six piece products of size at least 2^-16
of their float32 operands (backend/pieces.py) around a masked softmax that writes the
probabilities as pieces. Two forms:

* absorbed (prime_attend): scores of the queries in the latent (W_UK^T q) against the latent
  rows, mixes of the latent rows; the scores' three GEMMs sum the pieces in SEGMENTS;
* per head (prime_attend_heads, what an MLA layer of a prompt runs where dn + dv < 2 R): each
  head's keys and values expanded from the latent once (float32), scores as ONE GEMM over six
  copies of each operand, mixes as six GEMMs of one product each (HEAD_PRODUCTS); the absorbed
  form where one head's expanded operands over the context pass ATTEND_BYTES.

Rows go in chunks (ATTEND_ROWS, HEAD_ROWS), each scoring up to its last row's context.

    o = prime_attend_heads(q, latent, positions, w_uk_t, w_uv, scale)   # or None: absorbed
"""

from __future__ import annotations

import numpy as np

import cupy as cp
from cupy_backends.cuda.libs import cublas

from memra.backend.cuda.prime import cublas_handle, gemm_bf16, gemm_bf16_batched, pieces
from memra.backend.cuda.runtime import BLOCK, MAX_GRID, SHARED_BYTES, blocks_of, check, columns_grid, f32, i32, launch
from memra.backend.pieces import HEAD_PRODUCTS, LEFT_ORDER, PIECES, RIGHT_COPIES, SEGMENTS, head_group, piece_map
from memra.limits import ATTEND_BYTES, ATTEND_ROWS, HEAD_ROWS

ALIGN = 8  # context padded to a multiple: 16-byte bf16 rows for the tensor cores


def put_piece_copies(x, out, order, row_stride: int, copy_stride: int) -> None:
    """out (bf16 bits, flat) [i * row_stride + s * copy_stride + c] = piece order[s] of x [m, d]
    [i, c]: a float32 operand laid out for the six-product GEMMs (backend/pieces.py)."""
    check(x, cp.float32, "x")
    check(out, cp.uint16, "out")
    (m, d), copies = x.shape, len(order)
    assert (m - 1) * row_stride + (copies - 1) * copy_stride + d <= out.size, f"out {out.shape} for x {x.shape}"
    if m * d:
        launch("prime", "piece_copies", columns_grid(m, d), (BLOCK,),
               (x, out, np.int64(m), i32(d), i32(copies), i32(piece_map(order)), np.int64(row_stride),
                np.int64(copy_stride)))


def _six_products(handle: int, m: int, n: int, k: int, left, right, c: int, right_is_kn: bool) -> None:
    """C [m, n] = the six piece products of L [m, k] and R (SEGMENTS, smallest first): left [m,
    3k] the pieces in LEFT_ORDER; right the RIGHT_COPIES side by side ([n, 6k], its row stride
    right.shape[1]) or stacked ([6k, n], right_is_kn)."""
    for i, (at_left, at_right, length) in enumerate(SEGMENTS):
        if right_is_kn:
            r, ld_right = right.data.ptr + 2 * at_right * k * n, n
        else:
            r, ld_right = right.data.ptr + 2 * at_right * k, right.shape[1]
        gemm_bf16(handle, m, n, length * k, left.data.ptr + 2 * at_left * k, PIECES * k, r, ld_right,
                   c, n, right_is_kn=right_is_kn, accumulate=i > 0)


def _padded(ctx: int, limit: int) -> int:
    """ctx rounded up to ALIGN, within the latent plane's `limit` rows."""
    return min(-(-max(ctx, 1) // ALIGN) * ALIGN, limit)


def _spans(positions, limit: int):
    """(each row's last listed position + 1 on the host, the padded span of them all): the
    attention's one wait."""
    ends = cp.asnumpy(positions.max(axis=1)) + 1
    return ends, _padded(int(ends.max()), limit)


def _keep(pos, ctx: int):
    """keep [n, ctx] uint8: 1 where row i of pos [n, W] lists position c."""
    n, width = pos.shape
    keep = cp.zeros((n, ctx), cp.uint8)
    launch("prime", "selection_mask", (min(blocks_of(n * width), MAX_GRID),), (BLOCK,),
           (pos, keep, i32(n), i32(width), i32(ctx)))
    return keep


def _softmax_pieces(scores, keep, heads: int, ctx: int, scale: float, order):
    """probs [rows, 3 ctx] bf16 bits: the pieces (in `order`) of the masked softmax of scale *
    scores [n, heads, ctx] (row i * heads + h), listed positions only."""
    rows = scores.shape[0] * heads
    probs = cp.empty((rows, PIECES * ctx), cp.uint16)
    cached = 4 * ctx <= SHARED_BYTES  # a row's scores in shared memory: read from global memory once
    launch("prime", "masked_softmax_pieces", (rows,), (BLOCK,),
           (scores, keep, probs, i32(heads), i32(ctx), f32(scale), i32(piece_map(order)), i32(cached),
            i32(4 if ctx % 4 == 0 else 1)),
           4 * ctx if cached else 0)
    return probs


def prime_attend(q_lat, latent, positions, scale: float):
    """Absorbed attention over each row's position list on tensor cores: scores of every row
    against the latent rows up to its chunk's last listed position, a masked softmax (unlisted
    positions weigh 0), then the mix; both GEMMs sum the six piece products of their float32
    operands. Rows go in chunks of at most ATTEND_ROWS, and ATTEND_BYTES of scores and pieces."""
    t, h, rank = q_lat.shape
    copies = len(RIGHT_COPIES)
    out = cp.empty((t, h, rank), cp.float32)
    ends, span = _spans(positions, latent.shape[0])
    chunk = max(1, min(ATTEND_ROWS, ATTEND_BYTES // ((4 + 2 * PIECES) * h * span)))
    keys = cp.empty((span, copies * rank), cp.uint16)  # the scores' right operand, every chunk's
    put_piece_copies(latent[:span], keys, RIGHT_COPIES, copies * rank, rank)
    handle = cublas_handle()
    for r0 in range(0, t, chunk):
        pos = positions[r0:r0 + chunk]
        n = pos.shape[0]
        rows, ctx = n * h, _padded(int(ends[r0:r0 + chunk].max()), latent.shape[0])
        keep = _keep(pos, ctx)
        left = cp.empty((rows, PIECES * rank), cp.uint16)
        put_piece_copies(q_lat[r0:r0 + n].reshape(rows, rank), left, LEFT_ORDER, PIECES * rank, rank)
        scores = cp.empty((n, h, ctx), cp.float32)
        _six_products(handle, rows, ctx, rank, left, keys, scores.data.ptr, right_is_kn=False)
        probs = _softmax_pieces(scores, keep, h, ctx, scale, LEFT_ORDER)
        values = cp.empty((copies * ctx, rank), cp.uint16)  # the mix's right operand: stacked copies
        put_piece_copies(latent[:ctx], values, RIGHT_COPIES, rank, ctx * rank)
        _six_products(handle, rows, rank, ctx, probs, values, out.data.ptr + 4 * r0 * h * rank, right_is_kn=True)
    return out


def _expand(lp, latent, w, keys: bool):
    """[span, g, d] float32: the latent rows through g heads' matrices, latent @ w[h] for the keys
    (w = W_UK^T [g, R, d]) or latent @ w[h].T for the values (w = W_UV [g, d, R]): bf16 weights
    meet the latent's pieces lp [span, 3, R] batched over the heads, smallest piece first."""
    g, (span, _, rank) = w.shape[0], lp.shape
    d = w.shape[2] if keys else w.shape[1]
    if w.dtype == cp.float32:
        return cp.ascontiguousarray(cp.matmul(latent, w if keys else w.transpose(0, 2, 1)).transpose(1, 0, 2))
    out = cp.empty((span, g, d), cp.float32)
    handle = cublas_handle()
    op_w, ld_w = (cublas.CUBLAS_OP_N, d) if keys else (cublas.CUBLAS_OP_T, rank)
    for i, piece in enumerate(reversed(range(PIECES))):
        # column-major per head: out_h^T [d, span] (+)= op(w_h) [d, R] lp_piece^T [R, span]
        gemm_bf16_batched(handle, op_w, cublas.CUBLAS_OP_N, d, span, rank, w.data.ptr, ld_w, d * rank,
                          lp.data.ptr + 2 * piece * rank, PIECES * rank, 0, out.data.ptr, g * d, d, g,
                          accumulate=i > 0)
    return out


def prime_attend_heads(q, latent, positions, w_uk_t, w_uv, scale: float):
    """o [t, H, dv]: MLA attention of per-head queries q [t, H, dn] in the per-head form (keys
    latent @ W_UK^T[h], values latent @ W_UV[h].T, each float32 once): at bench's widths half the
    absorbed form's piece products (dn + dv = 512 against 2 R = 1024 per score and mix). Heads go
    in passes of head_group, rows in chunks of HEAD_ROWS (and ATTEND_BYTES of scores); the scores
    are one GEMM of the six products, the mixes six (backend/pieces.py). None where one head's
    operands over the span would pass ATTEND_BYTES."""
    t, h, dn = q.shape
    dv, products = w_uv.shape[1], len(HEAD_PRODUCTS)
    ends, span = _spans(positions, latent.shape[0])
    group = head_group(span, h, dn, dv, ATTEND_BYTES)
    if not group:
        return None
    left_copies, right_copies = (tuple(pair[side] for pair in HEAD_PRODUCTS) for side in (0, 1))
    out = cp.empty((t, h, dv), cp.float32)
    lp, handle = pieces(latent[:span]), cublas_handle()
    for h0 in range(0, h, group):
        g = min(group, h - h0)
        keys = cp.empty((span, g, products * dn), cp.uint16)  # each position's heads' six copies
        put_piece_copies(_expand(lp, latent[:span], w_uk_t[h0:h0 + g], True).reshape(span * g, dn), keys,
                         right_copies, products * dn, dn)
        values = cp.empty((PIECES, span, g, dv), cp.uint16)  # the pieces apart: [piece] [position] [head]
        put_piece_copies(_expand(lp, latent[:span], w_uv[h0:h0 + g], False).reshape(span * g, dv), values,
                         (0, 1, 2), dv, span * g * dv)
        chunk = max(1, min(HEAD_ROWS, ATTEND_BYTES // ((4 + 2 * PIECES) * g * span)))
        for r0 in range(0, t, chunk):
            pos = positions[r0:r0 + chunk]
            n = pos.shape[0]
            ctx = _padded(int(ends[r0:r0 + chunk].max()), latent.shape[0])
            left = cp.empty((n, g, products * dn), cp.uint16)
            put_piece_copies(cp.ascontiguousarray(q[r0:r0 + n, h0:h0 + g]).reshape(n * g, dn), left, left_copies,
                             products * dn, dn)
            scores = cp.empty((n, g, ctx), cp.float32)
            # column-major per head: scores_h^T [ctx, n] = keys_h [ctx, 6 dn] left_h^T [6 dn, n]
            gemm_bf16_batched(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, ctx, n, products * dn,
                              keys.data.ptr, g * products * dn, products * dn, left.data.ptr, g * products * dn,
                              products * dn, scores.data.ptr, g * ctx, ctx, g)
            probs = _softmax_pieces(scores, _keep(pos, ctx), g, ctx, scale, (0, 1, 2))
            for i, (a, b) in enumerate(HEAD_PRODUCTS):
                # column-major per head: out_h^T [dv, n] (+)= values_b,h [dv, ctx] probs_a,h^T [ctx, n]
                gemm_bf16_batched(handle, cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, dv, n, ctx,
                                  values.data.ptr + 2 * b * span * g * dv, g * dv, dv,
                                  probs.data.ptr + 2 * a * ctx, g * PIECES * ctx, PIECES * ctx,
                                  out.data.ptr + 4 * (r0 * h + h0) * dv, h * dv, dv, g, accumulate=i > 0)
    return out
