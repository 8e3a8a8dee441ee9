"""The dense op family of the CUDA backend: embedding, projections, norms, activations.

`DenseOps` is one of the mixins `CudaBackend` composes (memra/backend/cuda.py); it needs nothing
from the others, so tests use it alone (`ops = DenseOps()`). Every method has the signature and
meaning of its twin in `NumpyBackend` (numpy_ref.py) and takes and returns cupy arrays.

All ops are exact class (DESIGN.md section 2): the kernels in kernels_cu/dense.cu and norm.cu
fix each output's reduction order independently of the row count, so row r of a t-row call is
bit-identical to the row alone. Projection weights may be float32 (CUDA cores) or raw bf16 bits
(uint16: tensor cores on exact bf16 pieces of the activations, kernels_cu/exact_mma.cuh); each
weight is read once per call for all rows (up to 16). A bf16 projection whose outputs fill few
blocks splits its in-features into fixed slices summed in order (`split_k`, by shape only).

    ops = DenseOps()
    y = ops.linear(cp.asarray(x, cp.float32), w_bf16)   # x [t, in], w [out, in] -> [t, out]
"""

from __future__ import annotations

import numpy as np

import cupy as cp

from memra.backend.cuda_runtime import BLOCK, check, f32, i32, launch
from memra.errors import InputError

WARPS_PER_BLOCK = 8   # dense.cu: BLOCK / 32
OUTS_PER_WARP = {1: 1, 2: 2, 4: 4, 8: 4, 16: 2}  # dense.cu PROJECTIONS: f32 row template -> outputs per warp
BF16_OUTS = 32  # dense.cu: outputs per block of the bf16 (tensor-core) projections
SPLIT_KC = 2048  # dense.cu linear_bf16_split: in-features per split-K slice (a fixed size)
SPLIT_BELOW_BLOCKS = 256  # ... taken when the outputs alone make fewer blocks than this
EXACT_ROWS = 15  # the exact class (model.trunk.VERIFY_CAP): prime-class calls never split
MAX_GRID = 65535 * 32  # elementwise launches: grid-stride loops cover the rest
INT32_MAX = 2**31 - 1


def _weight_kind(w, name: str) -> str:
    """Projection weights are float32 or raw bf16 bits; the kernel name suffix follows."""
    if isinstance(w, cp.ndarray) and w.dtype == cp.uint16:
        check(w, cp.uint16, name)
        return "bf16"
    check(w, cp.float32, name)
    return "f32"


def projection(kind: str, t: int, n_out: int) -> tuple[str, int]:
    """(kernel name suffix, blocks along the outputs) for a t-row projection. float32 weights:
    row template T, the smallest of 1, 2, 4, 8, 16 covering min(t, 16); bf16 weights: n1 (8 rows
    per pass) for t <= 8, else n2. A row's bits never depend on the pick, only the registers."""
    if kind == "bf16":
        return f"bf16_n{1 if t <= 8 else 2}", (n_out + BF16_OUTS - 1) // BF16_OUTS
    T = next(T for T in (1, 2, 4, 8, 16) if T >= min(t, 16))
    per_block = WARPS_PER_BLOCK * OUTS_PER_WARP[T]
    return f"f32_t{T}", (n_out + per_block - 1) // per_block


def split_k(t: int, n_in: int, n_out: int) -> int:
    """Split-K slices of SPLIT_KC in-features for a bf16 projection (1: none). Taken for exact-class
    row counts when the outputs alone make few blocks and the in-features are long; it depends
    on the shape only, so every row count 1..15 sums each output alike."""
    blocks = (n_out + BF16_OUTS - 1) // BF16_OUTS
    if t > EXACT_ROWS or blocks >= SPLIT_BELOW_BLOCKS or n_in < 2 * SPLIT_KC:
        return 1
    return (n_in + SPLIT_KC - 1) // SPLIT_KC


