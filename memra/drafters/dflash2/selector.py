"""The DFlash2 candidate selector: a chain over each row's top-K draft candidates.

Each harvested row i proposes its top-K tokens (unary scores u_i, ids cand_i). A low-rank
transition term couples consecutive slots, gated by the row's own hidden state:

    z_i          = h_i @ hidden_proj^T                                   [r]
    score_i(a,b) = u_i[b] + sum_r P[a, r] * z_i[r] * S[cand_i[b], r]     P = predecessor codebook
                                                                          S = successor codebook
The walk is sequential: pred_0 = the anchor, pred_i = path_{i-1}. Greedy picks the argmax
(lowest candidate index on ties); sampled picks by inverse CDF over q_i = softmax(score_i / T)
with given uniforms (idx = #{cdf < u}, clamped to K-1) and records the conditional q rows the
sampled accept needs. The path confidence of a slot is softmax(score_i(pred_i, .))[chosen] at
T = 1: the drafter's probability of the realized path (a scheduling signal, never the output).

`row_bias(i, pred)` lets a semi-autoregressive head (the markov head) add a bias to row i's
logits once its predecessor is known, before the candidates are taken.

    sel = Selector(hidden_proj, pred_codebook, succ_codebook, top_k=16)
    walk = sel.walk(logits, hidden, anchor)                       # greedy
    walk = sel.walk(logits, hidden, anchor, uniforms=u, temperature=0.7)
    walk = sel.walk(logits, hidden, anchor, top=be.top_k(logits, sel.top_k))  # candidates on the device
    walk.path, walk.confidences, walk.q                           # q: SparseQ(cand, q_rows)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from memra.backend.ranking import largest
from memra.errors import ConfigError, InputError
from memra.speculative.contract import SparseQ


def to_host(a) -> np.ndarray:
    """A host float/int ndarray from a numpy or cupy array."""
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) and not isinstance(a, np.ndarray) else a)


def take_rows(table, ids) -> np.ndarray:
    """Host float64 rows `table[ids]` of a numpy or cupy table (gathered where the table lives)."""
    if not isinstance(table, np.ndarray):
        import cupy

        ids = cupy.asarray(ids)
    return to_host(table[ids]).astype(np.float64)


def top_candidates(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, ids) of the k largest entries, sorted by value descending, ties to the lower id,
    from one partition (backend.ranking.largest: a sort is the draft round's largest host cost per row
    on a 154880-token vocabulary). A row with a NaN takes the path this one replaced (the test
    holds both to the same answers), whose NaN handling stays as it was."""
    row = np.asarray(row)
    k = min(int(k), row.size)
    if np.isnan(row.max()):
        return _top_candidates_skipping_nan(row, k)
    ids = largest(row, k)
    return row[ids], ids


def _top_candidates_skipping_nan(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    part = np.argpartition(-row, k - 1)[:k] if k < row.size else np.arange(row.size)
    kth = row[part].min()
    above = np.flatnonzero(row > kth)
    ties = np.flatnonzero(row == kth)[: k - above.size]
    ids = np.concatenate([above, ties])
    ids = ids[np.lexsort((ids, -row[ids]))]
    return row[ids], ids


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max())
    return z / z.sum()


@dataclass
class Walk:
    path: list[int]            # chosen token ids, one per walked row
    confidences: list[float]   # max softmax(score_i(pred_i, .)) at T = 1: the chosen one's when greedy
    q: SparseQ                 # candidates [n, K] and the q row each pick was drawn from [n, K]


