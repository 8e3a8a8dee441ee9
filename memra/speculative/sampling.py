"""Sampled decoding, exact in distribution: the filter, the draws and the rejection walk.

One filter (temperature, then top-k, then top-p, then min-p) defines the target's p, the
draft's q whenever a draft was drawn from a filtered distribution, the bonus and the
residual. Draws are exponential races over Philox uniforms on the session's `sctr`
counter; accept tests use host uniforms on `uctr`. The walk accepts draft x_j while
u * q_j(x_j) < p_j(x_j); the first rejection resamples norm(max(0, p_j - q_j)) (p_j itself
if that is empty); a full accept draws the bonus from the last row. A point-mass draft
(q = None: greedy MTP, n-gram) is the case q_j = 1 at x_j.

    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from memra.backend.philox import host_u01
from memra.backend.sampling_filter import filtered_probs as reference_filter
from memra.errors import InputError

MIN_TEMPERATURE = 1e-6  # below it logits / T overflows: use 0 for greedy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        def bad(name, why):
            raise InputError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        # numpy scalars are numbers too; bools (numpy's included) are not. Stored as plain
        # float / int, so the Philox seed arithmetic and equality never see a numpy type.
        boolean = lambda v: isinstance(v, (bool, np.bool_))  # noqa: E731
        num = lambda v: isinstance(v, numbers.Real) and not boolean(v) and math.isfinite(v)  # noqa: E731
        integer = lambda v: isinstance(v, numbers.Integral) and not boolean(v)  # noqa: E731
        if not num(self.temperature) or not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
            bad("temperature", f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
        if not integer(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 = off)")
        if not num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not num(self.min_p) or not 0 <= self.min_p < 1:
            bad("min_p", "must be in [0, 1)")
        if not integer(self.seed) or not 0 <= self.seed < 2**64:
            bad("seed", "must be an integer in [0, 2^64)")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not num(getattr(self, name)):
                bad(name, "must be a finite number")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def refuse_penalties(sp: SamplingParams | None) -> None:
    """memra has no penalty arm, greedy or sampled: a penalised request is refused, never run
    without its penalties."""
    if sp is not None and sp.penalised:
        raise InputError("repetition/presence/frequency penalties are not supported (greedy or sampled): "
                         "drop them")


def filtered_probs(logits, sp: SamplingParams) -> np.ndarray:
    """The filtered distribution of one logits row (float64 [V], zeros outside the kept set):
    memra.backend.sampling_filter.filtered_probs, the definition every backend's rows follow."""
    return reference_filter(logits, sp.temperature, sp.top_k, sp.top_p, sp.min_p)


def filtered_rows(be, logits, sp: SamplingParams):
    """filtered_probs of every row of logits [t, V], where the backend keeps them (be.filtered_rows)."""
    return be.filtered_rows(logits, sp.temperature, sp.top_k, sp.top_p, sp.min_p)


class SampleStreams:
    """A session's randomness: draws on counter `sctr` (through the backend, so CUDA draws on
    the device), accept uniforms on `uctr` (host). The counters only ever move forward."""

    def __init__(self, backend, seed: int):
        self.be, self.seed = backend, seed
        self.sctr = 0
        self.uctr = 0

    def draw(self, probs: np.ndarray) -> int:
        token = int(self.be.race_draw(probs, self.seed, self.sctr))
        self.sctr += 1
        return token

    def accept_uniform(self) -> float:
        u = host_u01(self.seed, self.uctr)
        self.uctr += 1
        return u


@dataclass
class DraftSampling:
    """What a draft source gets for sampled drafts: the request's filter and the session's
    draws (so the source's randomness is the session's, and q is what it drew from)."""

    params: SamplingParams
    streams: SampleStreams

    def filter(self, logits) -> np.ndarray:
        """The filtered row of a logits row, on the host (float64 [V]), filtered where the
        logits are: a device row crosses once, as its probabilities."""
        return self.streams.be.to_host(filtered_rows(self.streams.be, logits, self.params))

    def draw(self, probs) -> int:
        return self.streams.draw(probs)


def accept_walk(p_rows, drafts: list[int], q, streams: SampleStreams, be=None) -> tuple[int, int]:
    """Rejection walk over filtered target rows p_rows [len(drafts) + 1, V] -> (j, bonus). The rows
    stay where the backend `be` keeps them (None: on the host): the drafted ids' probabilities
    cross to the host in one copy, and a rejection's residual is formed and drawn from there."""
    vocab = p_rows.shape[1]
    to_host, upload = (np.asarray, np.asarray) if be is None else (be.to_host, be.asarray)
    px = to_host(p_rows[np.arange(len(drafts)), np.asarray(drafts, dtype=np.int64)]) if drafts else []
    for j, x in enumerate(drafts):
        qx = 1.0 if q is None else q.prob(j, x)
        if streams.accept_uniform() * qx < px[j]:
            continue
        if q is None:  # max(p - onehot(x), 0): p with its x entry zeroed (p[x] <= 1)
            residual = p_rows[j].copy()
            residual[x] = 0.0
        else:
            residual = (p_rows[j] - upload(q.full(j, vocab), np.float64)).clip(0.0, None)
        total = float(residual.sum())
        return j, streams.draw(residual / total if total > 0 else p_rows[j])
    return len(drafts), streams.draw(p_rows[len(drafts)])