def _rows_of(x, name: str) -> tuple[int, int]:
    """(rows, n) for a reduction over the last axis of x, any leading shape."""
    check(x, cp.float32, name)
    assert x.ndim >= 1 and x.shape[-1] > 0, f"{name}: needs a non-empty last axis, got {x.shape}"
    n = x.shape[-1]
    assert x.size // n <= INT32_MAX, f"{name}: too many rows for one launch"
    return x.size // n, n


def _vector(w, n: int, name: str):
    check(w, cp.float32, name)
    assert w.shape == (n,), f"{name}: expected shape ({n},), got {w.shape}"
    return w


def _elementwise(name: str, inputs: tuple, out, scalars: tuple = ()) -> None:
    """Kernel args (inputs..., out, n, scalars...) over out.size floats."""
    n = out.size
    if n:
        grid = min((n + BLOCK - 1) // BLOCK, MAX_GRID)
        launch("dense", name, (grid,), (BLOCK,), (*inputs, out, np.int64(n), *scalars))


class DenseOps:
    """Embedding, projections, norms and activations as exact-class CUDA kernels."""

    # ---- projections -----------------------------------------------------------------------
    def embed(self, table, ids):
        """table [vocab, D] (float32 or bf16 bits), ids any int shape (host or device) ->
        float32 ids.shape + (D,). Host ids outside the vocab are refused; device ids outside it
        give NaN rows (checking them here would cost a device sync per step)."""
        kind = _weight_kind(table, "table")
        vocab, dim = table.shape
        if isinstance(ids, cp.ndarray):
            dev = cp.ascontiguousarray(ids.astype(cp.int32))
        else:
            host = np.asarray(ids)
            assert host.dtype.kind in "iu", f"ids: expected integers, got {host.dtype}"
            if host.size and (host.min() < 0 or host.max() >= vocab):
                bad = host[(host < 0) | (host >= vocab)].reshape(-1)[0]
                raise InputError(f"token id {bad} is outside the vocab [0, {vocab}); "
                                 f"pass ids below {vocab}")
            dev = cp.asarray(np.ascontiguousarray(host, dtype=np.int32))
        out = cp.empty((*dev.shape, dim), cp.float32)
        if dev.size:
            launch("dense", f"embed_{kind}", (dev.size,), (BLOCK,),
                   (table, dev, out, i32(vocab), i32(dim)))
        return out

    def linear(self, x, w):
        """y[r] = w @ x[r]; x [t, in], w [out, in] (float32 or bf16 bits) -> [t, out]."""
        kind = _weight_kind(w, "w")
        check(x, cp.float32, "x")
        n_out, n_in = w.shape
        assert x.ndim == 2 and x.shape[1] == n_in, f"x: expected [t, {n_in}], got {x.shape}"
        t = x.shape[0]
        out = cp.empty((t, n_out), cp.float32)
        if not (t and n_out):
            return out
        suffix, blocks = projection(kind, t, n_out)
        splits = split_k(t, n_in, n_out) if kind == "bf16" else 1
        if splits == 1:
            launch("dense", f"linear_{suffix}", (blocks,), (BLOCK,),
                   (x, w, out, i32(t), i32(n_in), i32(n_out)))
            return out
        part = cp.empty((splits, t, n_out), cp.float32)
        launch("dense", f"linear_{suffix.replace('bf16', 'bf16_split')}", (blocks, splits), (BLOCK,),
               (x, w, part, i32(t), i32(n_in), i32(n_out), i32(SPLIT_KC)))
        launch("dense", "linear_split_sum", (min((out.size + BLOCK - 1) // BLOCK, MAX_GRID),), (BLOCK,),
               (part, out, np.int64(out.size), i32(splits)))
        return out

    def head_linear(self, x, w):
        """Per-head projection: y[r, h] = w[h] @ x[r, h]; x [t, H, in], w [H, out, in]."""
        kind = _weight_kind(w, "w")
        check(x, cp.float32, "x")
        heads, n_out, n_in = w.shape
        assert x.ndim == 3 and x.shape[1:] == (heads, n_in), \
            f"x: expected [t, {heads}, {n_in}], got {x.shape}"
        t = x.shape[0]
        out = cp.empty((t, heads, n_out), cp.float32)
        if t and heads and n_out:
            suffix, blocks = projection(kind, t, n_out)
            launch("dense", f"head_linear_{suffix}", (blocks, heads), (BLOCK,),
                   (x, w, out, i32(t), i32(n_in), i32(n_out)))
        return out

    # ---- norms and activations -------------------------------------------------------------
    def rmsnorm(self, x, w, eps: float):
        """RMSNorm over the last axis, any leading shape (w=None: unweighted)."""
        rows, n = _rows_of(x, "x")
        if w is not None:
            _vector(w, n, "w")
        out = cp.empty_like(x)
        if rows:
            launch("norm", "rmsnorm_rows", (rows,), (BLOCK,), (x, w, out, i32(n), f32(eps)))
        return out

    def layernorm(self, x, w, b, eps: float):
        rows, n = _rows_of(x, "x")
        _vector(w, n, "w")
        _vector(b, n, "b")
        out = cp.empty_like(x)
        if rows:
            launch("norm", "layernorm_rows", (rows,), (BLOCK,), (x, w, b, out, i32(n), f32(eps)))
        return out

    def l2norm(self, x, eps: float):
        """x / sqrt(sum(x^2) + eps) over the last axis (fla's convention: eps inside the sqrt)."""
        rows, n = _rows_of(x, "x")
        out = cp.empty_like(x)
        if rows:
            launch("norm", "l2norm_rows", (rows,), (BLOCK,), (x, out, i32(n), f32(eps)))
        return out

    def gated_rmsnorm(self, o, gate, w, eps: float):
        """rmsnorm(o) * w * sigmoid(gate) over the last axis (KDA's output norm)."""
        rows, n = _rows_of(o, "o")
        check(gate, cp.float32, "gate")
        assert gate.shape == o.shape, f"gate: expected {o.shape}, got {gate.shape}"
        _vector(w, n, "w")
        out = cp.empty_like(o)
        if rows:
            launch("norm", "gated_rmsnorm_rows", (rows,), (BLOCK,),
                   (o, gate, w, out, i32(n), f32(eps)))
        return out

    def silu(self, x):
        check(x, cp.float32, "x")
        out = cp.empty_like(x)
        _elementwise("silu_kernel", (x,), out)
        return out

    def sigmoid(self, x):
        check(x, cp.float32, "x")
        out = cp.empty_like(x)
        _elementwise("sigmoid_kernel", (x,), out)
        return out

    def swiglu(self, gate, up, limit: float):
        """silu(min(gate, limit)) * clip(up, -limit, limit)."""
        check(gate, cp.float32, "gate")
        check(up, cp.float32, "up")
        assert gate.shape == up.shape, f"up: expected {gate.shape}, got {up.shape}"
        out = cp.empty_like(gate)
        _elementwise("swiglu_kernel", (gate, up), out, (f32(limit),))
        return out

    def softmax(self, x):
        """Softmax over the last axis, any leading shape."""
        rows, n = _rows_of(x, "x")
        out = cp.empty_like(x)
        if rows:
            launch("norm", "softmax_rows", (rows,), (BLOCK,), (x, out, i32(n)))
        return out

    def log_softmax(self, x):
        """Log-softmax over the last axis, any leading shape."""
        rows, n = _rows_of(x, "x")
        out = cp.empty_like(x)
        if rows:
            launch("norm", "log_softmax_rows", (rows,), (BLOCK,), (x, out, i32(n)))
        return out

    def argmax(self, x):
        """Row-wise argmax over the last axis (int64, the lowest index among ties, NaN first)."""
        rows, n = _rows_of(x, "x")
        out = cp.empty(x.shape[:-1], cp.int64)
        if rows:
            launch("norm", "argmax_rows", (rows,), (BLOCK,), (x, out, i32(n)))
        return out
