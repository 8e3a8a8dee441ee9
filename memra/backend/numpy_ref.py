"""The numpy reference backend: every op the model uses, exact by construction.

This is the backend interface. Each exact-class op takes a block of t rows and computes row r
with the same code, on arrays whose shapes depend only on row r, as it would for that row
alone; so row r of a t-row call is bit-identical to the t=1 call (BLAS picks its kernels by
shape, which is why rows are never batched into one gemm here). The CUDA backend implements
the same methods with the same signatures. Activations are float32; weights arrive float32.
The KDA ops live in numpy_kda.py and the mHC site's in numpy_hyper.py (mixins, as the CUDA
backend's families are).
"""

from __future__ import annotations

import numpy as np

from memra.safetensors_io import bf16_to_f32
from memra.backend.fp8 import Fp8Block, NumpyFp8Matrix
from memra.backend.numpy_draft import NumpyDraftOps
from memra.backend.numpy_hyper import NumpyHyperOps
from memra.backend.numpy_kda import NumpyKdaOps
from memra.backend.philox import TAG_DRAW, uniforms
from memra.backend.ranking import largest
from memra.backend.sampling_filter import NumpyFilterOps

F32 = np.float32


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) without overflow: exp only ever sees -|x|."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, F32(1) / (F32(1) + e), e / (F32(1) + e)).astype(F32)


def _silu(x: np.ndarray) -> np.ndarray:
    return (x * _sigmoid(x)).astype(F32)


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(F32)


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, ties to the lowest index, in ascending index order."""
    order = np.argsort(-scores, kind="stable")[:k]
    return np.sort(order)


def _rmsnorm_row(x: np.ndarray, eps: float) -> np.ndarray:
    return (x * (F32(1) / np.sqrt(np.mean(x * x, dtype=F32) + F32(eps)))).astype(F32)


class Inline:
    """NumpyBackend.beside's context: fn has run by the time it is made."""

    def __init__(self, fn):
        self.result = fn()

    def __enter__(self) -> "Inline":
        return self

    def __exit__(self, *exc) -> None:
        pass


