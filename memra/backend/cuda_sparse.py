"""The sparse family of the CUDA backend: DSA kpool indexer, absorbed MLA attention, MoE.

A mixin of CudaBackend (backend/cuda.py), self-sufficient so it can be used and tested alone:

    ops = SparseOps()
    positions = ops.kpool_select(q, w, pool_keys, pos0, pool, budget, width, scale)

Each method has the name, signature and meaning of NumpyBackend's (backend/numpy_ref.py holds
the semantics) and takes and returns cupy arrays. Kernels: kernels_cu/mla.cu, kernels_cu/moe.cu.
Exact class: each output's reduction order is fixed by its own row's data, so row r of a
t-row call is bit-identical to the t=1 call; the selections (pools, experts) use a strict
total order (score, then lower index) and so are deterministic.
"""

from __future__ import annotations

import cupy as cp

from memra.backend.cuda_runtime import BLOCK, check, f32, i32, launch, position

WARPS = BLOCK // 32  # moe.cu: output units (one warp each) per block
ROUTE_ROWS = 4  # moe_route_select: one warp per row
MAX_TOPK = 32  # moe_route_select keeps the chosen experts in a fixed local array
MAX_GROUPS = 64  # ... and the kept groups in a 64-bit mask
MAX_EXPERTS = 3072  # ... and its rows' scores in 48 KB of shared memory (moe.cu MOE_MAX_EXPERTS)


def _blocks(n: int, per: int = BLOCK) -> int:
    return (n + per - 1) // per


def _matrix_kind(a, name: str) -> str:
    """Expert weights stay in their stored precision: float32, or bf16 as raw uint16 bits."""
    if a.dtype == cp.uint16:
        check(a, cp.uint16, name)
        return "bf16"
    check(a, cp.float32, name)
    return "f32"


