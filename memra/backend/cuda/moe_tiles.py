"""The routed experts on the exact tiles (kernels_cu/moe.cu): each (row, slot) pair's expert
output, before the weighted sum. A decode or verify walk runs every expert here; a prompt (prime
class, prime.py) runs here only its experts of few slots, which would not repay their GEMMs.

    y = expert_tiles(x, idx, gate_w, up_w, down_w, limit)   # [t, k, D]: slot (r, s)'s expert on x[r]

Rows of slots no expert serves (an id outside [0, E)) stay unwritten.
"""

from __future__ import annotations

import cupy as cp

from memra.backend.cuda.fp8 import DeviceFp8
from memra.backend.cuda.runtime import BLOCK, blocks_of, f32, i32, launch
from memra.kernels_cu.constants import BF16_OUTS, DOWN_OUTS, GATE_UP_UNITS, MOE_MAX_EXPERTS, WARPS_PER_BLOCK


def expert_tiles(x, idx, gate_w, up_w, down_w, limit: float):
    """[t, k, D] = down(swiglu(gate x, up x)) of each slot's expert on its row; the stacks bf16
    bits, DeviceFp8 or float32 (test fixtures), all alike (moe_experts checks them)."""
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
            down, kind, outs = (down_w.data, down_w.scale_inv), "fp8", BF16_OUTS
        else:
            gate_up, down, kind = (gate_w, up_w), (down_w,), "bf16"
            outs = DOWN_OUTS if rows == "n1" else BF16_OUTS  # moe.cu's down_bf16
        launch("moe", f"moe_gate_up_{kind}_{rows}", (blocks_of(inter, GATE_UP_UNITS), listed), (BLOCK,),
               (x, idx, experts, count, *gate_up, h, i32(t), i32(k), i32(inter), i32(d), f32(limit)))
        launch("moe", f"moe_down_{kind}_{rows}", (blocks_of(d, outs), listed), (BLOCK,),
               (h, idx, experts, count, *down, y, i32(t), i32(k), i32(inter), i32(d)))
    else:  # float32 weights: a block row per expert, idle where none is routed
        launch("moe", "moe_gate_up_f32", (blocks_of(inter, WARPS_PER_BLOCK), e), (BLOCK,),
               (x, idx, gate_w, up_w, h, i32(t), i32(k), i32(inter), i32(d), f32(limit)))
        launch("moe", "moe_down_f32", (blocks_of(d, WARPS_PER_BLOCK), e), (BLOCK,),
               (h, idx, down_w, y, i32(t), i32(k), i32(inter), i32(d)))
    return y
