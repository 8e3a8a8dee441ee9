"""DFlash2 drafting policies, CPU-side: harvest conventions, the strategy census, the verify-window
the confidence head's dot, the accept prefix and the candidate selector walk (the verify-window
policies are in test_dflash2_window.py).

The E2E tape gate is blind to all of these (a wrong convention or a wrong window only moves
acceptance, never the output), so each is pinned here as logic: a mutation back to the wrong
harvest, a per-slot rule in place of survival, an off-by-one on the anchor or a silent fallback
on an unknown option value fails by name.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memra.drafters.dflash2.config import dspark_strategy_census as strategy_census
from memra.drafters.dflash2.harvest import (
    Harvest,
    accept_prefix,
    harvest_from_name,
    resolve_harvest,
)
from memra.drafters.dflash2.heads import ConfidenceHead, MarkovHead
from memra.backend.numpy_ref import NumpyBackend
from memra.drafters.dflash2.selector import Selector, _top_candidates_skipping_nan, softmax, top_candidates
from memra.errors import ConfigError, InputError

B = 7  # a DSpark-class block size


def logit(p: float) -> float:
    """Pre-sigmoid score for a target probability."""
    return math.log(p / (1.0 - p))


# ---- harvest conventions -------------------------------------------------------------------------
def test_dspark_strategy_requires_shifted_harvest():
    h = Harvest.DSPARK
    assert h.first_row == 0, "DSpark trains the anchor row for anchor+1: it is draft 1"
    assert h.n_drafts(B) == B, "DSpark harvests block_size drafts; b-1 drops the best-trained slot"
    for row in range(B):
        assert h.trained_offset_of_row(row) == row + 1


def test_dflash_strategy_keeps_mask_fill_harvest():
    h = Harvest.DFLASH
    assert h.first_row == 1, "DFlash drafts start at mask row 1 (the anchor row is untrained)"
    assert h.n_drafts(B) == B - 1
    for row in range(1, B):
        assert h.trained_offset_of_row(row) == row


@pytest.mark.parametrize("h", list(Harvest))
def test_every_candidate_verifies_the_position_its_row_was_trained_for(h):
    """Draft i (1-based, verified against the target's prediction for anchor+i) is read from
    row first_row + i - 1, and that row must have been trained for offset i."""
    for i in range(1, h.n_drafts(B) + 1):
        row = h.first_row + i - 1
        assert h.trained_offset_of_row(row) == i, f"{h}: draft {i} rides row {row}"


def test_harvest_names_parse_and_unknown_values_refuse():
    assert harvest_from_name("dspark") is Harvest.DSPARK
    assert harvest_from_name("dflash") is Harvest.DFLASH
    assert harvest_from_name("mask-fill") is None
    assert resolve_harvest("dspark", False) is Harvest.DSPARK
    assert resolve_harvest("dflash", True) is Harvest.DFLASH
    for bad in ("shifted", "DSPARK", 1):
        with pytest.raises(InputError, match="harvest"):
            resolve_harvest(bad, True)


def test_ratified_default_harvest_is_strategy_keyed():
    assert resolve_harvest(None, True) is Harvest.DSPARK, "a DSpark-strategy checkpoint harvests shifted"
    assert resolve_harvest(None, False) is Harvest.DFLASH
    assert resolve_harvest("", False) is Harvest.DFLASH
    # an explicit value overrides the census in both directions
    assert resolve_harvest("dflash", True) is Harvest.DFLASH
    assert resolve_harvest("dspark", False) is Harvest.DSPARK
    with pytest.raises(InputError):
        resolve_harvest("shifted", True)


def test_strategy_census_reads_the_checkpoint_config():
    both = {"architectures": ["Qwen3DSparkModel"], "block_size": 7,
            "dflash_config": {"projector_type": "dspark", "markov_rank": 256}}
    assert strategy_census(both)
    assert strategy_census({"architectures": ["Qwen3DSparkModel"]})
    assert strategy_census({"dflash_config": {"projector_type": "dspark"}})
    assert not strategy_census({"architectures": ["Qwen3DFlashModel"], "dflash_config": {"attention_mode": "gqa"}})
    assert not strategy_census({})


def test_dspark_trained_rows_through_mask_fill_harvest_accept_nothing():
    """A drafter whose row r argmaxes to BASE + (its DSpark-trained offset), a target predicting
    BASE + j for anchor+j: the shifted harvest accepts the whole block, the mask-fill harvest
    of the same drafter accepts nothing (every slot one position late)."""
    base = 1000
    vam = [base + j for j in range(1, B + 2)]
    row_argmax = lambda r: base + Harvest.DSPARK.trained_offset_of_row(r)

    def candidates(h):
        return [base] + [row_argmax(h.first_row + i - 1) for i in range(1, h.n_drafts(B) + 1)]

    vt = Harvest.DSPARK.n_drafts(B) + 1
    assert accept_prefix(candidates(Harvest.DSPARK), vam, vt) == vt - 1
    vt_wrong = Harvest.DFLASH.n_drafts(B) + 1
    assert accept_prefix(candidates(Harvest.DFLASH), vam, vt_wrong) == 0


def test_accept_prefix_stops_at_the_first_miss_and_at_the_window():
    cand = [9, 1, 2, 3, 4]
    assert accept_prefix(cand, [1, 2, 3, 4, 5], 5) == 4
    assert accept_prefix(cand, [1, 2, 7, 4, 5], 5) == 2
    assert accept_prefix(cand, [0, 2, 3, 4, 5], 5) == 0
    assert accept_prefix(cand, [1, 2, 3, 4, 5], 3) == 2, "only vt-1 drafts are verified"
    assert accept_prefix(cand, [1, 2, 3, 4, 5], 1) == 0


# ---- confidence head -----------------------------------------------------------------------------
def test_raw_score_matches_the_dot():
    head = ConfidenceHead([0.5, -1.0, 2.0, 0.25, -0.5], 0.125, with_markov=True)
    hidden, emb = np.array([1.0, 2.0, 3.0]), np.array([4.0, 8.0])
    assert head.raw_score(hidden, emb) == 0.125 + 0.5 - 2.0 + 6.0 + 1.0 - 4.0
    plain = ConfidenceHead([0.5, -1.0, 2.0], -0.25, with_markov=False)
    assert plain.raw_score(hidden) == -0.25 + 0.5 - 2.0 + 6.0


def test_raw_score_refuses_a_missing_embedding_or_a_shape_mismatch():
    head = ConfidenceHead([0.5, -1.0, 2.0, 0.25, -0.5], 0.125, with_markov=True)
    with pytest.raises(InputError, match="embedding"):
        head.raw_score(np.ones(3))
    with pytest.raises(ConfigError, match="expects 5 inputs"):
        head.raw_score(np.ones(3), np.ones(3))


def test_markov_bias_is_w2_times_the_previous_tokens_w1_row():
    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((11, 3)), rng.standard_normal((11, 3))
    head = MarkovHead(w1, w2)
    np.testing.assert_allclose(head.bias(4), w2 @ w1[4])
    np.testing.assert_array_equal(head.embeddings([4, 0]), w1[[4, 0]])
    with pytest.raises(ConfigError, match="vocab, rank"):
        MarkovHead(w1, w2[:, :2])


# ---- candidate selector --------------------------------------------------------------------------
def test_top_candidates_sort_by_value_and_break_ties_to_the_lower_id():
    row = np.array([0.5, 2.0, 1.0, 2.0, 1.0, -3.0, 1.0])
    vals, ids = top_candidates(row, 4)
    assert ids.tolist() == [1, 3, 2, 4]
    assert vals.tolist() == [2.0, 2.0, 1.0, 1.0]
    assert top_candidates(row, 99)[1].tolist() == [1, 3, 2, 4, 6, 0, 5]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([-np.inf, -2.0, -0.0, 0.0, 1.0, 1.5, np.inf, np.nan]), min_size=1, max_size=40),
       st.integers(1, 45))
def test_top_candidates_equal_the_argpartition_reference_on_ties_infinities_and_nans(values, k):
    """The partition path against the reference it replaced (negated argpartition, then the
    entries above the k-th value and the lowest-id ties at it), ties, +-0, +-inf and NaN included."""
    row = np.asarray(values, np.float64)
    got, want = top_candidates(row, k), _top_candidates_skipping_nan(row, min(k, row.size))
    assert np.array_equal(got[1], want[1]) and np.array_equal(got[0], want[0], equal_nan=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([-np.inf, -2.0, -0.0, 0.0, 1.0, 1.5, np.inf, np.nan]), min_size=1, max_size=40),
       st.integers(1, 45))
def test_backend_top_k_is_the_first_k_of_argmaxs_order(values, k):
    """NumpyBackend.top_k (the CUDA kernels' twin) against the whole row sorted by argmax's order:
    NaN first, then larger values, ties (+-0 too) to the lower id; equal to top_candidates on a
    row without NaN, so the selector's candidates do not depend on where they were taken."""
    row = np.asarray(values, np.float32)
    k = min(k, row.size)
    vals, ids = NumpyBackend().top_k(row[None], k)
    nan = np.isnan(row)
    order = sorted(range(row.size), key=lambda i: (not nan[i], 0.0 if nan[i] else -float(row[i]), i))[:k]
    assert ids[0].tolist() == order
    assert np.array_equal(vals[0], row[order], equal_nan=True)
    if not nan.any():
        assert ids[0].tolist() == top_candidates(row.astype(np.float64), k)[1].tolist()


@pytest.mark.parametrize("coupled", [True, False])
@pytest.mark.parametrize("uniforms", [None, [0.0, 0.3, 0.999, 0.6]])
def test_walk_over_candidates_taken_up_front_is_the_walk_over_the_rows(coupled, uniforms):
    """The walk given be.top_k's candidates (no vocab row on the host, codebook rows gathered
    once) takes the same path, confidences and q as the walk that takes them row by row."""
    rng = np.random.default_rng(5)
    v, h, r, k, n, anchor = 40, 6, 3, 5, 4, 7
    sel = _selector(rng, v, h, r, k) if coupled else Selector(None, None, None, k)
    logits, hidden = rng.standard_normal((n, v)).astype(np.float32), rng.standard_normal((n, h))
    logits[1, :8] = logits[1, 0]  # ties among the candidates
    want = sel.walk(logits, hidden, anchor, uniforms, 0.8)
    got = sel.walk(logits, hidden, anchor, uniforms, 0.8, top=NumpyBackend().top_k(logits, k))
    assert got.path == want.path and got.confidences == want.confidences
    assert np.array_equal(got.q.cand, want.q.cand) and np.array_equal(got.q.q_rows, want.q.q_rows)
    with pytest.raises(InputError, match="row bias"):
        sel.walk(logits, hidden, anchor, top=NumpyBackend().top_k(logits, k), row_bias=lambda i, p: np.zeros(v))


def _selector(rng, v, h, r, k, zero=None):
    proj, pred, succ = rng.standard_normal((r, h)), rng.standard_normal((v, r)), rng.standard_normal((v, r))
    if zero == "P":
        pred[:] = 0
    elif zero == "S":
        succ[:] = 0
    return Selector(proj, pred, succ, k)


def test_greedy_walk_scores_match_the_formula():
    rng = np.random.default_rng(1)
    v, h, r, k, n, anchor = 20, 6, 3, 5, 4, 7
    sel = _selector(rng, v, h, r, k)
    logits, hidden = rng.standard_normal((n, v)), rng.standard_normal((n, h))
    walk = sel.walk(logits, hidden, anchor)
    pred = anchor
    for i in range(n):
        cand = np.lexsort((np.arange(v), -logits[i]))[:k]
        z = sel.hidden_proj @ hidden[i]
        score = np.array([logits[i, b] + sum(sel.pred[pred, q] * z[q] * sel.succ[b, q] for q in range(r))
                          for b in cand])
        j = int(np.argmax(score))
        assert walk.q.cand[i].tolist() == cand.tolist()
        assert walk.path[i] == cand[j]
        assert walk.confidences[i] == pytest.approx(softmax(score)[j])
        assert walk.q.q_rows[i].tolist() == [1.0 if b == j else 0.0 for b in range(k)], "greedy q is one-hot"
        pred = walk.path[i]


def test_path_confidence_is_the_realized_transition_not_the_lattice_max():
    """Row 1's best transition comes from a predecessor the walk did not take: the recorded
    confidence is the realized path's, and it differs from the max over predecessors."""
    _v, r = 4, 1
    proj = np.ones((r, 1))
    pred = np.array([[0.0], [0.0], [10.0], [0.0]])    # only token 2 as predecessor couples
    succ = np.array([[0.0], [0.0], [0.0], [1.0]])     # ... toward token 3
    sel = Selector(proj, pred, succ, top_k=4)
    logits = np.array([[0.0, 3.0, 2.9, 0.0], [1.0, 1.0, 0.0, 0.0]])
    walk = sel.walk(logits, np.ones((2, 1)), anchor=0)
    assert walk.path[0] == 1, "row 0 takes token 1; token 2 (the strong predecessor) is not realized"
    realized = walk.confidences[1]
    lattice_max = max(softmax(sel.scores(top_candidates(logits[1], 4)[0], top_candidates(logits[1], 4)[1],
                                         np.ones(1), p)).max() for p in top_candidates(logits[0], 4)[1])
    assert realized < lattice_max - 0.1


def test_sampled_walk_inverts_the_cdf_and_records_the_conditional_q():
    rng = np.random.default_rng(2)
    v, h, r, k, n, anchor, temp = 16, 5, 2, 4, 3, 3, 0.7
    sel = _selector(rng, v, h, r, k)
    logits, hidden = rng.standard_normal((n, v)), rng.standard_normal((n, h))
    u = [0.0, 0.999999, 0.5]
    walk = sel.walk(logits, hidden, anchor, uniforms=u, temperature=temp)
    z = sel.gate(hidden)
    pred = anchor
    for i in range(n):
        vals, cand = top_candidates(logits[i], k)
        q = softmax(sel.scores(vals, cand, z[i], pred) / temp)
        np.testing.assert_allclose(walk.q.q_rows[i], q, rtol=1e-12)
        cdf = np.cumsum(q)
        idx = min(int(np.sum(cdf < u[i])), k - 1)
        assert walk.path[i] == cand[idx]
        pred = walk.path[i]
    assert walk.path[0] == walk.q.cand[0, 0], "u = 0 picks the first candidate"
    with pytest.raises(InputError, match="uniforms"):
        sel.walk(logits, hidden, anchor, uniforms=[0.5], temperature=temp)
    with pytest.raises(InputError, match="temperature"):
        sel.walk(logits, hidden, anchor, uniforms=u, temperature=0.0)


def test_row_bias_sees_the_realized_predecessor_chain():
    rng = np.random.default_rng(3)
    sel = _selector(rng, 12, 4, 2, 3)
    seen = []

    def bias(i, prev):
        seen.append((i, prev))
        return np.zeros(12)

    walk = sel.walk(rng.standard_normal((4, 12)), rng.standard_normal((4, 4)), 5, row_bias=bias)
    assert seen == list(enumerate([5] + walk.path[:-1]))


def test_selector_refuses_a_partial_or_misshaped_head():
    with pytest.raises(ConfigError, match="come together"):
        Selector(np.ones((2, 3)), None, np.ones((5, 2)), 4)
    with pytest.raises(ConfigError, match="ranks disagree"):
        Selector(np.ones((2, 3)), np.ones((5, 3)), np.ones((5, 2)), 4)
    with pytest.raises(ConfigError, match="selector_top_k"):
        Selector(None, None, None, 0)


walk_case = st.tuples(st.integers(2, 24), st.integers(1, 6), st.integers(1, 4), st.integers(1, 4),
                      st.integers(1, 30), st.integers(0, 2**32 - 1))


@settings(max_examples=120, deadline=None)
@given(walk_case, st.sampled_from(["P", "S", None]))
def test_greedy_walk_picks_candidates_of_its_rows_and_decouples_without_codebooks(case, zero):
    v, n, h, r, k, seed = case
    rng = np.random.default_rng(seed)
    # small integer logits make ties common: the tie rule is part of the contract
    logits = rng.integers(-3, 4, (n, v)).astype(np.float64)
    hidden = rng.standard_normal((n, h))
    anchor = int(rng.integers(0, v))
    walk = _selector(rng, v, h, r, k, zero).walk(logits, hidden, anchor)
    assert all(walk.path[i] in walk.q.cand[i] for i in range(n))
    assert all(0 < c <= 1 for c in walk.confidences)
    if zero is not None:
        assert walk.path == [int(np.argmax(row)) for row in logits], "no coupling: the per-row argmax"
    plain = Selector(None, None, None, k).walk(logits, hidden, anchor)
    assert plain.path == [int(np.argmax(row)) for row in logits]
