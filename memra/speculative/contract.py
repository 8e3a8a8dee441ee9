"""The draft-source contract: every type the core and a draft source exchange, in one import.

A *source* is loaded once per model (`load(model, options)` -> drafter); a drafter opens one
*state* per session (`begin(start)`); each round the core asks the state for a `Proposal`
(`propose(k, sampling)`) and afterwards tells it what was committed (`commit(outcome)`).
The core never looks inside: a source can only change how fast tokens come, never which.

    from memra.speculative.contract import Proposal

    class EchoSource:                       # drafts the last committed token again
        max_k, tap_layers = 14, ()
        def load(self, model, options): return self
        def begin(self, start): return EchoState(start.anchor)

    class EchoState:
        def __init__(self, last): self.last = last
        def propose(self, k, sampling): return Proposal(tokens=[self.last] * k)
        def commit(self, outcome): self.last = outcome.bonus

The q side of a proposal is one of three kinds: `DenseQ` (per-slot distributions over the full
vocab), `SparseQ` (per-slot candidate sets) or None (a point mass at each draft).

The core checks what a source hands it before using it (`check_drafter`, `check_state`,
`check_proposal`): a malformed declaration, state or proposal is an InputError naming the
source, never a crash or a silently wrong round. A plugin's own tests can call them too.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from memra.errors import InputError, describe
from memra.limits import MAX_K
from memra.model.tokens import check_token_ids
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


# ---- how errors name a source ------------------------------------------------------------------
_LABELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def label_source(drafter, label: str) -> None:
    """Record how refusals name `drafter` (the registry does, on load: "draft source 'ngram'
    (memra-ngram 0.1.0)"). A drafter that cannot be weakly referenced keeps its class name."""
    try:
        _LABELS[drafter] = label
    except TypeError:
        pass


def source_label(drafter) -> str:
    try:
        label = _LABELS.get(drafter)
    except TypeError:
        label = None
    return label or f"draft source {type(drafter).__qualname__}"


# ---- what the core accepts from a source --------------------------------------------------------
Q_SUM_TOL = 1e-5  # a q row is a distribution: its mass may miss 1 by float rounding, no more


def check_drafter(drafter, source: str) -> tuple[int, tuple[int, ...]]:
    """(max_k, tap_layers) as the drafter declares them, read once when a session opens (so a
    property that raises or changes later cannot break a round). max_k defaults to MAX_K."""
    def read(name, default):
        try:
            return getattr(drafter, name, default)
        except Exception as exc:
            raise InputError(f"{source}: reading {name} raised {describe(exc)}") from exc

    max_k = read("max_k", MAX_K)
    if isinstance(max_k, bool) or not isinstance(max_k, (int, np.integer)) or max_k < 1:
        raise InputError(f"{source}: max_k={max_k!r} must be an integer >= 1 (the most drafts it makes a round)")
    taps = read("tap_layers", None)
    if taps is None or isinstance(taps, (str, bytes)) or not hasattr(taps, "__iter__"):
        raise InputError(f"{source}: tap_layers={taps!r} must be a tuple of trunk layer indices (() for none)")
    taps = tuple(taps)
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in taps):
        raise InputError(f"{source}: tap_layers={taps!r} must hold integer layer indices")
    return int(max_k), tuple(int(t) for t in taps)


def check_state(state, source: str):
    """The state `begin` returned, if it has callable propose and commit."""
    missing = [name for name in ("propose", "commit") if not callable(getattr(state, name, None))]
    if missing:
        raise InputError(f"{source}: begin() returned {type(state).__name__} without {' and '.join(missing)}(): "
                         "return a state with propose(k, sampling) and commit(outcome)")
    return state


def check_proposal(prop, k: int, vocab: int, source: str) -> Proposal:
    """`prop` as the core uses it: a Proposal of at most k true-vocab ids, a q of the right kind
    and shape (rebuilt as the core's own DenseQ / SparseQ over host float64 arrays, so the accept
    walk runs no plugin code), confidences in [0, 1]; else an InputError naming `source`.

    More than k tokens is refused, not cut: the contract is len <= k, and a source that drafts
    past k has a q and confidences that may not describe the prefix the core would keep."""
    if not isinstance(prop, Proposal):
        raise InputError(f"{source} returned {_kind(prop)}, not a memra.speculative.contract.Proposal")
    try:
        tokens = check_token_ids(prop.tokens, vocab, "draft token id", allow_empty=True,
                                 fix="the draft source must draft this model's ids (was it made for another model?)")
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None
    if len(tokens) > k:
        raise InputError(f"{source} returned {len(tokens)} draft tokens for k={k}: a proposal holds at most k "
                         "(truncate the drafts to k)")
    q = _check_q(prop.q, tokens, vocab, source)
    confidences = _check_confidences(prop.confidences, len(tokens), source)
    return Proposal(tokens, q, confidences)


