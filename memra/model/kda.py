"""Kimi Delta Attention (KDA): the linear-attention mixer with a recurrent state.

q, k, v = SiLU(causal depthwise conv) of their projections; q, k L2-normalised, q scaled by
dk^-0.5; per-channel log-decay g = lb * sigmoid(exp(A_log) * (f + dt_bias)); beta = sigmoid;
S <- S * exp(g); S += k (x) beta (v - S^T k); o = S^T q; gated RMSNorm; o_proj.
One t-row call runs the recurrence over the rows in order (research/kda.md).
"""

from __future__ import annotations

import numpy as np

from memra.backend.numpy_kda import kda_mark_count, kda_record_width  # the rollback buffers' layout, one home
from memra.limits import VERIFY_CAP
from memra.model.cache import KdaPart, KdaState


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

    def new_states(self, layers: tuple) -> tuple[KdaPart, list[KdaState]]:
        """The live rings and states of these KDA layers (this mixer's shapes), side by side."""
        be, n = self.be, len(layers)
        part = KdaPart(layers=tuple(layers), ring=be.zeros((n, *self._ring_shape())),
                       state=be.zeros((n, self.heads, self.dk, self.dk)))
        return part, [KdaState(ring=part.ring[j], state=part.state[j], part=part, slot=j) for j in range(n)]

    def new_state(self) -> KdaState:
        """One layer's ring and state on their own (a part of one layer)."""
        return self.new_states((None,))[1][0]

    def new_snapshots(self, part: KdaPart) -> None:
        """The buffers a verify walk writes for its rollback (made once, at the first one)."""
        if part.marks is None:
            n, cap, hk, dk = len(part.layers), VERIFY_CAP, self.heads, self.dk
            part.ring_rows = self.be.zeros((cap, n, *self._ring_shape()))
            part.marks = self.be.zeros((n, kda_mark_count(cap), hk, dk, dk))
            part.record = self.be.zeros((n, cap, hk, kda_record_width(dk, dk)))

    def _ring_shape(self) -> tuple[int, int]:
        return self.cfg.linear_conv_kernel_dim - 1, 3 * self.cfg.linear_dim

    def __call__(self, x, st: KdaState, snapshots: bool = False):
        """Rows x [t, D] -> [t, D], advancing the conv ring and S in place. With `snapshots` (a
        verify walk), the kernels also write the ring before each row, S every KDA_MARK_ROWS
        rows and each row's recurrence inputs into the layer's rollback buffers (KdaPart)."""
        be, t, hk, dk = self.be, x.shape[0], self.heads, self.dk
        c = hk * dk
        raw, f_low, beta_in, gate_low = be.linears(x, (self.qkv, self.f_a, self.b_proj, self.g_a))
        ring_rows, marks, record = st.snapshots() if snapshots else (None, None, None)
        # the gates' chain (small kernels each) runs beside the conv and the norms
        with be.beside(lambda: self._gates(f_low, beta_in, gate_low), t) as gates:
            mixed = be.short_conv(raw, st.ring, self.conv, ring_rows, groups=3)  # [3, t, c]: q, k, v
            q = be.l2norm(mixed[0].reshape(t, hk, dk), 1e-6, scale=dk ** -0.5)
            k = be.l2norm(mixed[1].reshape(t, hk, dk), 1e-6)
        g, beta, gate = gates.result
        o = be.kda_recurrence(q, k, mixed[2].reshape(t, hk, dk), g, beta, st.state, marks, record)
        o = be.gated_rmsnorm(o, gate, self.o_norm, self.cfg.rms_norm_eps)
        return be.linear(o.reshape(t, c), self.o_proj)

    def _gates(self, f_low, beta_in, gate_low):
        """(g, beta, gate): the per-channel log-decay, sigmoid(beta_in) and the output gate."""
        be, shape = self.be, (f_low.shape[0], self.heads, self.dk)
        g = be.kda_gate(be.linear(f_low, self.f_b).reshape(shape), self.a_log, self.dt_bias,
                        self.cfg.linear_lower_bound)
        return g, be.sigmoid(beta_in), be.linear(gate_low, self.g_b).reshape(shape)
