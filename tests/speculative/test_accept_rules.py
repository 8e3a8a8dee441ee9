"""Accept rules and metrics: greedy_accept, the conf_keep p_min gate, SpecMetrics.

The seed's conf_keep unit test is the spec, verbatim; hypothesis pins the properties that follow
from its semantics (the chain breaks at the first slot strictly below p_min, except slot 0,
which survives unless pmin0). End to end, the gate may only shorten rounds, never change the tape.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from memra.generate import generate
from memra.speculative.accept import conf_keep, greedy_accept
from memra.speculative.metrics import SpecMetrics
from memra.speculative.session import GateInstruments

from .battery import (
    model_fixture,
    open_session,
    plain_tape,
    prompt_ids,
    proposal_log,
    round_log,
    run_bursts,
)

model = model_fixture("numpy")

N = 32

confidences = st.lists(st.floats(0.0, 1.0, allow_nan=False), max_size=14)
thresholds = st.floats(-0.5, 1.5, allow_nan=False)


# ---- conf_keep: the seed's unit test, verbatim ----------------------------------------------------
def test_conf_keep_matches_the_spec_rs_break_semantics():
    # Gate off: everything kept.
    assert conf_keep([0.1, 0.1], 0.0, True) == 2
    # All confident: everything kept.
    assert conf_keep([0.9, 0.8, 0.7], 0.5, False) == 3
    # Break mid-chain at the first miss; the confident tail after it never rides.
    assert conf_keep([0.9, 0.2, 0.9], 0.5, False) == 1
    assert conf_keep([0.9, 0.2, 0.9], 0.5, True) == 1
    # Slot-0 miss: survives without PMIN0, and does NOT latch: slot 1 is judged on its own...
    assert conf_keep([0.2, 0.9], 0.5, False) == 2
    # ...but a sub-threshold slot past 0 still breaks.
    assert conf_keep([0.2, 0.2], 0.5, False) == 1
    # PMIN0 arms the zero-draft round.
    assert conf_keep([0.2, 0.9], 0.5, True) == 0
    # Boundary: q == p_min is NOT below it (strict <).
    assert conf_keep([0.5, 0.5], 0.5, True) == 2
    # Empty chain: nothing to keep.
    assert conf_keep([], 0.5, True) == 0


# ---- conf_keep: properties -------------------------------------------------------------------------
@given(confidences, thresholds, st.booleans())
def test_conf_keep_is_the_prefix_up_to_the_first_real_miss(c, p_min, pmin0):
    n = conf_keep(c, p_min, pmin0)
    assert 0 <= n <= len(c)
    if p_min <= 0:
        assert n == len(c)
        return
    # every kept slot passes, except a slot-0 miss without pmin0
    assert all(c[j] >= p_min for j in range(1, n))
    if n > 0 and c[0] < p_min:
        assert not pmin0
    # a cut is a real miss: strictly below p_min, and at slot 0 only with pmin0
    if n < len(c):
        assert c[n] < p_min and (n > 0 or pmin0)


@given(confidences, thresholds, thresholds, st.booleans())
def test_conf_keep_never_grows_as_p_min_rises(c, a, b, pmin0):
    lo, hi = min(a, b), max(a, b)
    assert conf_keep(c, lo, pmin0) >= conf_keep(c, hi, pmin0)


@given(confidences, thresholds)
def test_pmin0_only_adds_the_zero_draft_round(c, p_min):
    keep0, keep = conf_keep(c, p_min, True), conf_keep(c, p_min, False)
    if c and p_min > 0 and c[0] < p_min:
        assert keep0 == 0
    else:
        assert keep0 == keep
    if c:
        assert keep >= 1  # without pmin0 a non-empty chain always drafts


@given(confidences, thresholds, st.booleans(), confidences, st.integers(0, 14))
def test_conf_keep_never_looks_past_the_cut(c, p_min, pmin0, tail, m):
    n = conf_keep(c, p_min, pmin0)
    assert conf_keep(c[:m], p_min, pmin0) == min(n, m)
    if n < len(c):  # whatever follows the cut is irrelevant
        assert conf_keep(c[:n + 1] + tail, p_min, pmin0) == n


# ---- greedy_accept: properties ---------------------------------------------------------------------
@st.composite
def drafts_and_target(draw):
    k = draw(st.integers(0, 14))
    target = draw(st.lists(st.integers(0, 3), min_size=k + 1, max_size=k + 1))
    # drafts agree with the target on a drawn prefix, then are free (small alphabet: collisions)
    agree = draw(st.integers(0, k))
    drafts = target[:agree] + draw(st.lists(st.integers(0, 3), min_size=k - agree, max_size=k - agree))
    return drafts, target


@given(drafts_and_target())
def test_greedy_accept_takes_the_longest_matching_prefix_and_the_bonus_after_it(case):
    drafts, target = case
    j, bonus = greedy_accept(drafts, target)
    assert 0 <= j <= len(drafts)
    assert drafts[:j] == target[:j]
    assert j == len(drafts) or drafts[j] != target[j]
    assert bonus == target[j] and isinstance(bonus, int)


@given(st.lists(st.integers(0, 255), min_size=1, max_size=15))
def test_greedy_accept_of_the_targets_own_tokens_accepts_everything(target):
    assert greedy_accept(target[:-1], target) == (len(target) - 1, target[-1])


def test_target_argmax_takes_the_lowest_index_on_ties(model):
    logits = np.array([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]], dtype=np.float32)
    assert np.asarray(model.be.to_host(model.be.argmax(logits))).tolist() == [1, 0]


# ---- the p_min gate end to end ---------------------------------------------------------------------
@pytest.mark.parametrize("p_min,pmin0", [(0.5, True), (0.3, False)])
def test_the_p_min_gate_shortens_rounds_and_keeps_the_tape(model, p_min, pmin0):
    k = 4
    prompt = prompt_ids(model)
    tape = plain_tape(model, prompt, N)
    session = open_session(model, prompt, instruments=GateInstruments(pmin_override=(p_min, pmin0)))
    proposals, rounds = proposal_log(session), round_log(session)
    assert run_bursts(session, N, k)[:N] == tape
    # each round verified exactly what conf_keep let through
    assert [d for d, _ in rounds] == [conf_keep(p.confidences, p_min, pmin0) for p in proposals]
    m = session.metrics
    assert m.num_draft_tokens < k * m.rounds  # the gate truncated
    if pmin0:
        assert 0 < m.num_drafts < m.rounds    # some rounds verified no draft at all
    else:
        assert m.num_drafts == m.rounds       # slot 0 always rides
    # generate's public p_min arguments are the same gate
    result = generate(model, prompt, N, draft="native-mtp", num_draft_tokens=k, p_min=p_min, pmin0=pmin0)
    assert result.tokens == tape
    assert (result.stats["num_drafts"], result.stats["num_draft_tokens"]) == (m.num_drafts, m.num_draft_tokens)


# ---- metrics ---------------------------------------------------------------------------------------
def test_metrics_count_like_vllm():
    m = SpecMetrics()
    pattern = [(4, 0), (4, 4), (0, 0), (2, 1), (4, 2)]
    for drafted, accepted in pattern:
        m.record(drafted, accepted)
    assert m.rounds == 5
    assert m.num_drafts == 4  # a zero-draft round is no draft
    assert m.num_draft_tokens == 14 and m.num_accepted_tokens == 7
    assert m.accepted_per_pos == [3, 2, 1, 1]
    assert m.mean_acceptance_length == 1 + 7 / 4
    assert SpecMetrics().mean_acceptance_length == 1.0
    d = m.as_dict()
    assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos",
            "mean_acceptance_length"} <= set(d)
    assert set(d["seconds"]) == {"draft", "verify", "accept", "roll", "maint"}
