"""The draft networks' ops of the CUDA backend (kernels_cu/draft.cu), with the signatures of
NumpyDraftOps. Not exact class: a drafter's kernels need only be deterministic. They let a draft
round be captured into one CUDA graph, where CuPy refuses cuBLAS."""

from __future__ import annotations

import cupy as cp

from memra.backend.cuda.runtime import BLOCK, check, device_input, f32, i32, launch, position
from memra.kernels_cu.constants import DRAFT_MAX_HD


class DraftOps:
    def block_attention(self, q, k_ctx, v_ctx, k_blk, v_blk, n_ctx, causal: bool, window, scale: float):
        """NumpyDraftOps.block_attention; n_ctx a host int or the int32[1] device position (a
        captured round reads its context length from there)."""
        b, nh, hd = q.shape
        nkv = k_blk.shape[1]
        assert hd <= DRAFT_MAX_HD, f"block_attention: head dim {hd} > DRAFT_MAX_HD {DRAFT_MAX_HD}"
        assert nh % nkv == 0 and k_blk.shape == v_blk.shape == (b, nkv, hd), \
            f"block_attention: block keys {k_blk.shape} / values {v_blk.shape} do not fit q {q.shape}"
        assert k_ctx.shape == v_ctx.shape and k_ctx.shape[1:] == (nkv, hd), \
            f"block_attention: context keys {k_ctx.shape} / values {v_ctx.shape} do not fit [N, {nkv}, {hd}]"
        for a, name in ((k_ctx, "k_ctx"), (v_ctx, "v_ctx")):
            check(a, cp.float32, name)
        out = cp.empty((b, nh, hd), cp.float32)
        if b and nh:
            launch("draft", "block_attention", (nh, b), (BLOCK,),
                   (device_input(q, "q"), k_ctx, v_ctx, device_input(k_blk, "k_blk"), device_input(v_blk, "v_blk"),
                    position(n_ctx), out, i32(b), i32(nh), i32(nkv), i32(hd), i32(bool(causal)),
                    i32(window or 0), f32(scale)))
        return out
