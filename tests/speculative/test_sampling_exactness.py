"""Sampled speculative decoding is exact in distribution: Philox, race draws and the accept walk.

The promise: whatever the draft proposes (a point mass, a dense q, a sparse candidate q; near p,
far from p, or with mass where p is zero), the tokens the rejection walk commits follow the
target's filtered rows exactly. Pinned here by
* chi-square goodness of fit of race_draw and of the walk's first committed token against p_0,
  and of its second committed token against p_1(. | first) when both come from the walk;
* exact semantics (hypothesis): slot j is accepted iff u_j * q_j(x_j) < p_j(x_j), the residual
  is norm(max(0, p_j - q_j)), a zero-probability token is never emitted, j <= drafts, counters.

Statistical design (every chi-square or binomial test at ALPHA = 1e-4, at most three per test
function, so a correct implementation fails a test with probability < 1e-3; seeds are fixed):
the tail comes from an exact regularised incomplete gamma (`chi2_sf`, checked against known
values and the Wilson-Hilferty approximation). A distribution error of total variation delta
gives the statistic a noncentral chi-square with lambda = N * sum(d_i^2 / p_i) >= 4 N delta^2
(Cauchy-Schwarz, worst case: the error spread in proportion to p). With N = 30000 walks,
delta = 0.02 gives lambda >= 48; with df = 5 (six support tokens) the critical value is 25.74
and the power is >= 0.97 (`test_the_design_detects_a_two_percent_tv_error` computes it).
The second-token test sees the N * P(j >= 1) = 3000..30000 walks that reach slot 1, pooled over
the first token (df 4..27, critical 23.5..63.2): power >= 0.99 at TV 0.1 per row, ~0.7 at 0.05.
The Philox streams of all N seeds are computed at once (`StreamTable`, vectorised over the key,
checked equal to memra's per-call stream), so each walk costs tens of microseconds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memra.backend.numpy_ref import NumpyBackend
from memra.backend.philox import TAG_ACCEPT, TAG_DRAW, host_u01, uniforms
from memra.speculative.contract import DenseQ, SparseQ
from memra.speculative.sampling import SampleStreams, accept_walk

from .stats import (
    ALPHA,
    ReplayStreams,
    StreamTable,
    V,
    assert_fits,
    chi2_critical,
    chi2_power,
    chi2_sf,
    grouped_fit,
    replay,
    wilson_hilferty,
)

N_WALKS = 30_000



def test_stream_table_is_memras_stream():
    seeds = [0, 1, 2**40 + 3, 2**64 - 1]
    table = StreamTable(seeds, 3, TAG_DRAW, 11)
    for s in seeds:
        for c in range(3):
            assert np.array_equal(table.get(s, c), uniforms(s, c, TAG_DRAW, 11))
    accepts = StreamTable(seeds, 2, TAG_ACCEPT, 1)
    assert all(accepts.get(s, c)[0] == host_u01(s, c) for s in seeds for c in range(2))


def test_replayed_walks_equal_real_walks():
    rng = np.random.default_rng(3)
    seeds = list(range(500, 800))
    backend, accepts = replay(seeds, 4, 3)
    for seed in seeds:
        p_rows = rng.dirichlet(np.ones(V), 4)
        q = DenseQ(rng.dirichlet(np.ones(V), 3))
        drafts = rng.integers(0, V, 3).tolist()
        real = SampleStreams(NumpyBackend(), seed)
        fake = ReplayStreams(backend, seed, accepts)
        assert fake.draw(p_rows[0]) == real.draw(p_rows[0])
        assert accept_walk(p_rows, drafts, q, fake) == accept_walk(p_rows, drafts, q, real)
        assert (fake.sctr, fake.uctr) == (real.sctr, real.uctr)


# ---- the chi-square machinery ------------------------------------------------------------------------
def test_chi2_tail_matches_known_values():
    assert chi2_sf(18.420680743952367, 2) == pytest.approx(1e-4, rel=1e-9)   # df 2: exp(-x/2)
    assert chi2_sf(15.136705226623606, 1) == pytest.approx(1e-4, rel=1e-6)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(11.070497693516351, 5) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(124.34211340400407, 100) == pytest.approx(0.05, rel=1e-8)
    for df in (1, 2, 3, 5, 7, 20, 60):   # Wilson-Hilferty (z(1e-4) = 3.7190): close, and conservative
        exact, approx = chi2_critical(df), wilson_hilferty(df, 3.719016485455709)
        assert exact <= approx <= exact * (1.075 if df < 3 else 1.035)


def test_the_design_detects_a_two_percent_tv_error():
    lam = 4 * N_WALKS * 0.02**2                    # the worst-case noncentrality at TV 0.02
    assert chi2_critical(5) == pytest.approx(25.745, abs=1e-2)
    assert chi2_power(5, lam) > 0.95
    assert chi2_power(1, 0.0) == pytest.approx(ALPHA, rel=1e-3)   # lambda 0: the false-alarm rate


# ---- race_draw: a draw from probs -------------------------------------------------------------------
def test_race_draw_follows_probs_and_never_picks_a_zero():
    # the real NumpyBackend.race_draw, one Philox call per draw (N_WALKS draws, df 5: as above)
    p = np.array([0.35, 0.0, 0.25, 0.2, 0.0, 0.1, 0.07, 0.03])
    be = NumpyBackend()
    draws = [be.race_draw(p, seed=s, counter=s % 7) for s in range(N_WALKS)]
    assert_fits(np.bincount(draws, minlength=p.size), p, "race_draw")


# ---- the walk's cases ---------------------------------------------------------------------------------
def _filtered_rows(rng, n: int) -> np.ndarray:
    """n target rows over V tokens, each with two zeros (tokens the filter removed)."""
    rows = rng.dirichlet(np.full(V, 0.8), n)
    for row in rows:
        row[rng.choice(V, 2, replace=False)] = 0.0
        row /= row.sum()
    return rows


def _relate(p: np.ndarray, relation: str) -> np.ndarray:
    """A draft row in a given relation to target row p."""
    if relation == "equal":
        return p.copy()
    far = np.where(p > 0, 1.0 / np.maximum(p, 1e-12) ** 1.5, 0.0)   # heavy where p is light
    far /= far.sum()
    if relation == "far":
        return far
    outside = (p == 0) / np.sum(p == 0)                              # "outside": 60% where p = 0
    return 0.4 * far + 0.6 * outside


RNG = np.random.default_rng(2024)
P0 = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04, 0.0, 0.0])       # the first target row
PT = _filtered_rows(RNG, V)                                         # row after token t: PT[t]
SPARSE_K = 4


class Case:
    """A walk scenario: target rows P0, PT[prev]; drafts from q (point / dense / sparse)."""

    def __init__(self, kind: str, relation: str, k: int, told=None):
        self.kind, self.relation, self.k = kind, relation, k
        self.told = told or (lambda q: q)   # red arms: the q the walk is told (dense drafts)
        self.q0 = _relate(P0, relation) if kind != "point" else None
        self.qt = np.stack([_relate(row, relation) for row in PT]) if kind != "point" else None
        if kind == "sparse":   # a candidate set: the top-K ids, q renormalised over them
            self.sparse0 = self._candidates(self.q0)
            self.sparse_t = [self._candidates(row) for row in self.qt]

    def q_slot0(self) -> np.ndarray:
        if self.kind == "dense":
            return self.q0
        ids, qs = self.sparse0
        row = np.zeros(V)
        row[ids] = qs
        return row

    @staticmethod
    def _candidates(q):
        ids = np.argsort(-q, kind="stable")[:SPARSE_K]
        return ids, q[ids] / q[ids].sum()

    def point_draft(self, slot: int, prev: int | None) -> int:
        row = P0 if prev is None else PT[prev]
        if self.relation == "likely":
            return int(np.argmax(row))
        if self.relation == "unlikely":
            return int(np.argmin(np.where(row > 0, row, 2.0)))
        # "mixed": a likely first draft, then a token the target filtered out
        return int(np.argmax(row)) if slot == 0 else int(np.flatnonzero(row == 0)[0])

    def run(self, streams) -> tuple[int, list[int]]:
        """Draft k tokens on the streams, verify rows, walk: (j, committed tokens)."""
        drafts, dense, cand, sparse = [], [], [], []
        prev = None
        for slot in range(self.k):
            if self.kind == "point":
                x = self.point_draft(slot, prev)
            else:
                q = self.q0 if prev is None else self.qt[prev]
                if self.kind == "dense":
                    x = streams.draw(q)
                    dense.append(self.told(q))
                else:   # drawn by candidate index, as a DFlash2-style selector does
                    ids, qs = self.sparse0 if prev is None else self.sparse_t[prev]
                    x = int(ids[streams.draw(qs)])
                    cand.append(ids)
                    sparse.append(qs)
            drafts.append(x)
            prev = x
        q = None if self.kind == "point" else DenseQ(np.stack(dense)) if self.kind == "dense" \
            else SparseQ(np.stack(cand), np.stack(sparse))
        p_rows = np.stack([P0] + [PT[x] for x in drafts])
        j, bonus = accept_walk(p_rows, drafts, q, streams)
        return j, drafts[:j] + [bonus]


CASES = [
    Case("point", "likely", 3), Case("point", "unlikely", 1), Case("point", "mixed", 2),
    Case("dense", "far", 1), Case("dense", "outside", 2), Case("dense", "equal", 3),
    Case("sparse", "far", 2), Case("sparse", "outside", 3), Case("sparse", "equal", 1),
]


def _walks(case: Case, n: int, base: int):
    seeds = list(range(base, base + n))
    backend, accepts = replay(seeds, case.k + 1, case.k)
    return [case.run(ReplayStreams(backend, s, accepts)) for s in seeds]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.kind}-{c.relation}-k{c.k}")
def test_walk_commits_tokens_that_follow_the_target(case):
    out = _walks(case, N_WALKS, base=1_000_003 * (CASES.index(case) + 1))
    first = np.bincount([tokens[0] for _, tokens in out], minlength=V)
    assert_fits(first, P0, f"first committed token, {case.kind}/{case.relation}/k={case.k}")
    # slot 0 is accepted with probability sum(min(p_0, q_0)) (p_0(x_0) for a point mass):
    # two-sided binomial z-test at 1e-4 (|z| < 3.89)
    want = P0[case.point_draft(0, None)] if case.kind == "point" else np.minimum(P0, case.q_slot0()).sum()
    got = np.mean([j >= 1 for j, _ in out])
    assert abs(got - want) <= 3.89 * math.sqrt(want * (1 - want) / len(out)) + 1e-12, (got, want)
    if case.k >= 2:
        # the second token when it also comes from this walk (draft 0 accepted): ~ PT[first]
        groups: dict = {}
        for j, tokens in out:
            if j >= 1:
                groups.setdefault(tokens[0], np.zeros(V, np.int64))[tokens[1]] += 1
        assert sum(int(c.sum()) for c in groups.values()) > 1000, "too few walks reach slot 1"
        grouped_fit(groups, lambda t: PT[t], f"second token | first, {case.kind}/{case.relation}/k={case.k}")


def test_red_arm_a_walk_told_the_unfiltered_q_is_caught():
    # drafts drawn from the filtered q, the walk told 0.8 q + 0.2 uniform (the draft row before
    # its filter, the vllm#40149 class): TV 0.021 from p_0, lambda ~ 82, so the same test bites
    case = Case("dense", "outside", 2, told=lambda q: 0.8 * q + 0.2 / V)
    out = _walks(case, N_WALKS, base=77)
    with pytest.raises(AssertionError, match="chi2"):   # green arm: [dense-outside-k2] above
        assert_fits(np.bincount([tokens[0] for _, tokens in out], minlength=V), P0, "red arm")


# ---- exact semantics (hypothesis) ---------------------------------------------------------------------
class ScriptedStreams:
    """Accept uniforms from a script; draws recorded (and answered with the first kept token)."""

    def __init__(self, us):
        self.us, self.uctr, self.sctr, self.drawn = list(us), 0, 0, []

    def accept_uniform(self) -> float:
        self.uctr += 1
        return self.us[self.uctr - 1]

    def draw(self, probs) -> int:
        self.drawn.append(np.array(probs))
        self.sctr += 1
        return int(np.flatnonzero(np.asarray(probs) > 0)[0])


@st.composite
def walk_inputs(draw, max_k: int = 3):
    vocab = draw(st.integers(2, 8))
    k = draw(st.integers(0, max_k))
    cell = st.one_of(st.just(0.0), st.floats(1e-3, 1.0))

    def row():
        r = np.array(draw(st.lists(cell, min_size=vocab, max_size=vocab)))
        if r.sum() == 0:
            r[draw(st.integers(0, vocab - 1))] = 1.0
        return r / r.sum()

    p_rows = np.stack([row() for _ in range(k + 1)])
    drafts = draw(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k))
    kind = draw(st.sampled_from(["point", "dense", "sparse"]))
    if kind == "point" or k == 0:
        q = None
    elif kind == "dense":
        q = DenseQ(np.stack([row() for _ in range(k)]).reshape(k, vocab))
    else:
        width = draw(st.integers(1, vocab))
        cand = np.stack([np.random.default_rng(draw(st.integers(0, 99))).permutation(vocab)[:width] for _ in range(k)])
        rows = np.stack([row()[:width] + 1e-3 for _ in range(k)])
        q = SparseQ(cand, rows / rows.sum(axis=1, keepdims=True))
    return p_rows, drafts, q


def _q_full(q, j, x, vocab):
    if q is None:
        return np.eye(vocab)[x]
    return q.full(j, vocab)


@settings(max_examples=300, deadline=None)
@given(walk_inputs(), st.lists(st.floats(1e-9, 1 - 1e-9), min_size=3, max_size=3))
def test_walk_accepts_while_u_q_is_below_p_then_draws_the_residual(inputs, us):
    p_rows, drafts, q = inputs
    vocab = p_rows.shape[1]
    streams = ScriptedStreams(us)
    j, bonus = accept_walk(p_rows, drafts, q, streams)
    want = 0
    while want < len(drafts):
        qx = 1.0 if q is None else q.prob(want, drafts[want])
        if not us[want] * qx < p_rows[want, drafts[want]]:
            break
        want += 1
    assert j == want
    assert streams.uctr == min(j + 1, len(drafts)) and streams.sctr == 1
    if j == len(drafts):
        expect = p_rows[j]
    else:
        residual = np.maximum(p_rows[j] - _q_full(q, j, drafts[j], vocab), 0.0)
        expect = residual / residual.sum() if residual.sum() > 0 else p_rows[j]
    np.testing.assert_allclose(streams.drawn[0], expect, rtol=0, atol=1e-15)
    assert p_rows[j, bonus] > 0


@settings(max_examples=200, deadline=None)
@given(walk_inputs(max_k=1), st.floats(1e-6, 1.0))
def test_slot_zero_acceptance_measure_is_min_one_p_over_q(inputs, shrink):
    # Integrating over u exactly: slot 0 accepts on u in (0, p/q) and rejects above it, so
    # P(accept | x) = min(1, p(x)/q(x)), and E over x ~ q gives sum(min(p, q)).
    p_rows, drafts, q = inputs
    if not drafts:
        return
    x = drafts[0]
    qx = 1.0 if q is None else q.prob(0, x)
    p = p_rows[0, x]
    top, bottom = 1.0 - 2.0**-33, 2.0**-33         # the extreme uniforms Philox makes
    if p == 0:                                     # measure 0: never accepted
        assert accept_walk(p_rows, drafts, q, ScriptedStreams([bottom]))[0] == 0
    elif qx == 0 or p >= qx:                       # measure 1: the whole interval accepts
        assert accept_walk(p_rows, drafts, q, ScriptedStreams([top]))[0] == 1
    else:                                          # measure p/q: accept below the threshold only
        t = p / qx
        below, above = t * (1 - 1e-9) * shrink, min(t * (1 + 1e-9) + (top - t) * (1 - shrink), top)
        assert accept_walk(p_rows, drafts, q, ScriptedStreams([below]))[0] == 1
        assert accept_walk(p_rows, drafts, q, ScriptedStreams([above]))[0] == 0


def test_slot_zero_acceptance_integrates_to_sum_min_p_q():
    # the accept set of each draft x, found by bisection on the walk itself, integrated over
    # u and then over x ~ q: P(accept slot 0) = sum(min(p, q)), the coupling bound
    rng = np.random.default_rng(5)
    for trial in range(24):
        p = _filtered_rows(rng, 1)[0]
        q_row = rng.dirichlet(np.full(V, 0.5)) if trial % 3 else _relate(p, ("far", "outside", "equal")[trial % 9 // 3])
        total = 0.0
        for x in np.flatnonzero(q_row):
            walk = lambda u: accept_walk(np.stack([p, p]), [int(x)], DenseQ(q_row[None]), ScriptedStreams([u]))[0]  # noqa: E731
            lo, hi = 0.0, 1.0
            if walk(1.0 - 2.0**-33):
                lo = 1.0
            elif walk(2.0**-60):
                for _ in range(60):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if walk(mid) else (lo, mid)
            total += q_row[x] * lo
        assert total == pytest.approx(np.minimum(p, q_row).sum(), abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(walk_inputs(), st.integers(0, 2**64 - 1))
def test_walk_never_emits_a_zero_probability_token(inputs, seed):
    p_rows, drafts, q = inputs
    streams = SampleStreams(NumpyBackend(), seed)
    j, bonus = accept_walk(p_rows, drafts, q, streams)
    assert 0 <= j <= len(drafts) and 0 <= bonus < p_rows.shape[1]
    tokens = drafts[:j] + [bonus]
    assert all(p_rows[i, t] > 0 for i, t in enumerate(tokens)), (tokens, p_rows)
    assert streams.sctr == 1 and streams.uctr == min(j + 1, len(drafts))


@settings(max_examples=150, deadline=None)
@given(walk_inputs(), st.integers(0, 2**32))
def test_point_and_sparse_q_walk_like_their_dense_rows(inputs, seed):
    p_rows, drafts, q = inputs
    vocab = p_rows.shape[1]
    dense = None if not drafts else DenseQ(np.stack([_q_full(q, i, x, vocab) for i, x in enumerate(drafts)]))
    a = accept_walk(p_rows, drafts, q, SampleStreams(NumpyBackend(), seed))
    b = accept_walk(p_rows, drafts, dense, SampleStreams(NumpyBackend(), seed))
    assert a == b
