"""The MoE family of the CUDA backend (kernels_cu/moe.cu): routing and the routed experts.

Mixin of CudaBackend with NumpyBackend's names, signatures and meaning, on cupy arrays:

    idx, wts = MoeOps().moe_route(x, w_gate, bias, n_group, topk_group, k, scaling)
    y = expert_tiles(x, idx, gate_w, up_w, down_w, limit)   # [t, k, D]: each slot's expert on its row

Exact class: expert selection uses a strict total order (score, then lower index); each
expert's outputs sum in a fixed order whatever the row count.
"""

from __future__ import annotations

import cupy as cp

from memra.backend.cuda.fp8 import DeviceFp8
from memra.backend.cuda.prime import is_prime, prime_experts
from memra.backend.cuda.runtime import BLOCK, blocks_of, check, f32, i32, launch, weight_kind
from memra.kernels_cu.constants import (BF16_OUTS, GATE_UP_UNITS, MAX_GROUPS, MAX_TOPK,
                                        MOE_MAX_EXPERTS, WARPS_PER_BLOCK)


def expert_tiles(x, idx, gate_w, up_w, down_w, limit: float):
    """[t, k, D] = down(swiglu(gate x, up x)) of each slot's expert on its row; the stacks bf16
    bits, DeviceFp8 or float32 (test fixtures), all alike (moe_experts checks them). Rows of
    slots no expert serves (an id outside [0, E)) stay unwritten: moe_combine adds 0 for them."""
    (t, d), k = x.shape, idx.shape[1]
    e, inter, _ = gate_w.shape
    h = cp.empty((t, k, inter), cp.float32)
    y = cp.empty((t, k, d), cp.float32)
    if isinstance(gate_w, DeviceFp8) or gate_w.dtype == cp.uint16:
        # tensor-core tiles of gate|up units and of outputs, 8 or 16 rows a pass, blocks only for
        # the experts the rows route to: their ascending list, made on the device
        assert e <= MOE_MAX_EXPERTS, f"moe_experts: E={e} experts, at most {MOE_MAX_EXPERTS}"
        rows, listed = "n1" if t <= 8 else "n2", min(e, t * k)
        experts, count = cp.empty(listed, cp.int32), cp.empty(1, cp.int32)
        launch("moe", "moe_expert_list", (1,), (BLOCK,), (idx, i32(t * k), i32(e), experts, count))
        if isinstance(gate_w, DeviceFp8):  # one byte per weight and a scale per 128-block
            gate_up = (gate_w.data, gate_w.scale_inv, up_w.data, up_w.scale_inv)
            down, kind = (down_w.data, down_w.scale_inv), "fp8"
        else:
            gate_up, down, kind = (gate_w, up_w), (down_w,), "bf16"
        launch("moe", f"moe_gate_up_{kind}_{rows}", (blocks_of(inter, GATE_UP_UNITS), listed), (BLOCK,),
               (x, idx, experts, count, *gate_up, h, i32(t), i32(k), i32(inter), i32(d), f32(limit)))
        launch("moe", f"moe_down_{kind}_{rows}", (blocks_of(d, BF16_OUTS), listed), (BLOCK,),
               (h, idx, experts, count, *down, y, i32(t), i32(k), i32(inter), i32(d)))
    else:  # float32 weights: a block row per expert, idle where none is routed
        launch("moe", "moe_gate_up_f32", (blocks_of(inter, WARPS_PER_BLOCK), e), (BLOCK,),
               (x, idx, gate_w, up_w, h, i32(t), i32(k), i32(inter), i32(d), f32(limit)))
        launch("moe", "moe_down_f32", (blocks_of(d, WARPS_PER_BLOCK), e), (BLOCK,),
               (h, idx, down_w, y, i32(t), i32(k), i32(inter), i32(d)))
    return y


class MoeOps:
    def moe_route(self, x, w_gate, bias, n_group: int, topk_group: int, k: int,
                  renormalize: bool, scaling: float, shared: int = -1):
        """noaux_tc sigmoid routing -> (experts [t, k] int64 ascending, weights [t, k]); with a
        shared expert id (>= 0), every row's slot k is that expert at weight 1: [t, k + 1]."""
        check(x, cp.float32, "x")
        check(w_gate, cp.float32, "w_gate")
        check(bias, cp.float32, "bias")
        t, d = x.shape
        e = w_gate.shape[0]
        assert w_gate.shape == (e, d) and bias.shape == (e,), f"w_gate {w_gate.shape}, bias {bias.shape}"
        assert e <= MOE_MAX_EXPERTS, f"moe_route: E={e} experts, at most {MOE_MAX_EXPERTS}"
        assert 1 <= n_group <= MAX_GROUPS and e % n_group == 0 and e // n_group >= 2, (
            f"n_group {n_group}: must divide E={e} into groups of >= 2, at most {MAX_GROUPS}")
        assert 1 <= topk_group <= n_group, f"topk_group {topk_group} outside 1..{n_group}"
        assert 1 <= k <= min(MAX_TOPK, topk_group * (e // n_group)), (
            f"k {k} outside 1..min({MAX_TOPK}, experts in the kept groups)")
        assert shared < 0 or shared >= e, f"shared expert id {shared} is one of the {e} routed experts"
        experts = cp.empty((t, k + (shared >= 0)), cp.int64)
        weights = cp.empty((t, k + (shared >= 0)), cp.float32)
        if t == 0:
            return experts, weights
        if is_prime(t):  # a prompt: one float32 GEMM (prime.py)
            logits = cp.ascontiguousarray(cp.matmul(x, w_gate.T))
        else:
            logits = cp.empty((t, e), cp.float32)
            launch("moe", "moe_router_logits", (e, t), (32,),
                   (x, w_gate, logits, i32(t), i32(e), i32(d)))
        launch("moe", "moe_route_select", (t,), (BLOCK,),
               (logits, bias, experts, weights, i32(t), i32(e), i32(n_group),
                i32(topk_group), i32(k), i32(bool(renormalize)), f32(scaling), i32(shared)),
               shared_mem=4 * e)
        return experts, weights

    def moe_experts(self, x, idx, wts, gate_w, up_w, down_w, limit: float, shared: bool = False):
        """sum over the row's experts (slot order) of wt * down(swiglu(gate x, up x)).
        gate_w, up_w [E, I, D]; down_w [E, D, I]; float32, bf16 (uint16) or DeviceFp8, all alike.
        shared: every row's last slot is the last expert (moe_route's shared slot); a prompt runs
        it while the host reads the other experts' slot counts."""
        check(x, cp.float32, "x")
        check(idx, cp.int64, "idx")
        check(wts, cp.float32, "wts")
        if isinstance(gate_w, DeviceFp8):
            assert isinstance(up_w, DeviceFp8) and isinstance(down_w, DeviceFp8), "FP8 experts: all three stacks"
            kind = "fp8"
        else:
            kind = weight_kind(gate_w, "gate_w")
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
        if is_prime(t) and kind != "f32":  # a prompt: cuBLAS GEMMs for the experts of many rows (prime.py)
            return prime_experts(x, idx, wts, gate_w, up_w, down_w, limit, expert_tiles, shared)
        y = expert_tiles(x, idx, gate_w, up_w, down_w, limit)
        launch("moe", "moe_combine", (blocks_of(t * d),), (BLOCK,),
               (y, idx, wts, out, i32(t), i32(k), i32(d), i32(e)))
        return out
