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
        experts = range(cfg.n_routed_experts)
        stack = lambda part: be.matrix(stack_weights([w(f"experts.{e}.{part}.weight") for e in experts]))
        self.gate_w, self.up_w, self.down_w = stack("gate_proj"), stack("up_proj"), stack("down_proj")
        self.shared = DenseMlp(be, lambda n: w("shared_experts." + n), cfg.swiglu_limit)

    def __call__(self, x):
        be, cfg = self.be, self.cfg
        idx, wts = be.moe_route(
            x, self.router, self.bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok,
            cfg.norm_topk_prob, cfg.routed_scaling_factor,
        )
        routed = be.moe_experts(x, idx, wts, self.gate_w, self.up_w, self.down_w, cfg.swiglu_limit)
        return be.add(routed, self.shared(x))