def _kind(x) -> str:
    return "None" if x is None else f"a {type(x).__name__}"


def _host_array(a, what: str, source: str) -> np.ndarray:
    try:
        arr = np.asarray(a)
    except Exception:
        arr = None
    if arr is None or arr.dtype == object or arr.dtype.kind not in "biuf":
        raise InputError(f"{source}: {what} must be a numeric host (numpy) array, got {_kind(a)}")
    return arr


def _check_q(q, tokens: list[int], vocab: int, source: str):
    """The q side, rebuilt as a plain DenseQ / SparseQ, or None (point masses)."""
    n = len(tokens)
    if q is None:
        return None
    if isinstance(q, DenseQ):
        rows = _host_array(q.rows, "DenseQ rows", source)
        if rows.shape != (n, vocab) or rows.dtype.kind != "f":
            raise InputError(f"{source}: DenseQ rows are {rows.dtype} {rows.shape}; want floats [{n}, {vocab}] "
                             "(one distribution over the full vocab per draft)")
        probs, picked = rows, rows[np.arange(n), tokens]
    elif isinstance(q, SparseQ):
        cand = _host_array(q.cand, "SparseQ cand", source)
        probs = _host_array(q.q_rows, "SparseQ q_rows", source)
        if cand.ndim != 2 or cand.shape[0] != n or probs.shape != cand.shape or cand.shape[1] < 1 \
                or cand.dtype.kind not in "iu" or probs.dtype.kind != "f":
            raise InputError(f"{source}: SparseQ cand {cand.dtype} {cand.shape} and q_rows {probs.dtype} "
                             f"{probs.shape}; want integer ids and float probabilities of one shape [{n}, C>=1]")
        if cand.size and (cand.min() < 0 or cand.max() >= vocab):
            raise InputError(f"{source}: SparseQ candidate ids must lie in the vocab 0..{vocab - 1}")
        picked = np.array([probs[j][cand[j] == t].sum() for j, t in enumerate(tokens)])
    else:
        raise InputError(f"{source}: q is {_kind(q)}; give a contract.DenseQ, a contract.SparseQ or None "
                         "(point masses)")
    if n and (not np.all(np.isfinite(probs)) or probs.min() < 0):
        raise InputError(f"{source}: q holds negative or non-finite probabilities")
    sums = probs.sum(axis=1)
    if n and np.max(np.abs(sums - 1.0)) > Q_SUM_TOL:
        j = int(np.argmax(np.abs(sums - 1.0)))
        raise InputError(f"{source}: q row {j} sums to {sums[j]:.6g}, not 1: q must be the distribution each "
                         "draft was drawn from")
    zero = [j for j in range(n) if not picked[j] > 0]
    if zero:
        j = zero[0]
        raise InputError(f"{source}: q gives draft {j} (token {tokens[j]}) probability 0: q must be the "
                         "distribution each draft was drawn from")
    if isinstance(q, DenseQ):
        return DenseQ(rows.astype(np.float64, copy=False))
    return SparseQ(cand.astype(np.int64, copy=False), probs.astype(np.float64, copy=False))


def _check_confidences(conf, n: int, source: str) -> list[float] | None:
    if conf is None:
        return None
    if isinstance(conf, (str, bytes)) or not hasattr(conf, "__len__"):
        raise InputError(f"{source}: confidences must be a list of {n} numbers in [0, 1], got {_kind(conf)}")
    values = list(conf)
    if len(values) != n:
        raise InputError(f"{source}: {len(values)} confidences for {n} draft tokens: give one per draft")
    for j, c in enumerate(values):
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, float, np.integer, np.floating)) \
                or not (math.isfinite(c) and 0 <= c <= 1):
            raise InputError(f"{source}: confidence {j} is {c!r}: each must be a number in [0, 1]")
    return [float(c) for c in values]
