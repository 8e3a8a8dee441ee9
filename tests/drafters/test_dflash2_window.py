"""DFlash2 verify-window policies (memra/drafters/dflash2/window.py): ladder, confidence
(cumprod survival) and confidence-slot, their floors, caps and option parsing.

The E2E tape gate is blind to these (a wrong window only moves acceptance, never the output), so
each is pinned here as logic: a per-slot rule in place of survival, an off-by-one on the anchor
or a silent fallback on an unknown option value fails by name.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memra.drafters.dflash2.window import (
    CONFIDENCE,
    CONFIDENCE_SLOT,
    LADDER,
    VerifyWindow,
    WindowPolicy,
    confidence_vt,
    ladder_vt,
    resolve_window,
    slot_confidence_vt,
)
from memra.errors import InputError

B = 7  # a DSpark-class block size


def logit(p: float) -> float:
    """Pre-sigmoid score for a target probability."""
    return math.log(p / (1.0 - p))


# ---- verify-window policies ----------------------------------------------------------------------
SURVIVAL_RAWS = [logit(p) for p in (0.9, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9)]


def test_confidence_vt_is_cumprod_survival_not_per_slot_threshold():
    # survival 0.9, .72, .648, .583, .525, then .472 < 0.5: 5 drafts + the anchor
    assert confidence_vt(SURVIVAL_RAWS, 0.5, 8) == 6
    assert confidence_vt(SURVIVAL_RAWS, 0.7, 8) == 3
    assert confidence_vt(SURVIVAL_RAWS, 0.05, 8) == 8


def test_slot_arm_truncates_at_first_low_confidence_slot():
    assert slot_confidence_vt(SURVIVAL_RAWS, 0.5, 8) == 8, "every slot clears 0.5 on its own"
    assert confidence_vt(SURVIVAL_RAWS, 0.5, 8) == 6, "the two stopping statistics stay distinct"
    tail = [logit(p) for p in (0.9, 0.9, 0.3, 0.9, 0.9, 0.9, 0.9)]
    assert slot_confidence_vt(tail, 0.5, 8) == 3, "a low slot cuts the confident slots behind it"
    assert slot_confidence_vt(tail, 0.95, 8) == 2, "floor"


def test_confidence_vt_floor_and_cap():
    cold = [logit(0.1)] * 3
    assert confidence_vt(cold, 0.5, 8) == 2, "a hopeless round still verifies one draft"
    assert slot_confidence_vt(cold, 0.5, 8) == 2
    hot = [logit(0.99)] * 7
    assert confidence_vt(hot, 0.5, 5) == 5, "vt_cap binds"
    assert confidence_vt(hot, 0.5, 8) == 8
    assert slot_confidence_vt(hot, 0.5, 5) == 5
    assert confidence_vt([], 0.5, 8) == 2
    assert slot_confidence_vt([], 0.5, 8) == 2


def test_ladder_climbs_one_past_the_accepted_run_and_pins_without_adapt():
    assert [ladder_vt(m, 8) for m in range(8)] == [3, 3, 4, 5, 6, 7, 8, 8]
    assert ladder_vt(0, 2) == 2, "the cap wins over the ladder floor"
    w = VerifyWindow(WindowPolicy(LADDER), vt_cap=8)
    assert w.size() == 8, "the ladder starts at the cap"
    w.after_round(1)
    assert w.size() == 3
    w.after_round(2)
    assert w.size() == 4
    pinned = VerifyWindow(WindowPolicy(LADDER, adapt=False), vt_cap=6)
    pinned.after_round(0)
    assert pinned.size() == 6, "adapt=False pins vt at the cap"


def test_confidence_window_resizes_every_round_and_needs_scores():
    w = VerifyWindow(WindowPolicy(CONFIDENCE_SLOT, tau=0.5), vt_cap=8)
    assert w.size(SURVIVAL_RAWS) == 8
    w.after_round(0)
    assert w.size([logit(0.1)] * 7) == 2
    with pytest.raises(InputError, match="confidence scores"):
        w.size(None)


def test_ratified_default_window_is_confidence_slot_tau_half():
    assert resolve_window(None, None, None, True) == WindowPolicy(CONFIDENCE_SLOT, tau=0.5)
    assert resolve_window(None, "0.35", None, True) == WindowPolicy(CONFIDENCE_SLOT, tau=0.35)
    with pytest.raises(InputError, match="tau"):
        resolve_window(None, "nan-ish", None, True)
    assert resolve_window(None, None, None, False) == WindowPolicy(LADDER), "no head, nothing to schedule with"
    assert resolve_window(None, None, False, True) == WindowPolicy(LADDER, adapt=False), \
        "adapt=False is an explicit fixed-window request"
    assert resolve_window("ladder", None, None, True) == WindowPolicy(LADDER)
    assert resolve_window("confidence", 0.35, None, True) == WindowPolicy(CONFIDENCE, tau=0.35)
    with pytest.raises(InputError, match="contradictory"):
        resolve_window("confidence-slot", None, False, True)


def test_window_options_parse_and_refuse():
    assert resolve_window(None) == WindowPolicy(LADDER)
    assert resolve_window("") == WindowPolicy(LADDER)
    assert resolve_window("ladder", None, False) == WindowPolicy(LADDER, adapt=False)
    assert resolve_window("confidence") == WindowPolicy(CONFIDENCE, tau=0.5)
    assert resolve_window("confidence", 0.35, True) == WindowPolicy(CONFIDENCE, tau=0.35)
    assert resolve_window("confidence-slot", 0.6) == WindowPolicy(CONFIDENCE_SLOT, tau=0.6)
    for mode in (CONFIDENCE, CONFIDENCE_SLOT):
        with pytest.raises(InputError, match="contradictory"):
            resolve_window(mode, None, False)
    with pytest.raises(InputError, match="not a verify-window policy"):
        resolve_window("static")
    for bad in (0, 1, 1.5, -0.1, "nan", float("nan"), "0", "1", True, "x"):
        with pytest.raises(InputError, match=r"\(0, 1\)"):
            resolve_window("confidence", bad)
    with pytest.raises(InputError, match="adapt"):
        resolve_window("ladder", None, "0")


raws_st = st.lists(st.floats(-6, 6, allow_nan=False), max_size=10)
tau_st = st.floats(0.01, 0.99)
cap_st = st.integers(2, 12)


@settings(max_examples=200, deadline=None)
@given(raws_st, tau_st, cap_st)
def test_windows_stay_inside_floor_and_cap(raws, tau, cap):
    for size in (confidence_vt, slot_confidence_vt):
        assert 2 <= size(raws, tau, cap) <= cap


@settings(max_examples=200, deadline=None)
@given(raws_st, tau_st, cap_st)
def test_survival_keeps_no_more_than_the_per_slot_rule(raws, tau, cap):
    """Survival through slot k is at most each slot's own sigmoid, so whatever survival keeps,
    every slot in it clears tau on its own too."""
    assert confidence_vt(raws, tau, cap) <= slot_confidence_vt(raws, tau, cap)


@settings(max_examples=200, deadline=None)
@given(raws_st, tau_st, tau_st, cap_st)
def test_windows_are_monotone_non_increasing_in_tau(raws, t1, t2, cap):
    lo, hi = sorted((t1, t2))
    for size in (confidence_vt, slot_confidence_vt):
        assert size(raws, hi, cap) <= size(raws, lo, cap)


@settings(max_examples=200, deadline=None)
@given(raws_st, raws_st, tau_st)
def test_windows_are_prefix_decisions(raws, tail, tau):
    """The window reads slots in order and stops at the first failure: what lies after the stop
    cannot change it, and cutting the scores shorter keeps min(kept, length)."""
    cap = 64
    for size in (confidence_vt, slot_confidence_vt):
        vt = size(raws, tau, cap)
        if vt - 1 < len(raws):      # stopped inside the scores
            assert size(raws + tail, tau, cap) == vt
        for n in range(len(raws) + 1):
            assert size(raws[:n], tau, cap) == min(vt - 1, max(n, 1)) + 1


@settings(max_examples=200, deadline=None)
@given(raws_st, tau_st)
def test_slot_window_is_the_longest_prefix_clearing_tau(raws, tau):
    vt = slot_confidence_vt(raws, tau, 64)
    probs = [1 / (1 + math.exp(-r)) for r in raws]
    n = next((i for i, p in enumerate(probs) if p < tau), len(probs))
    assert vt == max(n, 1) + 1


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 20), cap_st)
def test_ladder_stays_inside_its_band(m, cap):
    vt = ladder_vt(m, cap)
    assert min(3, cap) <= vt <= cap
    assert vt == cap or vt == max(m + 2, 3)


@pytest.mark.parametrize("tau", ["abc", "NaN", "Infinity", -1, 1.0, True])
@pytest.mark.parametrize("window, adapt, head", [(None, None, False), (None, False, True), ("ladder", None, True)])
def test_a_bad_tau_is_refused_whatever_policy_ignores_it(tau, window, adapt, head):
    """The ladder takes no tau: a bad one is still a typo the user should hear of."""
    with pytest.raises(InputError, match="tau"):
        resolve_window(window, tau, adapt, head)
    assert resolve_window(window, 0.4, adapt, head).kind == LADDER
