"""The sampling filter's definition (temperature, then top-k, then top-p, then min-p) on one
logits row, on the host in float64: the reference that every backend's filtered rows follow
(NumpyFilterOps here; the CUDA twin in backend/cuda/sampling.py). memra.speculative.sampling
reads it with a request's SamplingParams.

    p = filtered_probs(logits_row, temperature=0.8, top_k=0, top_p=0.95, min_p=0.0)  # float64 [V]
"""

from __future__ import annotations

import numpy as np

from memra.backend.ranking import largest


def filtered_probs(logits, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The filtered distribution of one logits row (float64 [V], zeros outside the kept set).

    Defined by the whole row sorted by descending value, ascending index on ties (the top-k are
    its first k, the top-p nucleus its shortest prefix holding top_p of the kept mass), and equal
    to that bit for bit (tests/speculative/test_sampling_filter.py), without the sort where it can be
    avoided: it costs ~20 ms a row at a 154880-token vocabulary. top-k takes the k largest from
    one partition; top-p alone sorts the probabilities only (the cumulative sums need the values
    in order, not which token holds each) and resolves the boundary's ties by value, then index.
    A row with a NaN takes the sorting path."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    if np.isnan(z).any():
        return filtered_by_sort(z, top_k, top_p, min_p)
    ranked = largest(z, top_k) if 0 < top_k < z.size else None
    p = np.exp(z - z.max()) if ranked is None else np.where(_marked(z.size, ranked), np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        if ranked is not None:
            keep = _marked(z.size, ranked[:_nucleus(np.cumsum(p[ranked]), top_p)])
        else:
            values = np.sort(p)[::-1]
            cut = _nucleus(np.cumsum(values), top_p)
            edge = values[cut - 1]
            keep = p > edge
            ties = np.flatnonzero(p == edge)
            ties = ties[np.lexsort((ties, -z[ties]))]  # the sorted row's order among equal probabilities
            keep[ties[:cut - int(keep.sum())]] = True
        p = _renormalised(p, keep)
    return _min_p(p, min_p)


def filtered_by_sort(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """filtered_probs by its definition, sorting the whole (temperature-scaled) row z."""
    order = np.lexsort((np.arange(z.size), -z))  # descending value, ascending index on ties
    ranked = order[:top_k] if top_k else order
    p = np.where(_marked(z.size, ranked), np.exp(z - z[order[0]]), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        p = _renormalised(p, _marked(z.size, ranked[:_nucleus(np.cumsum(p[ranked]), top_p)]))
    return _min_p(p, min_p)


def _marked(size: int, ids) -> np.ndarray:
    keep = np.zeros(size, dtype=bool)
    keep[ids] = True
    return keep


def _nucleus(cum: np.ndarray, top_p: float) -> int:
    """The shortest prefix whose mass (cumulative sums in order) reaches top_p of the total."""
    return int(np.searchsorted(cum, top_p * cum[-1])) + 1


def _renormalised(p: np.ndarray, keep: np.ndarray) -> np.ndarray:
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def _min_p(p: np.ndarray, min_p: float) -> np.ndarray:
    """The min-p cut (relative to the largest probability), renormalised; p itself when off."""
    return _renormalised(p, p >= min_p * p.max()) if min_p > 0.0 else p


class NumpyFilterOps:
    def filtered_rows(self, logits, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
        """filtered_probs of every row of logits [..., V] -> float64 [..., V] (a mixin of
        NumpyBackend; the CUDA backend filters on the device and keeps the rows there)."""
        rows = np.asarray(logits)
        flat = rows.reshape(-1, rows.shape[-1])
        out = np.stack([filtered_probs(r, temperature, top_k, top_p, min_p) for r in flat]) if flat.shape[0] \
            else np.zeros(flat.shape)
        return out.reshape(rows.shape)
