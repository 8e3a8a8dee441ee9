"""Verify-window policies: how many of a round's drafts go through the verify walk.

A block drafter pays for a whole block of drafts each round; verifying rows that will almost
surely be rejected costs verify time for nothing. A policy picks vt = 1 (the anchor) + kept
drafts, always in [2, vt_cap]: at least one draft rides every verify (the draft forward is
already paid), never more than the cap. The window only ever depends on draft-side
information, so it moves acceptance and speed, never the output.

* `ladder`: vt carried across rounds, vt = clamp(m + 2, 3, vt_cap) after a round that accepted
  m drafts (starts at vt_cap); `adapt=False` pins vt at vt_cap (the fixed-window arm).
* `confidence`: keep the leading slots while the survival prod_{j<=k} sigmoid(raw_j) >= tau.
* `confidence-slot`: keep the longest prefix whose every slot has sigmoid(raw_k) >= tau.

`raw` is the drafter's pre-sigmoid accept score per slot (a trained confidence head).

    policy = resolve_window(options.get("window"), options.get("tau"), options.get("adapt"), has_head)
    window = VerifyWindow(policy, vt_cap=8)
    n_drafts = window.size(raws) - 1        # this round
    window.after_round(accepted)            # carry the ladder
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from memra.errors import InputError

LADDER, CONFIDENCE, CONFIDENCE_SLOT = "ladder", "confidence", "confidence-slot"
WINDOWS = (LADDER, CONFIDENCE, CONFIDENCE_SLOT)
DEFAULT_TAU = 0.5


def sigmoid(x: float) -> float:
    """The logistic function, without overflow for large |x|."""
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _window(kept: int, vt_cap: int) -> int:
    return min(max(1 + kept, 2), max(vt_cap, 2))


def confidence_vt(raws: Sequence[float], tau: float, vt_cap: int) -> int:
    """Cumulative survival: keep slot k while prod_{j<=k} sigmoid(raws[j]) >= tau."""
    survival, kept = 1.0, 0
    for raw in raws:
        survival *= sigmoid(float(raw))
        if survival < tau:
            break
        kept += 1
    return _window(kept, vt_cap)


def slot_confidence_vt(raws: Sequence[float], tau: float, vt_cap: int) -> int:
    """Per slot: keep the longest prefix whose every sigmoid(raws[k]) >= tau."""
    kept = 0
    for raw in raws:
        if sigmoid(float(raw)) < tau:
            break
        kept += 1
    return _window(kept, vt_cap)


def ladder_vt(accepted: int, vt_cap: int) -> int:
    """The next round's window after a round that accepted `accepted` drafts."""
    return min(max(accepted + 2, 3), max(vt_cap, 2))


@dataclass(frozen=True)
class WindowPolicy:
    kind: str = LADDER
    tau: float = DEFAULT_TAU      # confidence policies only
    adapt: bool = True            # ladder only: False pins vt at vt_cap

    @property
    def is_confidence(self) -> bool:
        return self.kind != LADDER


def resolve_window(window=None, tau=None, adapt=None, has_confidence_head: bool = False) -> WindowPolicy:
    """Options -> policy. Unset window: `confidence-slot` at tau (default 0.5) when the checkpoint
    has a confidence head and adapt is not False, else the ladder. Unknown names, tau outside
    (0, 1), and a confidence policy together with adapt=False are refused."""
    if adapt is not None and not isinstance(adapt, bool):
        raise InputError(f"window option adapt={adapt!r} must be True or False (False pins the ladder's "
                         "verify window at its cap)")
    if tau is not None:  # checked whatever policy it ends up with (the ladder ignores it)
        tau = _parse_tau(tau)
    if window is None or window == "":
        if adapt is False or not has_confidence_head:
            return WindowPolicy(LADDER, adapt=adapt is not False)
        window = CONFIDENCE_SLOT
    if window not in WINDOWS:
        raise InputError(f"window={window!r} is not a verify-window policy: choose one of {list(WINDOWS)}")
    if window == LADDER:
        return WindowPolicy(LADDER, adapt=adapt is not False)
    if adapt is False:
        raise InputError(f"window={window!r} together with adapt=False is contradictory (a per-round "
                         "confidence window vs a pinned fixed window): drop one of them")
    return WindowPolicy(window, tau=DEFAULT_TAU if tau is None else tau)


def _parse_tau(tau) -> float:
    if isinstance(tau, bool):
        value = math.nan
    else:
        try:
            value = float(tau)
        except (TypeError, ValueError):
            value = math.nan
    if not 0.0 < value < 1.0:   # also refuses nan
        raise InputError(f"tau={tau!r}: the confidence threshold must be a number in (0, 1), e.g. 0.5")
    return value


def resolve_vt_cap(verify_t, max_k: int) -> int:
    """The `verify_t` option: the most rows a verify walk carries (the anchor + up to max_k
    drafts), default max_k + 1; outside 2..=max_k + 1 is refused (the seed clamped silently)."""
    if verify_t is None:
        return max_k + 1
    if isinstance(verify_t, bool) or not isinstance(verify_t, int) or not 2 <= verify_t <= max_k + 1:
        raise InputError(f"verify_t={verify_t!r}: the verify window's cap must be an integer in 2..={max_k + 1} "
                         f"(the anchor plus 1..={max_k} drafts this drafter makes per round)")
    return verify_t


class VerifyWindow:
    """One session's window: sizes each round and carries the ladder between rounds."""

    def __init__(self, policy: WindowPolicy, vt_cap: int):
        self.policy, self.vt_cap = policy, max(int(vt_cap), 2)
        self.vt = self.vt_cap

    def size(self, raws: Sequence[float] | None = None) -> int:
        """This round's vt (anchor + drafts to verify). Confidence policies need the raws."""
        p = self.policy
        if p.kind == LADDER:
            return self.vt
        if raws is None:
            raise InputError(f"window={p.kind!r} needs per-slot confidence scores from the drafter")
        size = confidence_vt if p.kind == CONFIDENCE else slot_confidence_vt
        self.vt = size(raws, p.tau, self.vt_cap)
        return self.vt

    def after_round(self, accepted: int) -> None:
        if self.policy.kind == LADDER and self.policy.adapt:
            self.vt = ladder_vt(accepted, self.vt_cap)
