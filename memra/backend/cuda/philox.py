"""The sampling family of the CUDA backend (kernels_cu/philox.cu): Philox4x32-10 streams and
exponential-race draws on the device.

The host twin lives in memra/backend/philox.py; both address a stream by (seed, counter, tag)
and produce the same words, so a draw is the same token whichever backend makes it.
"""

from __future__ import annotations

import numpy as np

import cupy as cp

from memra.backend.cuda.runtime import BLOCK, launch
from memra.backend.philox import MASK32, TAG_DRAW


RACE_SPAN = 4096  # entries a race_parts block scans


def _key(seed: int):
    return np.uint32(seed & MASK32), np.uint32((seed >> 32) & MASK32)


class PhiloxOps:
    def philox_block(self, ctr, key) -> np.ndarray:
        """The raw 10-round bijection of one counter block (for known-answer tests)."""
        out = cp.empty(4, cp.uint32)
        launch("philox", "philox_block", (1,), (1,),
               (cp.asarray(ctr, dtype=cp.uint32), cp.asarray(key, dtype=cp.uint32), out))
        return cp.asnumpy(out)

    def philox_uniforms(self, seed: int, counter: int, tag: int, n: int) -> np.ndarray:
        out = cp.empty(n, cp.float64)
        k0, k1 = _key(seed)
        launch("philox", "philox_uniforms", ((n + BLOCK - 1) // BLOCK,), (BLOCK,),
               (k0, k1, np.uint32(counter & MASK32), np.uint32(tag & MASK32), np.int64(n), out))
        return cp.asnumpy(out)

    def race_draw(self, probs, seed: int, counter: int, tag: int = TAG_DRAW) -> int:
        """argmax_i p_i / E_i over the stream's exponentials: a draw from probs. Spans of
        RACE_SPAN entries race in parallel, then their winners (a 154880-token row: 38 blocks)."""
        p = cp.ascontiguousarray(cp.asarray(probs, dtype=cp.float64))
        parts = max(1, (p.size + RACE_SPAN - 1) // RACE_SPAN)
        best, arg, out = cp.empty(parts, cp.float64), cp.empty(parts, cp.int64), cp.empty(1, cp.int64)
        k0, k1 = _key(seed)
        launch("philox", "race_parts", (parts,), (BLOCK,), (p, np.int64(p.size), np.int64(RACE_SPAN), k0, k1,
                                                           np.uint32(counter & MASK32), np.uint32(tag & MASK32),
                                                           best, arg))
        launch("philox", "race_pick", (1,), (BLOCK,), (best, arg, np.int32(parts), out))
        return int(out.get()[0])