class Selector:
    """Top-K candidates per row, chained by the codebook transition term. With no codebooks
    (`hidden_proj=None`) the walk is the per-row argmax over the same candidates."""

    def __init__(self, hidden_proj, pred_codebook, succ_codebook, top_k: int):
        parts = (hidden_proj, pred_codebook, succ_codebook)
        if any(p is None for p in parts) and not all(p is None for p in parts):
            raise ConfigError("dflash2 candidate selector: hidden_projection, predecessor_codebook and "
                              "successor_codebook come together; this checkpoint has only some of them")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise ConfigError(f"dflash2 selector_top_k={top_k!r} must be a positive integer")
        self.top_k = int(top_k)
        self.hidden_proj, self.pred, self.succ = parts
        if hidden_proj is not None:
            r = hidden_proj.shape[0]
            if pred_codebook.shape[1] != r or succ_codebook.shape[1] != r:
                raise ConfigError(
                    f"dflash2 candidate selector ranks disagree: hidden_projection {tuple(hidden_proj.shape)}, "
                    f"predecessor {tuple(pred_codebook.shape)}, successor {tuple(succ_codebook.shape)}; "
                    "the codebooks must be [V, r] with r = hidden_projection rows"
                )

    @property
    def coupled(self) -> bool:
        return self.hidden_proj is not None

    def gate(self, hidden) -> np.ndarray | None:
        """z = h @ hidden_proj^T [n, r] (host float64), None without codebooks."""
        if not self.coupled:
            return None
        return to_host(hidden @ self.hidden_proj.T).astype(np.float64)

    def scores(self, u: np.ndarray, cand: np.ndarray, z_row, pred: int) -> np.ndarray:
        """score(pred, .) over one row's candidates [K]."""
        if z_row is None:
            return u
        return _coupled(u, take_rows(self.succ, cand), z_row, take_rows(self.pred, int(pred)))

    def walk(self, logits, hidden, anchor: int, uniforms: Sequence[float] | None = None,
             temperature: float = 1.0, row_bias: Callable[[int, int], np.ndarray] | None = None,
             top=None) -> Walk:
        """Walk the rows of `logits` [n, V] (draft logits of the harvested rows `hidden` [n, H]).
        Greedy when `uniforms` is None, else one uniform in [0, 1) per row. `top`: the rows'
        candidates (values, ids) [n, K] already taken where the logits live (be.top_k: the
        order of top_candidates on a row without NaN), so the vocab-long rows never come to the
        host and the codebook rows of every candidate come over in one gather each; not with
        `row_bias`, which moves a row's candidates with its predecessor."""
        n, vocab = logits.shape
        if uniforms is not None:
            if len(uniforms) < n:
                raise InputError(f"selector walk: {len(uniforms)} uniforms for {n} rows; give one per row")
            if not temperature > 0:
                raise InputError(f"selector walk: sampled temperature {temperature!r} must be > 0 "
                                 "(temperature 0 is the greedy walk: pass uniforms=None)")
        if top is not None and row_bias is not None:
            raise InputError("selector walk: candidates taken before the walk cannot follow a row bias")
        z = self.gate(hidden)
        k = min(self.top_k, vocab)
        if top is None:
            logits = to_host(logits).astype(np.float64)
            values, cand = None, np.zeros((n, k), dtype=np.int64)
        else:
            values, cand = to_host(top[0]).astype(np.float64), to_host(top[1]).astype(np.int64)
            if z is not None:
                p_rows, s_rows = self._codebook_rows([int(anchor)] + cand[:-1].ravel().tolist(), cand)
        q_rows = np.zeros((n, k), dtype=np.float64)
        path, confidences = [], []
        pred = int(anchor)
        for i in range(n):
            if values is None:
                row = logits[i] if row_bias is None else logits[i] + to_host(row_bias(i, pred))
                u, cand[i] = top_candidates(row, k)
                score = self.scores(u, cand[i], None if z is None else z[i], pred)
            else:
                score = values[i] if z is None else _coupled(values[i], s_rows[i], z[i], p_rows[pred])
            if uniforms is None:
                idx = int(np.argmax(score))
                q_rows[i, idx] = 1.0
            else:
                q_rows[i] = softmax(score / temperature)
                idx = min(int(np.count_nonzero(np.cumsum(q_rows[i]) < uniforms[i])), k - 1)
            confidences.append(float(softmax(score).max()))  # before the draw: see Proposal.confidences
            pred = int(cand[i, idx])
            path.append(pred)
        return Walk(path, confidences, SparseQ(cand, q_rows))

    def _codebook_rows(self, preds: list[int], cand: np.ndarray):
        """({pred id: its predecessor-codebook row}, successor rows [n, K, r]) for every possible
        predecessor and every candidate: two gathers where the codebooks live."""
        ids = sorted(set(preds))
        p = dict(zip(ids, take_rows(self.pred, np.asarray(ids, dtype=np.int64))))
        return p, take_rows(self.succ, cand.ravel()).reshape(*cand.shape, -1)


def _coupled(u: np.ndarray, s: np.ndarray, z_row, p: np.ndarray) -> np.ndarray:
    """u + S[cand] (P[pred] * z): the candidates' unary scores plus the transition term."""
    return u + s @ (p * z_row)