class SparseOps:
    # ---- DSA kpool indexer -----------------------------------------------------------------
    def kpool_compress(self, keys, gates, ape):
        """Pool keys [npool, Di] from keys, gates [npool, P, Di] and ape [P, Di]."""
        check(keys, cp.float32, "keys")
        check(gates, cp.float32, "gates")
        check(ape, cp.float32, "ape")
        npool, pool, di = keys.shape
        assert gates.shape == keys.shape, f"gates {gates.shape} != keys {keys.shape}"
        assert ape.shape == (pool, di), f"ape {ape.shape} != {(pool, di)}"
        out = cp.empty((npool, di), cp.float32)
        if npool * di:
            launch("mla", "kpool_compress", (_blocks(npool * di),), (BLOCK,),
                   (keys, gates, ape, out, i32(npool), i32(pool), i32(di)))
        return out

    def kpool_finalize(self, keys, gates, ape, pool_keys, at, t: int):
        """Write the pool keys of the pools that plane rows at..at+t-1 complete (see NumpyBackend);
        keys, gates [rows, Di] are the plane's own key and gate rows, pool_keys [rows // P + 1, Di]."""
        for name, a in (("keys", keys), ("gates", gates), ("ape", ape), ("pool_keys", pool_keys)):
            check(a, cp.float32, name)
        pool, di = ape.shape
        assert keys.shape == gates.shape and keys.shape[1] == di, f"keys {keys.shape}, gates {gates.shape}"
        assert pool_keys.shape == (keys.shape[0] // pool + 1, di), f"pool_keys {pool_keys.shape}"
        if t:
            launch("mla", "kpool_finalize", (_blocks((t // pool + 1) * di),), (BLOCK,),
                   (keys, gates, ape, pool_keys, position(at), i32(t), i32(pool), i32(di)))

    def kpool_select(self, q, w, pool_keys, pos0, pool: int, budget: int, width: int,
                     scale: float):
        """Attended positions [t, width] int32, ascending, -1 padded (see NumpyBackend). `pos0`
        is a host int or the walk's device position; every launch is sized by the pool keys the
        plane can hold, not by the position, so a captured walk stays valid as the cache grows."""
        check(q, cp.float32, "q")
        check(w, cp.float32, "w")
        check(pool_keys, cp.float32, "pool_keys")
        t, hi, di = q.shape
        assert w.shape == (t, hi), f"w {w.shape} != {(t, hi)}"
        assert pool_keys.ndim == 2 and pool_keys.shape[1] == di, f"pool_keys {pool_keys.shape}"
        assert pool >= 1 and budget >= 1, f"pool {pool} and budget {budget} must be >= 1"
        assert width >= (budget + 1) * pool - 1, (
            f"width {width} < budget*pool + pool - 1 = {(budget + 1) * pool - 1}")
        nmax = pool_keys.shape[0]
        if not isinstance(pos0, cp.ndarray):
            assert nmax >= (pos0 + t) // pool, f"pool_keys has {nmax} rows < {(pos0 + t) // pool}"
        out = cp.empty((t, width), cp.int32)
        if t == 0:
            return out
        at = position(pos0)
        scores = cp.empty((t, max(nmax, 1)), cp.float32)
        launch("mla", "kpool_scores", (_blocks(max(nmax, 1)), t), (BLOCK,),
               (q, w, pool_keys, scores, at, i32(pool), i32(budget), i32(hi), i32(di),
                i32(max(nmax, 1)), f32(scale)))
        launch("mla", "kpool_select", (t,), (BLOCK,),
               (scores, out, at, i32(pool), i32(budget), i32(width), i32(max(nmax, 1))),
               shared_mem=4 * budget)
        return out

    # ---- MLA -------------------------------------------------------------------------------
    def mla_attend(self, q_lat, latent, positions, scale: float):
        """o_lat [t, H, R] = sum_j softmax_j(scale q_lat . c_j) c_j over each row's positions."""
        check(q_lat, cp.float32, "q_lat")
        check(latent, cp.float32, "latent")
        check(positions, cp.int32, "positions")
        t, h, rank = q_lat.shape
        assert latent.ndim == 2 and latent.shape[1] == rank, f"latent {latent.shape}"
        assert positions.ndim == 2 and positions.shape[0] == t, f"positions {positions.shape}"
        width = positions.shape[1]
        if t * h * width == 0:  # an empty list attends nothing
            return cp.zeros((t, h, rank), cp.float32)
        out = cp.empty((t, h, rank), cp.float32)
        probs = cp.empty((t * h, width), cp.float32)
        launch("mla", "mla_scores", (_blocks(width, 32), t), (BLOCK,),
               (q_lat, latent, positions, probs, i32(h), i32(rank), i32(width), f32(scale)))
        launch("mla", "mla_softmax", (t * h,), (BLOCK,), (probs, positions, i32(h), i32(width)))
        launch("mla", "mla_mix", (_blocks(rank, 32), _blocks(h, 8), t), (BLOCK,),
               (probs, latent, positions, out, i32(h), i32(rank), i32(width)))
        return out

    # ---- MoE -------------------------------------------------------------------------------
    def moe_route(self, x, w_gate, bias, n_group: int, topk_group: int, k: int,
                  renormalize: bool, scaling: float):
        """noaux_tc sigmoid routing -> (experts [t, k] int64 ascending, weights [t, k])."""
        check(x, cp.float32, "x")
        check(w_gate, cp.float32, "w_gate")
        check(bias, cp.float32, "bias")
        t, d = x.shape
        e = w_gate.shape[0]
        assert w_gate.shape == (e, d) and bias.shape == (e,), f"w_gate {w_gate.shape}, bias {bias.shape}"
        assert e <= MAX_EXPERTS, f"moe_route: E={e} experts, at most {MAX_EXPERTS}"
        assert 1 <= n_group <= MAX_GROUPS and e % n_group == 0 and e // n_group >= 2, (
            f"n_group {n_group}: must divide E={e} into groups of >= 2, at most {MAX_GROUPS}")
        assert 1 <= topk_group <= n_group, f"topk_group {topk_group} outside 1..{n_group}"
        assert 1 <= k <= min(MAX_TOPK, topk_group * (e // n_group)), (
            f"k {k} outside 1..min({MAX_TOPK}, experts in the kept groups)")
        experts = cp.empty((t, k), cp.int64)
        weights = cp.empty((t, k), cp.float32)
        if t == 0:
            return experts, weights
        logits = cp.empty((t, e), cp.float32)
        launch("moe", "moe_router_logits", (_blocks(e, WARPS),), (BLOCK,),
               (x, w_gate, logits, i32(t), i32(e), i32(d)))
        launch("moe", "moe_route_select", (_blocks(t, ROUTE_ROWS),), (32 * ROUTE_ROWS,),
               (logits, bias, experts, weights, i32(t), i32(e), i32(n_group),
                i32(topk_group), i32(k), i32(bool(renormalize)), f32(scaling)),
               shared_mem=4 * e * ROUTE_ROWS)
        return experts, weights

    def moe_experts(self, x, idx, wts, gate_w, up_w, down_w, limit: float):
        """sum over the row's experts (slot order) of wt * down(swiglu(gate x, up x)).
        gate_w, up_w [E, I, D]; down_w [E, D, I]; float32 or bf16 (uint16), all alike."""
        check(x, cp.float32, "x")
        check(idx, cp.int64, "idx")
        check(wts, cp.float32, "wts")
        kind = _matrix_kind(gate_w, "gate_w")
        for name, a in (("up_w", up_w), ("down_w", down_w)):
            check(a, gate_w.dtype, name)
        t, d = x.shape
        e, inter, _ = gate_w.shape
        k = idx.shape[1]
        assert gate_w.shape == (e, inter, d) and up_w.shape == (e, inter, d), (
            f"gate_w {gate_w.shape}, up_w {up_w.shape}: expected {(e, inter, d)}")
        assert down_w.shape == (e, d, inter), f"down_w {down_w.shape}: expected {(e, d, inter)}"
        assert idx.shape == (t, k) and wts.shape == (t, k), f"idx {idx.shape}, wts {wts.shape}"
        out = cp.empty((t, d), cp.float32)
        if t * k * d == 0:
            out.fill(0)
            return out
        # zeroed so a slot whose expert id matches no block adds 0 rather than garbage
        h = cp.zeros((t, k, inter), cp.float32)
        y = cp.zeros((t, k, d), cp.float32)
        if kind == "bf16":  # tensor-core tiles of 16 gate|up units and 32 outputs; 8 or 16 rows a pass
            # blocks only for the experts the rows route to: their ascending list, made on the device
            assert e <= MAX_EXPERTS, f"moe_experts: E={e} experts, at most {MAX_EXPERTS}"
            rows, listed = "n1" if t <= 8 else "n2", min(e, t * k)
            experts, count = cp.empty(listed, cp.int32), cp.empty(1, cp.int32)
            launch("moe", "moe_expert_list", (1,), (BLOCK,), (idx, i32(t * k), i32(e), experts, count))
            launch("moe", f"moe_gate_up_bf16_{rows}", (_blocks(inter, 16), listed), (BLOCK,),
                   (x, idx, experts, count, gate_w, up_w, h, i32(t), i32(k), i32(inter), i32(d), f32(limit)))
            launch("moe", f"moe_down_bf16_{rows}", (_blocks(d, 32), listed), (BLOCK,),
                   (h, idx, experts, count, down_w, y, i32(t), i32(k), i32(inter), i32(d)))
        else:  # float32 weights (test fixtures): a block row per expert, idle where none is routed
            launch("moe", "moe_gate_up_f32", (_blocks(inter, WARPS), e), (BLOCK,),
                   (x, idx, gate_w, up_w, h, i32(t), i32(k), i32(inter), i32(d), f32(limit)))
            launch("moe", "moe_down_f32", (_blocks(d, WARPS), e), (BLOCK,),
                   (h, idx, down_w, y, i32(t), i32(k), i32(inter), i32(d)))
        launch("moe", "moe_combine", (_blocks(t * d),), (BLOCK,),
               (y, wts, out, i32(t), i32(k), i32(d)))
        return out
