"""The demo model's held-out loss as memra computes it: mean next-token cross-entropy (nats) over
a token excerpt, every logit row from memra's own decode-exact walks (verify_rows in chunks of
VERIFY_CAP rows, each committed whole), so the number checks the exported weights on the engine
that serves them.

    nats = heldout_nats(model, ids)       # ids: int array, scored from position 1 on
"""

from __future__ import annotations

import numpy as np

from memra.limits import VERIFY_CAP


def heldout_nats(model, ids) -> float:
    ids = [int(i) for i in ids]
    cache = model.new_cache(len(ids))
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, VERIFY_CAP):
        rows = ids[start:min(start + VERIFY_CAP, len(ids) - 1)]
        logits, _, ckpt = model.verify_rows(rows, cache)
        model.rollback(cache, ckpt, len(rows))
        z = np.asarray(logits, dtype=np.float64)
        z -= z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        nxt = ids[start + 1:start + 1 + len(rows)]
        total -= float(logp[np.arange(len(rows)), nxt].sum())
        count += len(rows)
    return total / count
