"""Sampled decoding with the built-in drafters is exact in distribution, on the mini target.

Three drafter paths that only sampled decoding exercises, each with a red arm:
* native-mtp through an FR-Spec trim (`d2t`): the head drafts rank ids whose q row must be
  scattered back to true ids; red arm: scattered through np.unique(d2t), which sorts the ids (a
  scatter that gives the drawn token q = 0 is refused by the core; this one keeps q > 0).
* dflash2 end to end: the selector's sparse, path-conditional q; red arm: candidate ids recorded
  in the reverse order of their q rows.
* the p_min gate over dflash2's confidences (pmin0: slot 0 is gated too); red arm: gating on the
  drawn token's own q (Proposal.confidences must be fixed before the draw).

Each test runs N sessions and checks token 1 against p1 and token 2 | token 1 against the
filtered plain rows p(. | t1) (dflash2 also token 3 | t1, t2), computed exactly from
model.prime / decode_step, at ALPHA = 1e-4 per chi-square (<= 3 per test).

Stated power, computed exactly in each test's fixture before it samples: token 2 comes from the
slot-0 walk, whose draft q(. | t1) is read from a fresh drafter state, so the law of token 2
under each red arm has a closed form (`walk_law`); the chi-square statistic evaluated at the red
arm's expected counts is the noncentrality lambda of the grouped test (pooled as `gof` pools),
and `chi2_power` turns it into the probability that the red arm fails the test. The designs
(prompt, drafter seed, filter, p_min) were picked on a grid for that power, which the fixtures
assert (> 0.99): FR-Spec N = 150, lambda ~ 750 on 5 df; dflash2 N = 200, lambda ~ 92 on 5 df;
p_min N = 300, lambda ~ 53 on 4 df (power 0.997). Against an unstructured error of total
variation delta (lambda >= 4 N delta^2) the same designs resolve delta ~ 0.2-0.3 on token 2.
Runtime: ~ 35-50 ms per session on numpy (prime + one or two verify walks).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import memra
from memra.config import preset
from memra.drafters.dflash2 import write_fixture_drafter
from memra.drafters.native_mtp import NativeMtpState
from memra.drafters.registry import load_drafter
from memra.speculative.contract import SessionStart, SparseQ
from memra.speculative.sampling import (
    DraftSampling,
    SampleStreams,
    SamplingParams,
    filtered_probs,
)
from memra.speculative.session import SpecSession

from .stats import assert_fits, chi2_power, gof, grouped_fit

MAX_CTX = 16
MIN_POWER = 0.99
LAMBDA_CAP = 600.0   # chi2_power's Poisson weights underflow past ~1400; power is monotone in lambda
FR_SPEC = dict(prompt=[30, 13], n=150, sp=SamplingParams(temperature=0.7),
               d2t=list(range(31, 0, -2)))                      # the odd ids, most "frequent" last
DFLASH2 = dict(prompt=[5, 9], n=200, sp=SamplingParams(temperature=0.7, top_k=4), seed=0,
               shape={"strategy": "dspark", "with_markov": True, "with_confidence": True})
PMIN = dict(prompt=[30, 13], n=300, sp=SamplingParams(temperature=0.7, top_k=4), seed=2, p_min=0.45,
            shape={"strategy": "dflash", "with_markov": True, "with_confidence": True})


@pytest.fixture(scope="module")
def mini(fixture_dir):
    return memra.load_model(fixture_dir("mini"), backend="numpy")


def dflash2(mini, tmp_path_factory, design):
    path = write_fixture_drafter(tmp_path_factory.mktemp("drafter"), preset("mini"), seed=design["seed"],
                                 target_layer_ids=[0, 2], **design["shape"])
    return load_drafter("dflash2", mini, {"path": path})


# ---- exact laws ----------------------------------------------------------------------------------
def walk_law(p, q, told, keep=None) -> np.ndarray:
    """Law of the token a one-slot rejection walk commits when its draft x ~ q, the walk is told
    `told` for q, and the draft survives the gate iff keep[x] (a dropped draft leaves p's draw)."""
    out = np.zeros_like(p)
    for x in np.flatnonzero(q):
        if keep is not None and not keep[x]:
            out += q[x] * p
            continue
        accept = 0.0 if p[x] == 0 else 1.0 if told[x] <= p[x] else p[x] / told[x]   # u * told < p
        residual = np.maximum(p - told, 0.0)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        out[x] += q[x] * accept
        out += q[x] * (1.0 - accept) * residual
    return out


class SlotZeroLaws:
    """p1, p(. | t1), and the slot-0 Proposal a fresh drafter state makes after each anchor t1."""

    def __init__(self, model, drafter, sp: SamplingParams, prompt):
        logits, collapsed, taps = model.prime_rows(prompt, model.new_cache(MAX_CTX), drafter.tap_layers)
        self.p1 = filtered_probs(logits, sp)
        self.rows, self.proposals = {}, {}
        for t1 in map(int, np.flatnonzero(self.p1)):
            cache = model.new_cache(MAX_CTX)
            model.prime(prompt, cache)
            self.rows[t1] = filtered_probs(model.decode_step(t1, cache), sp)
            state = drafter.begin(SessionStart(model, list(prompt), t1, collapsed, taps, MAX_CTX))
            self.proposals[t1] = state.propose(1, DraftSampling(sp, SampleStreams(model.be, 0)))

    def noncentrality(self, n: int, law_of) -> tuple[float, int]:
        """(lambda, df) of the grouped token-2 test over n sessions whose token 2 | t1 follows
        law_of(p, proposal): the statistic evaluated at the expected counts, pooled as gof pools."""
        stat, df = 0.0, 0
        for t1, p in self.rows.items():
            s, d = gof(n * self.p1[t1] * law_of(p, self.proposals[t1]), p)
            stat, df = stat + s, df + d
        return stat, df

    def power(self, n: int, law_of) -> float:
        """The probability that the grouped token-2 test fails such sessions (a lower bound
        when lambda is capped)."""
        stat, df = self.noncentrality(n, law_of)
        return chi2_power(df, min(stat, LAMBDA_CAP))


def test_walk_law_is_the_target_row_when_told_the_true_q():
    rng = np.random.default_rng(0)
    for _ in range(50):
        p, q = rng.dirichlet(np.full(8, 0.5)), rng.dirichlet(np.full(8, 0.5))
        p[rng.integers(8)] = 0.0
        p /= p.sum()
        np.testing.assert_allclose(walk_law(p, q, q), p, atol=1e-12)
        np.testing.assert_allclose(walk_law(p, q, q, keep=np.full(8, rng.random() < 0.5)), p, atol=1e-12)
        assert not np.allclose(walk_law(p, q, q, keep=q >= np.median(q)), p), "a draw-dependent gate skews"


# ---- sessions ------------------------------------------------------------------------------------
def sampled_tokens(model, drafter, design, base: int, k: int = 1, length: int = 2, wrap=None, **session_kw):
    """The first `length` tokens of N sessions (seeds base..), shape [N, length]."""
    tapes = []
    for seed in range(base, base + design["n"]):
        session = SpecSession(model, design["prompt"], drafter, MAX_CTX, sampling=replace(design["sp"], seed=seed),
                              **session_kw)
        if wrap is not None:
            wrap(session.state)
        out: list[int] = []
        while len(out) < length:
            out.extend(session.burst(length - len(out), k)[0])
        tapes.append(out[:length])
    return np.array(tapes)


def assert_first_tokens(tapes, laws: SlotZeroLaws, what: str) -> None:
    vocab = laws.p1.size
    assert_fits(np.bincount(tapes[:, 0], minlength=vocab), laws.p1, f"{what}: token 1")
    groups = {t1: np.bincount(tapes[tapes[:, 0] == t1, 1], minlength=vocab) for t1 in np.unique(tapes[:, 0])}
    grouped_fit(groups, lambda t1: laws.rows[int(t1)], f"{what}: token 2 | token 1")


def wrap_proposals(edit):
    """A state wrapper: every Proposal goes through edit(proposal) before the session sees it."""
    def wrap(state):
        propose = state.propose
        state.propose = lambda k, sampling: edit(propose(k, sampling))
    return wrap


# ---- FR-Spec trimmed head ------------------------------------------------------------------------
def sorted_scatter(probs, d2t, vocab: int) -> np.ndarray:
    """Red arm: rank probabilities scattered through np.unique(d2t), which sorts the ids."""
    row = np.zeros(vocab)
    row[np.unique(d2t)] = probs
    return row


@pytest.fixture(scope="module")
def fr_spec(mini):
    drafter = load_drafter("native-mtp", mini, {"d2t": FR_SPEC["d2t"]})
    laws = SlotZeroLaws(mini, drafter, FR_SPEC["sp"], FR_SPEC["prompt"])
    d2t = np.asarray(FR_SPEC["d2t"])
    red = lambda p, prop: walk_law(p, prop.q.rows[0], sorted_scatter(prop.q.rows[0][d2t], d2t, p.size))  # noqa: E731
    assert laws.power(FR_SPEC["n"], red) > MIN_POWER
    return drafter, laws


def test_fr_spec_trimmed_head_sampling_follows_the_target(mini, fr_spec):
    drafter, laws = fr_spec
    assert all(set(np.flatnonzero(p.q.rows[0])) == set(FR_SPEC["d2t"]) for p in laws.proposals.values())
    tapes = sampled_tokens(mini, drafter, FR_SPEC, base=1_000)
    assert_first_tokens(tapes, laws, "native-mtp + d2t")


def test_red_arm_a_trimmed_q_scattered_to_sorted_ids_is_caught(mini, fr_spec, monkeypatch):
    drafter, laws = fr_spec
    monkeypatch.setattr(NativeMtpState, "_full_vocab",
                        lambda self, probs: sorted_scatter(probs, self.drafter.d2t, laws.p1.size))
    tapes = sampled_tokens(mini, drafter, FR_SPEC, base=1_000)
    with pytest.raises(AssertionError, match="chi2"):   # green arm: the test above (same seeds)
        assert_first_tokens(tapes, laws, "native-mtp + d2t, q scattered to sorted ids")


# ---- dflash2, end to end -------------------------------------------------------------------------
def misaligned(q: SparseQ) -> SparseQ:
    """Red arm: candidate ids in the reverse order of their q rows."""
    return SparseQ(q.cand[:, ::-1], q.q_rows)


@pytest.fixture(scope="module")
def dflash2_e2e(mini, tmp_path_factory):
    drafter = dflash2(mini, tmp_path_factory, DFLASH2)
    laws = SlotZeroLaws(mini, drafter, DFLASH2["sp"], DFLASH2["prompt"])
    vocab = laws.p1.size
    red = lambda p, prop: walk_law(p, prop.q.full(0, vocab), misaligned(prop.q).full(0, vocab))  # noqa: E731
    assert laws.power(DFLASH2["n"], red) > MIN_POWER
    return drafter, laws


def third_token_rows(model, sp, prompt, pairs) -> dict:
    """p(. | t1, t2) for each (t1, t2)."""
    rows = {}
    for t1, t2 in pairs:
        cache = model.new_cache(MAX_CTX)
        model.prime(prompt, cache)
        model.decode_step(int(t1), cache)
        rows[(int(t1), int(t2))] = filtered_probs(model.decode_step(int(t2), cache), sp)
    return rows


def test_dflash2_sampling_follows_the_target_over_three_tokens(mini, dflash2_e2e):
    """K = 2: token 2 comes from the slot-0 walk; token 3 from slot 1 (its q conditional on the
    drawn slot-0 candidate) when both drafts are accepted, else from the next round."""
    drafter, laws = dflash2_e2e
    tapes = sampled_tokens(mini, drafter, DFLASH2, base=2_000, k=2, length=3)
    assert_first_tokens(tapes, laws, "dflash2")
    pairs = {(int(a), int(b)) for a, b in tapes[:, :2]}
    rows = third_token_rows(mini, DFLASH2["sp"], DFLASH2["prompt"], pairs)
    groups = {pair: np.bincount(tapes[(tapes[:, 0] == pair[0]) & (tapes[:, 1] == pair[1]), 2],
                                minlength=laws.p1.size) for pair in pairs}
    grouped_fit(groups, lambda pair: rows[pair], "dflash2: token 3 | tokens 1, 2")


def test_red_arm_dflash2_candidates_misaligned_with_their_q_is_caught(mini, dflash2_e2e):
    drafter, laws = dflash2_e2e
    wrap = wrap_proposals(lambda prop: replace(prop, q=misaligned(prop.q)))
    tapes = sampled_tokens(mini, drafter, DFLASH2, base=2_000, wrap=wrap)
    with pytest.raises(AssertionError, match="chi2"):   # green arm: the test above (same seeds)
        assert_first_tokens(tapes, laws, "dflash2, misaligned candidates")


# ---- p_min with dflash2 --------------------------------------------------------------------------
def drawn_q_confidences(prop):
    """Red arm: each slot's confidence is the drawn token's own q."""
    return replace(prop, confidences=[prop.q.prob(i, t) for i, t in enumerate(prop.tokens)])


@pytest.fixture(scope="module")
def pmin(mini, tmp_path_factory):
    drafter = dflash2(mini, tmp_path_factory, PMIN)
    laws = SlotZeroLaws(mini, drafter, PMIN["sp"], PMIN["prompt"])
    vocab, tau = laws.p1.size, PMIN["p_min"]
    red = lambda p, prop: walk_law(p, prop.q.full(0, vocab), prop.q.full(0, vocab),  # noqa: E731
                                   keep=prop.q.full(0, vocab) >= tau)
    assert laws.power(PMIN["n"], red) > MIN_POWER
    gated = sum(laws.p1[t1] for t1, prop in laws.proposals.items() if prop.confidences[0] < tau)
    assert 0.2 < gated < 0.9, f"the gate must drop slot 0 in some rounds and keep it in others ({gated:.2f})"
    return drafter, laws


def test_pmin_gate_over_dflash2_confidences_keeps_sampling_exact(mini, pmin):
    drafter, laws = pmin
    tapes = sampled_tokens(mini, drafter, PMIN, base=3_000, p_min=PMIN["p_min"], pmin0=True)
    assert_first_tokens(tapes, laws, f"dflash2, p_min {PMIN['p_min']} with pmin0")


def test_red_arm_pmin_gating_on_the_drawn_tokens_q_is_caught(mini, pmin):
    drafter, laws = pmin
    tapes = sampled_tokens(mini, drafter, PMIN, base=3_000, wrap=wrap_proposals(drawn_q_confidences),
                           p_min=PMIN["p_min"], pmin0=True)
    with pytest.raises(AssertionError, match="chi2"):   # green arm: the test above (same seeds)
        assert_first_tokens(tapes, laws, "dflash2, p_min gated on the drawn token's q")
