"""Accept rules: which drafts the target agrees with, and the draft confidence gate."""

from __future__ import annotations

from collections.abc import Sequence


def greedy_accept(drafts: Sequence[int], target: Sequence[int]) -> tuple[int, int]:
    """(j, bonus): j = length of the longest prefix of drafts equal to the target's argmax
    tokens (target[r] = argmax of verify row r, lowest index on ties); bonus = target[j]."""
    j = 0
    while j < len(drafts) and drafts[j] == target[j]:
        j += 1
    return j, int(target[j])


def conf_keep(confidences: Sequence[float], p_min: float, pmin0: bool) -> int:
    """How many drafts survive the p_min gate: the chain breaks at the first slot whose
    confidence is strictly below p_min — except slot 0, which survives unless pmin0."""
    if p_min <= 0:
        return len(confidences)
    for j, p in enumerate(confidences):
        if p < p_min and (j > 0 or pmin0):
            return j
    return len(confidences)
