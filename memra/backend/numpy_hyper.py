"""The mHC site of the numpy reference backend: the site weights (fn matvec over the rmsnormed
flattened streams, sigmoid pre/post, a row softmax Sinkhorn-normalised into the mix), the
collapse, the combine, the whole site, and the trunk's final stream mean. A mixin of NumpyBackend
(numpy_ref.py), whose rmsnorm, sigmoid and softmax it uses; the CUDA twins are in
backend/cuda/hyper.py.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


class NumpyHyperOps:
    def hc_weights(self, streams, fn, base, scale, rms_eps: float, hc_eps: float, iters: int):
        """mHC site weights per row: (pre [t, n], post [t, n], comb [t, n, n]).

        streams [t, n, D]; m = fn @ rmsnorm(vec X); comb is Sinkhorn-normalised, starting
        from a row softmax and ending with a column normalisation.
        """
        t, n, _ = streams.shape
        pre, post = np.empty((t, n), F32), np.empty((t, n), F32)
        c = np.empty((t, n, n), F32)
        eps = F32(hc_eps)
        for r in range(t):
            m = fn @ self.rmsnorm(streams[r].reshape(1, -1), None, rms_eps)[0]
            pre[r] = self.sigmoid(m[:n] * scale[0] + base[:n]) + eps
            post[r] = F32(2) * self.sigmoid(m[n:2 * n] * scale[1] + base[n:2 * n])
            c[r] = self.softmax(m[2 * n:].reshape(n, n) * scale[2] + base[2 * n:].reshape(n, n)) + eps
        # every row's Sinkhorn at once: a sum over a row's columns (axis 1) or its rows (axis 2) is
        # the same adds in the same order as that row alone, and there are 2 iters numpy calls, not 2 t iters
        c = c / (c.sum(axis=1, keepdims=True) + eps)
        for _ in range(iters - 1):
            c = c / (c.sum(axis=2, keepdims=True) + eps)
            c = c / (c.sum(axis=1, keepdims=True) + eps)
        return pre, post, c

    def hc_site(self, streams, fn, base, scale, rms_eps: float, hc_eps: float, iters: int, block):
        """One whole site: X' = post (x) f + C^T X with f = block(sum_i pre_i X_i) ([t, D] rows
        -> [t, D]). A backend may run the mix C beside `block` (CUDA: a side stream)."""
        pre, post, comb = self.hc_weights(streams, fn, base, scale, rms_eps, hc_eps, iters)
        return self.hc_combine(streams, block(self.hc_collapse(streams, pre)), post, comb)

    def hc_collapse(self, streams: np.ndarray, pre: np.ndarray) -> np.ndarray:
        """sum_i pre_i X_i, accumulated in stream order: [t, n, D] -> [t, D]."""
        out = pre[:, 0, None] * streams[:, 0]
        for i in range(1, streams.shape[1]):
            out = out + pre[:, i, None] * streams[:, i]
        return out.astype(F32)

    def hc_combine(self, streams, f, post, comb) -> np.ndarray:
        """X'_b = post_b f + sum_a C[a, b] X_a  (note the transpose: C^T X)."""
        n = streams.shape[1]
        out = np.empty_like(streams)
        for b in range(n):
            acc = comb[:, 0, b, None] * streams[:, 0]
            for a in range(1, n):
                acc = acc + comb[:, a, b, None] * streams[:, a]
            out[:, b] = post[:, b, None] * f + acc
        return out

    def stream_mean(self, streams: np.ndarray) -> np.ndarray:
        out = streams[:, 0].copy()
        for i in range(1, streams.shape[1]):
            out = out + streams[:, i]
        return (out / F32(streams.shape[1])).astype(F32)
