"""Kimi Delta Attention (KDA): the linear-attention mixer with a recurrent state.

q, k, v = SiLU(causal depthwise conv) of their projections; q, k L2-normalised, q scaled by
dk^-0.5; per-channel log-decay g = lb * sigmoid(exp(A_log) * (f + dt_bias)); beta = sigmoid;
S <- S * exp(g); S += k (x) beta (v - S^T k); o = S^T q; gated RMSNorm; o_proj.
One t-row call runs the recurrence over the rows in order (research/kda.md).
"""

from __future__ import annotations

import numpy as np

from memra.model.cache import KdaState


class KdaMixer:
    def __init__(self, be, w, cfg):
        self.be = be
        self.cfg = cfg
        self.heads, self.dk = cfg.linear_num_heads, cfg.linear_head_dim
        c, k = cfg.linear_dim, cfg.linear_conv_kernel_dim
        stack = lambda *names: np.concatenate([w(n) for n in names], axis=0)
        self.qkv = be.matrix(stack("q_proj.weight", "k_proj.weight", "v_proj.weight"))
        conv = stack("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
        self.conv = be.weight(conv.reshape(3 * c, k))
        self.f_a, self.f_b = be.matrix(w("f_a_proj.weight")), be.matrix(w("f_b_proj.weight"))
        self.a_log = be.weight(w("A_log"))
        self.dt_bias = be.weight(w("dt_bias").reshape(self.heads, self.dk))
        self.b_proj = be.matrix(w("b_proj.weight"))
        self.g_a, self.g_b = be.matrix(w("g_a_proj.weight")), be.matrix(w("g_b_proj.weight"))
        self.o_norm = be.weight(w("o_norm.weight"))
        self.o_proj = be.matrix(w("o_proj.weight"))

    def restore(self, st: KdaState, stash: dict, keep: int) -> None:
        """Put the layer back at `keep` rows past the stash: the ring re-rolled over the kept
        raw rows, S rebuilt by replaying the kept rows' scans from the snapshot (the same
        per-row program, so bit-identical to never having run the rest)."""
        be = self.be
        window = be.concat([stash["ring"], stash["raw"][:keep]], axis=0)
        st.ring[...] = window[window.shape[0] - st.ring.shape[0]:]
        st.state[...] = stash["state"]
        q, k, v, g, beta = stash["scan"]
        be.kda_recurrence(q[:keep], k[:keep], v[:keep], g[:keep], beta[:keep], st.state)

    def new_state(self) -> KdaState:
        cfg, be = self.cfg, self.be
        ring = be.zeros((cfg.linear_conv_kernel_dim - 1, 3 * cfg.linear_dim))
        return KdaState(ring=ring, state=be.zeros((self.heads, self.dk, self.dk)))

    def __call__(self, x, st: KdaState, stash: dict | None = None):
        """Rows x [t, D] -> [t, D], advancing the conv ring and S in place. With `stash`, keep
        what a rollback needs: the pre-call ring and state and each row's scan inputs."""
        be, t, hk, dk = self.be, x.shape[0], self.heads, self.dk
        c = hk * dk
        raw = be.linear(x, self.qkv)
        if stash is not None:
            stash.update(ring=st.ring.copy(), state=st.state.copy(), raw=raw)
        mixed = be.short_conv(raw, st.ring, self.conv)
        heads = lambda cols: be.contiguous(mixed[:, cols]).reshape(t, hk, dk)
        q = be.scale(be.l2norm(heads(slice(0, c)), 1e-6), dk ** -0.5)
        k = be.l2norm(heads(slice(c, 2 * c)), 1e-6)
        v = heads(slice(2 * c, 3 * c))
        f = be.linear(be.linear(x, self.f_a), self.f_b).reshape(t, hk, dk)
        g = be.kda_gate(f, self.a_log, self.dt_bias, self.cfg.linear_lower_bound)
        beta = be.sigmoid(be.linear(x, self.b_proj))
        if stash is not None:
            stash.update(scan=(q, k, v, g, beta))
        o = be.kda_recurrence(q, k, v, g, beta, st.state)
        gate = be.linear(be.linear(x, self.g_a), self.g_b).reshape(t, hk, dk)
        o = be.gated_rmsnorm(o, gate, self.o_norm, self.cfg.rms_norm_eps)
        return be.linear(o.reshape(t, c), self.o_proj)
