"""Optional DSpark-class heads of a block drafter: the markov head and the confidence head.

* Markov head (semi-autoregressive chain): the block forward drafts every slot at once, so a
  row cannot see the token chosen before it. The markov head adds that back cheaply: draft row
  k's logits += w2 @ w1[prev], where prev is the realized token before slot k (the anchor for
  slot 0, then the chain). w1 and w2 are [V, rank].
* Confidence head (trained accept-rate score): raw_k = b + w . [hidden_k ; w1[prev_k]] (the
  markov embedding part only when the head was trained with it), pre-sigmoid. It feeds the
  verify-window policies (memra.drafters.dflash2.window); it never touches which tokens are drafted.

    markov = MarkovHead(draft.markov_w1, draft.markov_w2)
    walk = selector.walk(logits, hidden, anchor, row_bias=markov.row_bias)
    head = ConfidenceHead(draft.conf_w, draft.conf_b, draft.conf_with_markov)
    raws = head.raw_scores(hidden, markov.embeddings([anchor] + walk.path[:-1]))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memra.drafters.dflash2.selector import take_rows, to_host
from memra.errors import ConfigError, InputError


class MarkovHead:
    def __init__(self, w1, w2):
        if w1.ndim != 2 or w2.ndim != 2 or w1.shape != w2.shape:
            raise ConfigError(f"dflash2 markov head: w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} must both "
                              "be [vocab, rank]")
        self.w1, self.w2 = w1, w2
        self.vocab, self.rank = w1.shape

    def embedding(self, prev: int) -> np.ndarray:
        """w1[prev] (host float64 [rank])."""
        return take_rows(self.w1, int(prev))

    def embeddings(self, prevs: Sequence[int]) -> np.ndarray:
        return take_rows(self.w1, np.asarray(prevs, dtype=np.int64)).reshape(len(prevs), self.rank)

    def bias(self, prev: int) -> np.ndarray:
        """w2 @ w1[prev]: the bias the slot after `prev` adds to its logits (host float64 [V])."""
        return to_host(self.w2 @ self.w1[int(prev)]).astype(np.float64)

    def row_bias(self, row: int, prev: int) -> np.ndarray:
        """The selector walk's hook: every row is biased by its own predecessor."""
        return self.bias(prev)


class ConfidenceHead:
    def __init__(self, w, b: float, with_markov: bool):
        self.w = to_host(w).astype(np.float64).reshape(-1)
        self.b = float(b)
        self.with_markov = bool(with_markov)

    def raw_score(self, hidden, emb=None) -> float:
        """Pre-sigmoid accept score of one slot: b + w . [hidden ; emb]; `emb` = the markov w1
        row of the slot's previous token, required iff the head was trained with it."""
        x = to_host(hidden).astype(np.float64).reshape(-1)
        if self.with_markov:
            if emb is None:
                raise InputError("dflash2 confidence head was trained on [hidden ; markov embedding] and "
                                 "was scored without the embedding of the slot's previous token")
            x = np.concatenate([x, to_host(emb).astype(np.float64).reshape(-1)])
        if x.size != self.w.size:
            raise ConfigError(f"dflash2 confidence head expects {self.w.size} inputs and got {x.size} "
                              f"(hidden{' + markov rank' if self.with_markov else ''}); the head and the "
                              "drafter disagree")
        return float(self.b + self.w @ x)

    def raw_scores(self, hidden, embs=None) -> list[float]:
        hidden = to_host(hidden)
        return [self.raw_score(hidden[i], None if embs is None else embs[i]) for i in range(hidden.shape[0])]
