"""The draft of a DFlash v1 / DSpark checkpoint (no candidate selector): each harvested row on its own.

Row i's logits (plus the markov head's bias of its realized predecessor, when drafting with one)
give slot i: greedy takes the argmax (lowest id on ties); sampled draws from the request-filtered
row, and that filtered row is the slot's dense q, exactly what the sampled accept needs. The
confidence is the largest probability of the row's T = 1 softmax: fixed before the draw, a
scheduling signal like the selector's path confidence.

    walk = dense_walk(draft.logits(rows), anchor)                         # greedy
    walk = dense_walk(draft.logits(rows), anchor, sampling, markov.row_bias)
    walk.path, walk.confidences, walk.q                                   # q: DenseQ or None
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from memra.drafters.dflash2.selector import Walk, softmax, to_host
from memra.speculative.contract import DenseQ, DraftSampling


def dense_walk(logits, anchor: int, sampling: DraftSampling | None = None,
               row_bias: Callable[[int, int], np.ndarray] | None = None) -> Walk:
    """Walk the rows of `logits` [n, V]: greedy when `sampling` is None, else draws on the
    session's streams. `walk.q` is the DenseQ of the filtered rows (None when greedy)."""
    logits = to_host(logits).astype(np.float64)
    path, confidences, rows = [], [], []
    prev = int(anchor)
    for i in range(logits.shape[0]):
        row = logits[i] if row_bias is None else logits[i] + to_host(row_bias(i, prev))
        confidences.append(float(softmax(row).max()))
        if sampling is None:
            prev = int(np.argmax(row))
        else:
            q = sampling.filter(row)
            rows.append(q)
            prev = int(sampling.draw(q))
        path.append(prev)
    q = DenseQ(np.stack(rows)) if rows else None
    return Walk(path, confidences, q)
