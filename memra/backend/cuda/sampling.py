"""The sampling filter on the device: NumpyFilterOps.filtered_rows (backend/sampling_filter.py)
over [t, V] logits without a vocabulary-long row leaving the GPU.

The same steps in float64: temperature, the top-k (be.top_k for a small k, a stable sort
otherwise: both give the definition's order, larger first and ties to the lower index), the
top-p nucleus over the kept probabilities in that order, min-p, each followed by a
renormalisation. exp and the sums round on the device, so a row can differ from the host's in
its last bits (a sampled session is exact in distribution, not byte-identical across backends).
Two rows go to the host definition instead: a row with a NaN, and a row whose top-p boundary
ties probabilities of different logits (the device orders such ties by index only); one flag
copy per call says which.
"""

from __future__ import annotations

import numpy as np

import cupy as cp

from memra.backend.sampling_filter import filtered_probs

TOP_K_KERNEL_MAX = 64  # be.top_k makes a pass per pick: a larger k sorts the rows instead
SPLIT = 64  # pieces a long row's reductions take first (_per_row)


class FilterOps:
    def filtered_rows(self, logits, temperature: float, top_k: int, top_p: float, min_p: float):
        """NumpyFilterOps.filtered_rows on the device -> float64 [..., V] cupy (host logits are
        uploaded once)."""
        x = cp.asarray(logits)
        shape = x.shape
        x = cp.ascontiguousarray(x.reshape(-1, shape[-1]))
        if x.shape[0] == 0:
            return cp.zeros(shape, cp.float64)
        z = x.astype(cp.float64) / temperature
        t, v = z.shape
        top = _per_row(cp.max, z)
        host = cp.isnan(top[:, 0])  # the row max is NaN where the row has one
        ranked = None
        if 0 < top_k < v:  # the kernel ranks float32 rows; 0 - z makes -0.0 and +0.0 one key for the sort
            kernel = top_k <= TOP_K_KERNEL_MAX and x.dtype == cp.float32
            ranked = self.top_k(x, top_k)[1] if kernel else cp.argsort(0.0 - z, axis=1)[:, :top_k]
        p = cp.exp(z - top)
        if ranked is not None:
            p = cp.where(_marked(t, v, ranked), p, 0.0)
        p /= _per_row(cp.sum, p)
        if top_p < 1.0:
            if ranked is not None:
                cut = _nucleus(cp.cumsum(cp.take_along_axis(p, ranked, axis=1), axis=1), top_p)
                keep = _marked(t, v, ranked, cp.arange(top_k)[None, :] < cut)
            else:
                values = -(cp.sort(-p[0])[None] if t == 1 else cp.sort(-p, axis=1))  # one row: a radix sort
                cut = _nucleus(cp.cumsum(values, axis=1), top_p)
                edge = cp.take_along_axis(values, cut - 1, axis=1)
                keep, ties = p > edge, p == edge
                keep |= ties & (cp.cumsum(ties, axis=1) <= cut - _per_row(cp.sum, keep))
                tied_max = _per_row(cp.max, cp.where(ties, z, -cp.inf))
                host |= (tied_max != _per_row(cp.min, cp.where(ties, z, cp.inf)))[:, 0]
            p = _renormalised(p, keep)
        if min_p > 0.0:
            p = _renormalised(p, p >= min_p * _per_row(cp.max, p))
        for r in np.flatnonzero(cp.asnumpy(host)):
            p[r] = cp.asarray(filtered_probs(cp.asnumpy(x[r]), temperature, top_k, top_p, min_p))
        return p.reshape(shape)


def _marked(t: int, v: int, ids, values=True):
    keep = cp.zeros((t, v), dtype=bool)
    keep[cp.arange(t)[:, None], ids] = values
    return keep


def _per_row(reduce, x):
    """reduce over each row of x [t, V] -> [t, 1]. A reduction gives a row one block, so a few
    long rows reduce in two steps where V splits evenly: SPLIT pieces a row, then the pieces."""
    t, v = x.shape
    if v % SPLIT or v < 4 * SPLIT:
        return reduce(x, axis=1, keepdims=True)
    return reduce(reduce(x.reshape(t, SPLIT, v // SPLIT), axis=2), axis=1, keepdims=True)


def _nucleus(cum, top_p: float):
    """[t, 1]: per row, the shortest prefix whose mass reaches top_p of the row's total."""
    return _per_row(cp.sum, cum < top_p * cum[:, -1:]) + 1


def _renormalised(p, keep):
    p = cp.where(keep, p, 0.0)
    return p / _per_row(cp.sum, p)