class NumpyBackend(NumpyHyperOps, NumpyKdaOps, NumpyDraftOps, NumpyFilterOps):
    """Reference implementation of the backend interface (runs everywhere, used by CI)."""

    name = "numpy"  # a label for records and summaries; callers branch on the capabilities below

    # ---- capabilities: what a caller asks instead of checking the backend's name ------------
    xp = np  # the array module of this backend's arrays (CUDA: cupy)

    # Kernels are built the first time each is launched (CUDA: NVRTC, once per process), so a
    # caller that times a run does one short untimed run first. Nothing to build here.
    compiles_on_first_use = False

    def device_name(self) -> str:
        """What runs the ops, for summaries and benchmark records (CUDA: the GPU's name)."""
        return "cpu"

    def synchronize(self) -> None:
        """Wait until every op issued so far has finished (CUDA: queued device work); a timer
        reads its clock after this. Host ops finish before they return: nothing to wait for."""

    def beside(self, fn, t: int) -> "Inline":
        """fn()'s ops for t rows, run beside the ops issued inside the returned context; its
        `result` after the block (CUDA: a side stream joined at the block's end, for walks of
        exact-class rows). The caller's ops must not need fn's, nor fn's theirs. Here: at once."""
        return Inline(fn)

    # ---- memory ----------------------------------------------------------------------------
    def asarray(self, a, dtype=F32) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=dtype)

    def weight(self, a: np.ndarray) -> np.ndarray:
        """A parameter used elementwise or in a small reduction; bf16 (raw uint16) widens."""
        if a.dtype == np.uint16:
            return bf16_to_f32(a)
        return np.ascontiguousarray(a, dtype=F32)

    def matrix(self, a: np.ndarray) -> np.ndarray:
        """A projection matrix for linear / head_linear / moe_experts. The reference computes
        in float32 whatever the storage; the CUDA backend keeps bf16 storage and multiplies it on
        tensor cores with exact bf16 pieces of the activations; FP8 blocks: backend/fp8.py."""
        if isinstance(a, Fp8Block):
            return NumpyFp8Matrix.from_block(a)
        return self.weight(a)

    def zeros(self, shape, dtype=F32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def to_host_async(self, a):
        """to_host as a function that returns the copy (on the host there is nothing to wait for)."""
        host = np.array(a, copy=True)
        return lambda: host

    def contiguous(self, a) -> np.ndarray:
        """A C-contiguous copy of a strided view (kernels take contiguous rows)."""
        return np.ascontiguousarray(a)

    def copy(self, a) -> np.ndarray:
        """An owned copy (a walk's outputs may be buffers the next walk overwrites)."""
        return np.array(a, copy=True)

    def assign(self, dst: np.ndarray, src: np.ndarray) -> None:
        """dst[...] = src in place (same shape and dtype)."""
        assert dst.shape == src.shape and dst.dtype == src.dtype, f"assign: {src.shape} {src.dtype} into {dst.shape} {dst.dtype}"
        np.copyto(dst, src)

    def concat(self, arrays, axis: int = -1) -> np.ndarray:
        return np.concatenate(arrays, axis=axis)

    # ---- walks ---------------------------------------------------------------------------------
    def position(self, pos0: int) -> int:
        """A walk's first position in the form the position-taking ops read (here: the int)."""
        return int(pos0)

    def walks(self) -> "EagerWalks":
        """The per-cache walk runner (the CUDA backend's captures CUDA graphs)."""
        return EagerWalks(self)

    def write_rows(self, dst: np.ndarray, src: np.ndarray, at: int) -> None:
        """dst[at:at + t] = src: a state plane's next t rows, in place."""
        dst[at:at + src.shape[0]] = src

    # ---- projections -----------------------------------------------------------------------
    def embed(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return table[np.asarray(ids, dtype=np.int64)].astype(F32)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """y[r] = w @ x[r]; x [t, in], w [out, in] -> [t, out]."""
        out = np.empty((x.shape[0], w.shape[0]), F32)
        for r in range(x.shape[0]):
            out[r] = w @ x[r]
        return out

    def linears(self, x: np.ndarray, ws) -> list:
        """The projections of one input, [linear(x, w) for w in ws] (the CUDA backend shares
        work between them on a prompt's rows)."""
        return [self.linear(x, w) for w in ws]

    def head_linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Per-head projection: y[r, h] = w[h] @ x[r, h]; x [t, H, in], w [H, out, in]."""
        out = np.empty((x.shape[0], w.shape[0], w.shape[1]), F32)
        for r in range(x.shape[0]):
            for h in range(w.shape[0]):
                out[r, h] = w[h] @ x[r, h]
        return out

    # ---- norms, activations, elementwise arithmetic ----------------------------------------
    def rmsnorm(self, x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
        """RMSNorm over the last axis (w=None: unweighted)."""
        flat = x.reshape(-1, x.shape[-1])
        out = np.empty_like(flat)
        for r in range(flat.shape[0]):
            out[r] = _rmsnorm_row(flat[r], eps)
            if w is not None:
                out[r] *= w
        return out.reshape(x.shape)

    def layernorm(self, x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
        out = np.empty_like(x)
        for r in range(x.shape[0]):
            mu = np.mean(x[r], dtype=F32)
            d = x[r] - mu
            var = np.mean(d * d, dtype=F32)
            out[r] = d / np.sqrt(var + F32(eps)) * w + b
        return out

    def l2norm(self, x: np.ndarray, eps: float, scale: float = 1.0) -> np.ndarray:
        """x / sqrt(sum(x^2) + eps) over the last axis (fla's convention: eps inside the sqrt),
        times float32(scale): scale(l2norm(x)) in one op (KDA's q), the same bits."""
        flat = x.reshape(-1, x.shape[-1])
        out = np.empty_like(flat)
        for r in range(flat.shape[0]):
            out[r] = (flat[r] / np.sqrt(np.sum(flat[r] * flat[r], dtype=F32) + F32(eps))) * F32(scale)
        return out.reshape(x.shape)

    def gated_rmsnorm(self, o: np.ndarray, gate: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """rmsnorm(o) * w * sigmoid(gate) over the last axis (KDA's output norm)."""
        return (self.rmsnorm(o, w, eps) * _sigmoid(gate)).astype(F32)

    def silu(self, x: np.ndarray) -> np.ndarray:
        return _silu(x)

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        return _sigmoid(x)

    def swiglu(self, gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
        """silu(min(gate, limit)) * clip(up, -limit, limit)."""
        lim = F32(limit)
        return (_silu(np.minimum(gate, lim)) * np.clip(up, -lim, lim)).astype(F32)

    def scale(self, x: np.ndarray, factor: float) -> np.ndarray:
        """x * float32(factor), elementwise (the KDA q scale, the indexer weight scale)."""
        return x * F32(factor)

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """a + b, elementwise, same shapes (the MTP block's residuals; a shared expert kept as a separate MLP)."""
        return a + b

    def softmax(self, x: np.ndarray) -> np.ndarray:
        return _softmax(x, axis=-1)

    def log_softmax(self, x: np.ndarray) -> np.ndarray:
        """x - max - log(sum(exp(x - max))) over the last axis (for sampling and scoring)."""
        flat = x.reshape(-1, x.shape[-1])
        out = np.empty_like(flat)
        for r in range(flat.shape[0]):
            z = flat[r] - flat[r].max()
            out[r] = z - np.log(np.sum(np.exp(z), dtype=F32))
        return out.reshape(x.shape)

    def argmax(self, x: np.ndarray) -> np.ndarray:
        """Row-wise argmax; np.argmax returns the lowest index among ties."""
        return np.argmax(x, axis=-1)

    def argmax_prob(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(argmax, softmax(x) at the argmax) per row: a greedy draft and its confidence."""
        ids = self.argmax(x)
        return ids, self.pick(self.softmax(x), ids)

    def top_k(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(values, ids int64) [..., k]: each row's first k in argmax's order (NaN first, larger values,
        ties to the lower index); a row without NaN takes one partition, not a sort (vocab rows)."""
        n, flat = x.shape[-1], x.reshape(-1, x.shape[-1])
        ids = np.empty((flat.shape[0], k), np.int64)
        for r, row in enumerate(flat):
            nan = np.isnan(row)
            ids[r] = np.lexsort((np.arange(n), -np.where(nan, 0, row), ~nan))[:k] if nan.any() else largest(row, k)
        return np.take_along_axis(flat, ids, axis=1).reshape(*x.shape[:-1], k), ids.reshape(*x.shape[:-1], k)

    def pick(self, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """x [..., n], idx [...] (ints in 0..n-1) -> x[..., idx]: each row's entry at its index."""
        return np.take_along_axis(x, np.asarray(idx, dtype=np.int64)[..., None], axis=-1)[..., 0]

    # ---- DSA kpool indexer and MLA ------------------------------------------------------------
    def kpool_compress(self, keys: np.ndarray, gates: np.ndarray, ape: np.ndarray) -> np.ndarray:
        """Pool keys: per channel, softmax over the P slots of (gate + ape) weighting the keys.
        keys, gates [npool, P, Di]; ape [P, Di] -> [npool, Di]."""
        out = np.empty((keys.shape[0], keys.shape[2]), F32)
        for j in range(keys.shape[0]):
            p = _softmax(gates[j] + ape, axis=0)
            acc = p[0] * keys[j, 0]
            for m in range(1, keys.shape[1]):
                acc = acc + p[m] * keys[j, m]
            out[j] = acc
        return out

    def kpool_finalize(self, keys, gates, ape, pool_keys, at: int, t: int) -> None:
        """Finalize the pools that plane rows at..at+t-1 complete: pool keys at//P ..
        (at+t)//P - 1 from the plane's key and gate rows [rows, Di], written into pool_keys."""
        pool, di = ape.shape
        first, last = at // pool, (at + t) // pool
        if last > first:
            rows = slice(first * pool, last * pool)
            shape = (last - first, pool, di)
            pool_keys[first:last] = self.kpool_compress(keys[rows].reshape(shape), gates[rows].reshape(shape), ape)

    def kpool_select(self, q, w, pool_keys, pos0: int, pool: int, budget: int, width: int,
                     scale: float) -> np.ndarray:
        """Attended positions per row (ascending, -1 padded to `width`): [t, width].

        Row r sits at position p = pos0 + r and sees n = (p+1) // pool complete pools. With
        n <= budget it attends everything (0..p); otherwise the `budget` pools with the best
        score_j = sum_h w_h relu(scale * q_h . pk_j) win (ties to the lower pool), expanded to
        their positions, plus the incomplete tail n*pool..p. q [t, Hi, Di]; w [t, Hi] (already
        times Hi^-0.5); pool_keys [>= n, Di] finalized pool keys.
        """
        out = np.full((q.shape[0], width), -1, np.int32)
        for r in range(q.shape[0]):
            p = pos0 + r
            n = (p + 1) // pool
            if n <= budget:
                out[r, :p + 1] = np.arange(p + 1)
                continue
            s = np.maximum(q[r] @ pool_keys[:n].T * F32(scale), F32(0))
            chosen = _top(w[r] @ s, budget)
            cols = (chosen[:, None] * pool + np.arange(pool)).reshape(-1)
            tail = np.arange(n * pool, p + 1)
            out[r, :cols.size + tail.size] = np.concatenate([cols, tail])
        return out

    def mla_attention(self, q: np.ndarray, latent: np.ndarray, positions: np.ndarray, w_uk_t: np.ndarray,
                      w_uv: np.ndarray, scale: float):
        """MLA attention of per-head queries q [t, H, dn] in the absorbed form: o [t, H, dv] =
        W_UV[h] mla_attend(W_UK[h]^T q[h]), w_uk_t [H, R, dn], w_uv [H, dv, R] (the CUDA backend
        runs a prompt per head: keys and values expanded from the latent, the same sums reordered)."""
        return self.head_linear(self.mla_attend(self.head_linear(q, w_uk_t), latent, positions, scale), w_uv)

    def mla_attend(self, q_lat: np.ndarray, latent: np.ndarray, positions: np.ndarray, scale: float):
        """Absorbed MLA attention over each row's position list.

        q_lat [t, H, R]; latent [len, R] (the cached c rows); positions [t, W] int, -1 padded,
        ascending. Returns o_lat [t, H, R] = sum_j softmax_j(scale q_lat . c_j) c_j.
        """
        out = np.empty_like(q_lat)
        for r in range(q_lat.shape[0]):
            ids = positions[r][positions[r] >= 0]
            c = latent[ids]
            s = (q_lat[r] @ c.T) * F32(scale)
            out[r] = _softmax(s, axis=-1) @ c
        return out

    # ---- MoE --------------------------------------------------------------------------------------
    def moe_route(self, x, w_gate, bias, n_group: int, topk_group: int, k: int,
                  renormalize: bool, scaling: float, shared: int = -1):
        """noaux_tc sigmoid routing: choose by score + bias (within the best groups), weigh by
        the unbiased score. Returns (experts [t, k] ascending, weights [t, k]). shared >= 0 (the
        shared expert's id in the expert stacks, after the E routed ones): every row also takes
        it, as slot k at weight 1, so moe_experts adds it last: [t, k + 1]."""
        t, e = x.shape[0], w_gate.shape[0]
        idx, wts = np.empty((t, k + (shared >= 0)), np.int64), np.empty((t, k + (shared >= 0)), F32)
        for r in range(t):
            s = _sigmoid(w_gate @ x[r])
            sb = s + bias
            groups = sb.reshape(n_group, e // n_group)
            top2 = -np.sort(-groups, axis=1)[:, :2]
            keep = _top(top2[:, 0] + top2[:, 1], topk_group)
            masked = np.full_like(sb, -np.inf).reshape(n_group, -1)
            masked[keep] = groups[keep]
            idx[r, :k] = _top(masked.reshape(-1), k)
            chosen = s[idx[r, :k]]
            if renormalize:
                chosen = chosen / (chosen.sum(dtype=F32) + F32(1e-20))
            wts[r, :k] = chosen * F32(scaling)
        if shared >= 0:
            idx[:, k], wts[:, k] = shared, F32(1.0)
        return idx, wts

    def moe_experts(self, x, idx, wts, gate_w, up_w, down_w, limit: float, shared: bool = False) -> np.ndarray:
        """sum over the row's experts (ascending) of wt * down(swiglu(gate x, up x)).
        gate_w, up_w [E, I, D]; down_w [E, D, I]. shared: every row's last slot is the last
        expert (moe_route's shared slot); the same sum (the CUDA prompt path schedules by it)."""
        out = np.zeros_like(x)
        for r in range(x.shape[0]):
            for e, wt in zip(idx[r], wts[r]):
                h = self.swiglu(gate_w[e] @ x[r], up_w[e] @ x[r], limit)
                out[r] = out[r] + (down_w[e] @ h) * wt
        return out

    # ---- sampling draws -------------------------------------------------------------------------
    def race_draw(self, probs, seed: int, counter: int, tag: int = TAG_DRAW) -> int:
        """argmax_i p_i / E_i, E_i = -log(u_i) over the Philox stream: a draw from probs
        (ties to the lower index; a zero-probability token never wins)."""
        p = np.asarray(probs, dtype=np.float64)
        return int(np.argmax(p / -np.log(uniforms(seed, counter, tag, p.size))))


class EagerWalks:
    """Runs every walk as it comes: `run(key, walk, tokens, pos0, *arrays)` =
    walk(tokens, position, *arrays), `steps(key, fn)` = fn()."""

    enabled = False  # nothing to capture (the CUDA runner's switch, for callers that flip it)
    captures = 0     # and none captured (WalkGraphs counts its own)

    def __init__(self, be):
        self.be = be

    def run(self, key, walk, tokens: np.ndarray, pos0: int, *arrays):
        return walk(tokens, self.be.position(pos0), *arrays)

    def steps(self, key, fn) -> None:
        fn()
