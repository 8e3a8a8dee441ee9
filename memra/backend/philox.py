"""Philox4x32-10 (Salmon et al., Random123): the counter-based stream behind every sampled draw.

A stream is addressed by (seed, counter, tag): the session owns the counters, so randomness
never repeats across bursts, and the CUDA kernel in kernels_cu/philox.cu produces the same
words from the same address. Uniform i of a stream comes from block i // 4, word i % 4, of
philox(ctr = (i // 4, counter, tag, 0), key = (seed low, seed high)), mapped to (0, 1).

    u = uniforms(seed=7, counter=3, tag=TAG_DRAW, n=vocab)     # float64 [vocab]
"""

from __future__ import annotations

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF
TAG_DRAW = 0            # draws: draft samples, bonus, residual (counter sctr)
TAG_ACCEPT = 0xFFFFFFFE  # accept-test uniforms (counter uctr)


def philox4x32_10(ctr, key):
    """The 10-round bijection over numpy uint64 arrays (or ints) holding 32-bit words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in ctr)
    k0, k1 = (np.asarray(k, dtype=np.uint64) for k in key)
    mask = np.uint64(MASK32)
    for _ in range(10):
        p0 = np.uint64(M0) * c0
        p1 = np.uint64(M1) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0) & mask, p1 & mask, \
                         ((p0 >> np.uint64(32)) ^ c3 ^ k1) & mask, p0 & mask
        k0 = (k0 + np.uint64(W0)) & mask
        k1 = (k1 + np.uint64(W1)) & mask
    return c0, c1, c2, c3


def words(seed: int, counter: int, tag: int, n: int) -> np.ndarray:
    """n uint32 words of the stream (seed, counter, tag)."""
    blocks = np.arange((n + 3) // 4, dtype=np.uint64)
    zero = np.zeros_like(blocks)
    out = philox4x32_10(
        (blocks, zero + np.uint64(counter & MASK32), zero + np.uint64(tag & MASK32), zero),
        (np.uint64(seed & MASK32), np.uint64((seed >> 32) & MASK32)),
    )
    return np.stack(out, axis=1).reshape(-1)[:n].astype(np.uint32)


def to_unit(w: np.ndarray) -> np.ndarray:
    """32-bit words -> uniforms strictly inside (0, 1): (w + 0.5) / 2^32."""
    return (w.astype(np.float64) + 0.5) / 4294967296.0


def uniforms(seed: int, counter: int, tag: int, n: int) -> np.ndarray:
    return to_unit(words(seed, counter, tag, n))


def host_u01(seed: int, counter: int) -> float:
    """One accept-test uniform: the session's `uctr` stream."""
    return float(uniforms(seed, counter, TAG_ACCEPT, 1)[0])
