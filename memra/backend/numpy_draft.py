"""The draft networks' ops of the numpy reference backend (a mixin of NumpyBackend, whose softmax
it uses); the CUDA twins are in backend/cuda/draft.py. A drafter is not in the exact class (the
target verifies every draft), so the twins agree within float32 rounding, not bit for bit."""

from __future__ import annotations

import numpy as np

F32 = np.float32


class NumpyDraftOps:
    def block_attention(self, q, k_ctx, v_ctx, k_blk, v_blk, n_ctx, causal: bool, window, scale: float):
        """A block drafter's attention: q [b, nh, hd] over the first n_ctx rows of k_ctx / v_ctx
        [N, nkv, hd] and the block's own k_blk / v_blk [b, nkv, hd]; GQA (query head h reads kv
        head h // (nh // nkv)). Cache index: context key j at j, block key i and query row i at
        n_ctx + i. Visible unless `causal` hides key > query or `window` (None: none) hides
        |query - key| >= window. n_ctx in the backend's position form. -> [b, nh, hd]."""
        n = int(n_ctx)
        b, nh, hd = q.shape
        nkv = k_blk.shape[1]
        first = 0 if window is None else max(0, n - window + 1)  # no block row sees further back
        keys = np.concatenate([k_ctx[first:n], k_blk])
        values = np.concatenate([v_ctx[first:n], v_blk])
        q_idx = n + np.arange(b)[:, None]
        k_idx = first + np.arange(keys.shape[0])[None, :]
        visible = np.ones((b, keys.shape[0]), dtype=bool)
        if causal:
            visible &= k_idx <= q_idx
        if window is not None:
            visible &= np.abs(q_idx - k_idx) < window
        qg = q.reshape(b, nkv, nh // nkv, hd).transpose(1, 2, 0, 3)                 # [nkv, rep, b, hd]
        scores = (qg @ keys.transpose(1, 2, 0)[:, None]) * F32(scale)             # [nkv, rep, b, n]
        probs = self.softmax(np.where(visible, scores, F32(-np.inf)))
        out = probs @ values.transpose(1, 0, 2)[:, None]                            # [nkv, rep, b, hd]
        return np.ascontiguousarray(out.transpose(2, 0, 1, 3).reshape(b, nh, hd))
