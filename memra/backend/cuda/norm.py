"""The norm family of the CUDA backend (kernels_cu/norm.cu): row reductions over the last axis.

RMSNorm (plain and gated), LayerNorm, L2 norm, softmax, log-softmax, argmax (with its softmax
probability, for a greedy draft's confidence) and top-k (a drafter's candidates), one block per
row, each row's reduction in a fixed order whatever the row count (exact class); the
sum-of-squares norms give a prompt's short rows (at most NORM_WARP_ROW elements: a KDA head, a
latent) a warp each, which plays the block's order: the same bits. A mixin of CudaBackend with
the signatures of NumpyBackend's twins:

    ops = NormOps()
    y = ops.rmsnorm(x, w, eps=1e-6)          # x [..., n] float32 cupy, w [n] or None
"""

from __future__ import annotations

import cupy as cp

from memra.backend.cuda.runtime import BLOCK, blocks_of, check, f32, i32, launch, rows_of, vector
from memra.kernels_cu.constants import NORM_WARP_ROW, WARPS_PER_BLOCK


def _row_map(kernel: str, x):
    """A kernel that maps each row of x (last axis) to a row of the same shape, one block a row."""
    rows, n = rows_of(x, "x")
    out = cp.empty_like(x)
    if rows:
        launch("norm", kernel, (rows,), (BLOCK,), (x, out, i32(n)))
    return out


WARP_ROWS_MIN = 1024  # rows a launch needs before short rows go a warp each: a decode step's
                     # few rows finish sooner a block each (more threads per row in flight)


def launch_norm(kernel: str, rows: int, n: int, args: tuple, per_warp: bool | None = None) -> None:
    """Launch an rmsnorm-like kernel over `rows` rows of n: a warp a row for many short rows
    (n <= NORM_WARP_ROW, rows >= WARP_ROWS_MIN: a prompt's), else a block a row. Both paths give
    every row the same bits, so the choice never moves a row with the row count (per_warp
    forces one, for the test that pins this)."""
    if per_warp is None:
        per_warp = n <= NORM_WARP_ROW and rows >= WARP_ROWS_MIN
    grid = blocks_of(rows, WARPS_PER_BLOCK) if per_warp else rows
    launch("norm", kernel, (grid,), (BLOCK,), (*args, i32(rows), i32(per_warp)))


ARGMAX_SPAN = 4096  # elements per argmax_parts block: a 155k vocab row spreads over 38 blocks


class NormOps:
    def rmsnorm(self, x, w, eps: float):
        """RMSNorm over the last axis, any leading shape (w=None: unweighted)."""
        rows, n = rows_of(x, "x")
        if w is not None:
            vector(w, n, "w")
        out = cp.empty_like(x)
        if rows:
            launch_norm("rmsnorm_rows", rows, n, (x, w, out, i32(n), f32(eps)))
        return out

    def layernorm(self, x, w, b, eps: float):
        rows, n = rows_of(x, "x")
        vector(w, n, "w")
        vector(b, n, "b")
        out = cp.empty_like(x)
        if rows:
            launch("norm", "layernorm_rows", (rows,), (BLOCK,), (x, w, b, out, i32(n), f32(eps)))
        return out

    def l2norm(self, x, eps: float, scale: float = 1.0):
        """x / sqrt(sum(x^2) + eps) over the last axis (fla's convention: eps inside the sqrt),
        times float32(scale) (NumpyBackend.l2norm)."""
        rows, n = rows_of(x, "x")
        out = cp.empty_like(x)
        if rows:
            launch_norm("l2norm_rows", rows, n, (x, out, i32(n), f32(eps), f32(scale)))
        return out

    def gated_rmsnorm(self, o, gate, w, eps: float):
        """rmsnorm(o) * w * sigmoid(gate) over the last axis (KDA's output norm)."""
        rows, n = rows_of(o, "o")
        check(gate, cp.float32, "gate")
        assert gate.shape == o.shape, f"gate: expected {o.shape}, got {gate.shape}"
        vector(w, n, "w")
        out = cp.empty_like(o)
        if rows:
            launch_norm("gated_rmsnorm_rows", rows, n, (o, gate, w, out, i32(n), f32(eps)))
        return out

    def softmax(self, x):
        """Softmax over the last axis, any leading shape."""
        return _row_map("softmax_rows", x)

    def log_softmax(self, x):
        """Log-softmax over the last axis, any leading shape."""
        return _row_map("log_softmax_rows", x)

    def argmax(self, x):
        """Row-wise argmax over the last axis (int64, the lowest index among ties, NaN first)."""
        return _argmax(x, with_prob=False)[0]

    def argmax_prob(self, x):
        """(argmax, its softmax probability) per row: a greedy draft and its confidence, from
        one pass over the row and without writing a probability row (NumpyBackend.argmax_prob)."""
        return _argmax(x, with_prob=True)

    def top_k(self, x, k: int):
        """(values [..., k], ids [..., k] int64): each row's k first entries in argmax's order (NaN
        first, then larger values, ties to the lower index), in that order (NumpyBackend.top_k).
        Two launches whatever the row length, and no vocab-long row leaves the device; each pick
        is a block reduction, so k is meant small (a drafter's candidates: 16)."""
        rows, n = rows_of(x, "x")
        assert 1 <= k <= n, f"top_k: k={k} outside 1..{n} for rows of {n}"
        vals, ids = cp.empty((*x.shape[:-1], k), cp.float32), cp.empty((*x.shape[:-1], k), cp.int64)
        if rows:
            parts = (n + ARGMAX_SPAN - 1) // ARGMAX_SPAN
            pv, pi = cp.empty((rows, parts, k), cp.float32), cp.empty((rows, parts, k), cp.int32)
            launch("norm", "top_k_parts", (rows, parts), (BLOCK,), (x, pv, pi, i32(n), i32(ARGMAX_SPAN), i32(k)))
            launch("norm", "top_k_rows", (rows,), (BLOCK,), (pv, pi, vals, ids, i32(parts * k), i32(k)))
        return vals, ids

    def pick(self, x, idx):
        """x [..., n], idx [...] (device ints in 0..n-1) -> x[..., idx]: each row's entry at its
        index (a gather, no arithmetic), without a trip through the host."""
        return cp.take_along_axis(x, idx.astype(cp.int64)[..., None], axis=-1)[..., 0]


def _argmax(x, with_prob: bool):
    """argmax_parts over ARGMAX_SPAN-element parts, then argmax_rows: (ids, probs or None)."""
    rows, n = rows_of(x, "x")
    out = cp.empty(x.shape[:-1], cp.int64)
    prob = cp.empty(x.shape[:-1], cp.float32) if with_prob else None
    if rows:
        parts = (n + ARGMAX_SPAN - 1) // ARGMAX_SPAN
        vals, idxs = cp.empty((rows, parts), cp.float32), cp.empty((rows, parts), cp.int32)
        sums = cp.empty((rows, parts), cp.float32) if with_prob else None
        launch("norm", "argmax_parts", (rows, parts), (BLOCK,), (x, vals, idxs, sums, i32(n), i32(ARGMAX_SPAN)))
        launch("norm", "argmax_rows", (rows,), (BLOCK,), (vals, idxs, sums, out, prob, i32(parts)))
    return out, prob
