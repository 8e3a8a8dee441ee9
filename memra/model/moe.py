"""Feed-forward blocks: the clamped-SwiGLU dense MLP and the sigmoid noaux_tc MoE.

SwiGLU clamps gate from above and up on both sides at swiglu_limit. The MoE chooses experts by
sigmoid score + e_score_correction_bias inside the best groups, weighs them by the unbiased
scores (renormalised, times routed_scaling_factor) and adds the unscaled shared expert.
"""

from __future__ import annotations

from memra.backend.fp8 import stack_weights  # np.stack, FP8 expert blocks included


class DenseMlp:
    def __init__(self, be, w, limit: float):
        self.be, self.limit = be, limit
        self.gate = be.matrix(w("gate_proj.weight"))
        self.up = be.matrix(w("up_proj.weight"))
        self.down = be.matrix(w("down_proj.weight"))

    def __call__(self, x):
        be = self.be
        h = be.swiglu(*be.linears(x, (self.gate, self.up)), self.limit)
        return be.linear(h, self.down)


class Moe:
    def __init__(self, be, w, cfg):
        self.be, self.cfg = be, cfg
        self.router = be.weight(w("gate.weight"))
        self.bias = be.weight(w("gate.e_score_correction_bias"))
        names = [f"experts.{e}" for e in range(cfg.n_routed_experts)]
        parts = ("gate_proj", "up_proj", "down_proj")
        stacked = all(_alike(w(f"shared_experts.{p}.weight"), w(f"{names[0]}.{p}.weight")) for p in parts)
        self.shared_id = cfg.n_routed_experts if stacked else -1
        self.shared = None if stacked else DenseMlp(be, lambda n: w("shared_experts." + n), cfg.swiglu_limit)
        names += ["shared_experts"] if stacked else []
        stack = lambda part: be.matrix(stack_weights([w(f"{n}.{part}.weight") for n in names]))
        self.gate_w, self.up_w, self.down_w = (stack(p) for p in parts)

    def __call__(self, x):
        be, cfg = self.be, self.cfg
        idx, wts = be.moe_route(
            x, self.router, self.bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok,
            cfg.norm_topk_prob, cfg.routed_scaling_factor, self.shared_id,
        )
        out = be.moe_experts(x, idx, wts, self.gate_w, self.up_w, self.down_w, cfg.swiglu_limit, self.shared_id >= 0)
        return out if self.shared is None else be.add(out, self.shared(x))


def _alike(a, b) -> bool:
    """Same class, dtype and shape (a bf16 array, a float32 one or an FP8 block): one stack."""
    return type(a) is type(b) and getattr(a, "dtype", None) == getattr(b, "dtype", None) and a.shape == b.shape
