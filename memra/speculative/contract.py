"""The draft-source contract: every type the core and a draft source exchange, in one import.

A *source* is loaded once per model (`load(model, options)` -> drafter); a drafter opens one
*state* per session (`begin(start)`); each round the core asks the state for a `Proposal`
(`propose(k, sampling)`) and afterwards tells it what was committed (`commit(outcome)`).
The core never looks inside: a source can only change how fast tokens come, never which.

    from memra.speculative.contract import Proposal

    class EchoSource:                       # drafts the last committed token again
        name, max_k = "echo", 14
        def load(self, model, options): return self
        def begin(self, start): return EchoState(start.anchor)

    class EchoState:
        def __init__(self, last): self.last = last
        def propose(self, k, sampling): return Proposal(tokens=[self.last] * k)
        def commit(self, outcome): self.last = outcome.bonus

The q side of a proposal is one of three kinds: `DenseQ` (per-slot distributions over the full
vocab), `SparseQ` (per-slot candidate sets) or None (a point mass at each draft).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from memra.limits import MAX_K
from memra.speculative.sampling import DraftSampling, SamplingParams

__all__ = ["Proposal", "SessionStart", "RoundOutcome", "DraftState", "Drafter", "DenseQ", "SparseQ",
           "DraftSampling", "SamplingParams", "MAX_K"]


@dataclass
class DenseQ:
    """Per-slot draft distributions over the full vocab (float64 [n, V])."""

    rows: np.ndarray

    def prob(self, j: int, token: int) -> float:
        return float(self.rows[j, token])

    def full(self, j: int, vocab: int) -> np.ndarray:
        return self.rows[j]

    def truncate(self, n: int) -> "DenseQ":
        return DenseQ(self.rows[:n])


@dataclass
class SparseQ:
    """Per-slot candidate sets: ids [n, K] with their conditional probabilities [n, K]."""

    cand: np.ndarray
    q_rows: np.ndarray

    def prob(self, j: int, token: int) -> float:
        return float(np.sum(self.q_rows[j][self.cand[j] == token]))

    def full(self, j: int, vocab: int) -> np.ndarray:
        row = np.zeros(vocab)
        np.add.at(row, np.asarray(self.cand[j], dtype=np.int64), np.asarray(self.q_rows[j], dtype=np.float64))
        return row

    def truncate(self, n: int) -> "SparseQ":
        return SparseQ(self.cand[:n], self.q_rows[:n])


@dataclass
class Proposal:
    """One round's drafts, in true-vocab ids (len <= k)."""

    tokens: list[int]
    q: DenseQ | SparseQ | None = None        # the draft distribution (sampled accept); None = point mass
    # Per-slot confidence for the p_min gate. It must be fixed BEFORE slot j's token is drawn
    # (e.g. the largest probability of the slot's distribution), never the drawn token's own
    # probability: a gate that cuts a sampled draft on its own q(x) breaks exactness.
    confidences: list[float] | None = None


@dataclass
class SessionStart:
    """What a source sees when a session opens (after the prompt is primed)."""

    model: object
    prompt: list[int]
    anchor: int                 # the first generated token: next round's verify row 0
    collapsed: object           # trunk collapsed pre-final-norm rows of the prompt [plen, D]
    taps: dict                  # layer -> contracted rows of the prompt, for the asked tap layers
    max_ctx: int


@dataclass
class RoundOutcome:
    """What one round committed, for source maintenance."""

    kept: list[int]             # trunk rows kept: [anchor, accepted drafts...] (keep = len)
    bonus: int                  # the target's token after them: the next anchor
    drafted: list[int]          # what was verified (after any truncation)
    collapsed: object           # collapsed rows of the kept verify rows [keep, D]
    taps: dict = field(default_factory=dict)  # layer -> rows of the kept verify rows


class DraftState(Protocol):
    def propose(self, k: int, sampling: DraftSampling | None) -> Proposal: ...

    def commit(self, outcome: RoundOutcome) -> None: ...


class Drafter(Protocol):
    """A source loaded for one model."""

    max_k: int                       # the most drafts per round this source can make
    tap_layers: tuple[int, ...]      # trunk layers whose contracted rows it needs

    def begin(self, start: SessionStart) -> DraftState: ...
