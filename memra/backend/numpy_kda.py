"""The KDA ops of the numpy reference backend: the causal short conv with its ring, the per-channel
decay gate, and the delta-rule recurrence with its state (research/kda.md). A mixin of
NumpyBackend (numpy_ref.py), whose silu and sigmoid it uses; the CUDA twins are in
backend/cuda/kda.py. The stateful ops walk the rows in order and advance the ring / state in
place, so a t-row call is t one-row calls; with `rows` they also leave the ring / state after
each row but the last, which a verify walk's rollback copies back.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


class NumpyKdaOps:
    def short_conv(self, x: np.ndarray, ring: np.ndarray, w: np.ndarray, rows=None) -> np.ndarray:
        """Causal depthwise conv + SiLU over t rows; ring [K-1, C] holds the previous inputs
        (oldest first) and is advanced in place. w [C, K]; tap K-1 meets the current row.
        rows [>= t-1, K-1, C] (optional): rows[r] = the ring after row r, for r < t - 1."""
        k = w.shape[1]
        out = np.empty_like(x)
        for r in range(x.shape[0]):
            acc = w[:, 0] * (ring[0] if k > 1 else x[r])
            for j in range(1, k):
                src = ring[j] if j < k - 1 else x[r]
                acc = acc + w[:, j] * src
            out[r] = self.silu(acc)
            if k > 1:
                ring[:-1] = ring[1:]
                ring[-1] = x[r]
            if rows is not None and r < x.shape[0] - 1:
                rows[r] = ring
        return out

    def kda_gate(self, f: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray, lower_bound) -> np.ndarray:
        """Per-channel log-decay g: f [t, Hk, dk], a_log [Hk], dt_bias [Hk, dk]."""
        z = f + dt_bias
        rate = np.exp(a_log)[:, None]
        if lower_bound is not None:
            return (F32(lower_bound) * self.sigmoid(rate * z)).astype(F32)
        soft = np.where(z > 20, z, np.log1p(np.exp(np.minimum(z, 20))))
        return (-rate * soft).astype(F32)

    def kda_recurrence(self, q, k, v, g, beta, state: np.ndarray, rows=None) -> np.ndarray:
        """Delta rule, rows in order, state [Hk, dk, dv] advanced in place; returns o [t, Hk, dv];
        rows [>= t-1, Hk, dk, dv] (optional): rows[r] = the state after row r, for r < t - 1.

        S <- S * exp(g)[:, None]; S += k (x) beta (v - S^T k); o = S^T q.
        """
        t, hk, _ = q.shape
        out = np.empty((t, hk, v.shape[2]), F32)
        for r in range(t):
            for h in range(hk):
                s = state[h] * np.exp(g[r, h])[:, None]
                delta = (v[r, h] - k[r, h] @ s) * beta[r, h]
                s = s + np.outer(k[r, h], delta)
                state[h] = s
                out[r, h] = q[r, h] @ s
            if rows is not None and r < t - 1:
                rows[r] = state
        return out
