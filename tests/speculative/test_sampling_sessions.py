"""Sampled speculative sessions: exact end to end, reproducible, burst-split invariant.

* mini, real spec rounds: over many seeds, the first two generated tokens of
  generate(..., draft, sampling) follow the plain filtered target law p(t1) p(t2 | t1), computed
  exactly from model.prime / decode_step; for native-mtp (dense q) at K = 1..3 and for ngram
  (point masses). The session hands the walk the filtered verify rows and the q its drafts were
  drawn from (a spy on accept_walk).
* a bigram target (the logits after token t depend on t only, so the exact law of a tape is a
  product of filtered rows) runs many more sessions: tokens 1..4, across round boundaries, for
  dense, sparse and point-mass drafts; and the p_min confidence gate, which breaks exactness.
* same seed -> same tokens; another seed -> other tokens; one burst == many small bursts;
  sampled sessions refuse demote(); penalties are refused.

Statistics as in test_sampling_exactness (ALPHA = 1e-4 per chi-square, <= 2 per test). mini:
N_MINI = 700 runs per case over 8..30 joint cells (df <= 29, critical <= 66.2): the worst-case
noncentrality 4 N delta^2 gives power >= 0.85 at TV delta = 0.14 and ~1 at 0.2, a check of the
wiring (the walk's own tests carry the fine resolution; mini's random MTP head is accepted in
only ~5% of rounds, ngram in ~45%). Bigram: N_BIGRAM = 6000 sessions, power >= 0.99 at TV 0.05
on token 1; the conditional rows of tokens 2..4 are pooled over (position, previous token).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import memra
from memra.backend.philox import TAG_ACCEPT, TAG_DRAW
from memra.drafters.registry import list_draft_sources, load_drafter
from memra.errors import InputError
from memra.generate import generate
from memra.speculative import sampling as sampling_mod
from memra.speculative.contract import DenseQ, Proposal, SparseQ
from memra.speculative.sampling import SamplingParams, filtered_probs
from memra.speculative.session import SpecSession

from .stats import ReplayBackend, StreamTable, assert_fits, grouped_fit

N_MINI = 700
N_BIGRAM = 6000
PROMPT = [3, 1]


@pytest.fixture(scope="module")
def mini(fixture_dir):
    return memra.load_model(fixture_dir("mini"), backend="numpy")


def exact_two_token_law(model, prompt, sp) -> np.ndarray:
    """joint[t1, t2] = p(t1) p(t2 | t1) under the filter, from plain prime / decode_step."""
    vocab = model.cfg.vocab_size
    cache = model.new_cache(len(prompt) + 2)
    p1 = filtered_probs(model.prime(prompt, cache), sp)
    joint = np.zeros((vocab, vocab))
    for t1 in np.flatnonzero(p1):
        cache = model.new_cache(len(prompt) + 2)
        model.prime(prompt, cache)
        joint[t1] = p1[t1] * filtered_probs(model.decode_step(int(t1), cache), sp)
    return joint


E2E = [  # (draft source, K, sampling knobs)
    ("native-mtp", 1, dict(temperature=1.0, top_k=3)),
    ("native-mtp", 2, dict(temperature=0.7, top_p=0.8)),
    ("native-mtp", 3, dict(temperature=1.3, top_k=6, min_p=0.15)),
    ("ngram", 2, dict(temperature=1.0, top_k=3)),
]


@pytest.mark.parametrize("draft, k, knobs", E2E, ids=[f"{d}-k{k}" for d, k, _ in E2E])
def test_first_two_tokens_follow_the_plain_filtered_law(mini, draft, k, knobs):
    if draft not in list_draft_sources():
        pytest.skip(f"draft source {draft!r} is not installed")
    joint = exact_two_token_law(mini, PROMPT, SamplingParams(**knobs))
    vocab = mini.cfg.vocab_size
    counts = np.zeros((vocab, vocab), np.int64)
    drafted = 0
    for seed in range(N_MINI):
        sp = SamplingParams(seed=10_000 * k + seed, **knobs)
        result = generate(mini, PROMPT, 2, draft=draft, num_draft_tokens=k, sampling=sp)
        counts[result.tokens[0], result.tokens[1]] += 1
        drafted += result.stats["num_draft_tokens"] > 0
    assert drafted > N_MINI // 2, "the draft source proposed too rarely for the test to mean much"
    assert_fits(counts.sum(axis=0), joint.sum(axis=0), f"token 2, {draft} k={k}")
    assert_fits(counts.reshape(-1), joint.reshape(-1), f"tokens (1, 2), {draft} k={k}")


def test_the_session_walks_the_filtered_rows_and_the_q_it_drew_from(mini, monkeypatch):
    walks, draws = [], []
    real_walk, real_draw = sampling_mod.accept_walk, sampling_mod.DraftSampling.draw

    def walk_spy(p_rows, drafts, q, streams, be=None):
        walks.append((p_rows.copy(), list(drafts), None if q is None else q.rows.copy()))
        return real_walk(p_rows, drafts, q, streams, be)

    def draw_spy(self, probs):
        token = real_draw(self, probs)
        draws.append((np.array(probs), token))
        return token

    monkeypatch.setattr("memra.speculative.session.accept_walk", walk_spy)
    monkeypatch.setattr(sampling_mod.DraftSampling, "draw", draw_spy)
    sp = SamplingParams(temperature=0.9, top_k=5, top_p=0.95, seed=4)
    session = SpecSession(mini, PROMPT, load_drafter("native-mtp", mini), 64, sampling=sp)
    session.burst(1, 3)                                   # emits the anchor only
    for _ in range(4):
        context = list(session.committed) + [session.anchor]
        del draws[:]
        session.burst(1, 3)                               # exactly one round
        p_rows, drafts, q = walks[-1]
        # q is what each draft was drawn from, a filtered row (at most top_k tokens)
        assert [t for _, t in draws] == drafts and len(drafts) == 3
        np.testing.assert_array_equal(q, np.stack([probs for probs, _ in draws]))
        assert all(np.count_nonzero(row) <= 5 and abs(row.sum() - 1) < 1e-12 for row in q)
        # p: the filtered plain decode rows after the anchor and after each draft
        cache = mini.new_cache(64)
        mini.prime(context[:-1], cache)
        for r, token in enumerate([context[-1]] + drafts):
            np.testing.assert_allclose(p_rows[r], filtered_probs(mini.decode_step(token, cache), sp), rtol=0, atol=1e-9)


# ---- reproducibility ------------------------------------------------------------------------------------
RUNS = [("native-mtp", 3), ("native-mtp", 1), ("ngram", 2), (None, 0)]


@pytest.mark.parametrize("draft, k", RUNS, ids=[f"{d}-k{k}" for d, k in RUNS])
def test_same_seed_same_tokens_other_seed_other_tokens(mini, draft, k):
    if draft is not None and draft not in list_draft_sources():
        pytest.skip(f"draft source {draft!r} is not installed")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    def run(seed):
        sp = SamplingParams(temperature=1.2, top_p=0.95, seed=seed)
        return generate(mini, prompt, 16, draft=draft, num_draft_tokens=max(k, 1), sampling=sp).tokens

    first = run(2**63 + 5)
    assert len(first) == 16 and first == run(2**63 + 5)
    assert len({tuple(run(s)) for s in (1, 2, 3)} | {tuple(first)}) > 1


@pytest.mark.parametrize("k, sizes", [(2, [1, 2, 3]), (3, [1]), (1, [5, 1])])
def test_one_burst_equals_many_small_bursts(mini, k, sizes):
    sp = SamplingParams(temperature=1.0, top_k=8, seed=99)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    def bursts(plan):
        session = SpecSession(mini, prompt, load_drafter("native-mtp", mini), 96, sampling=sp)
        out, counters, i = [], [], 0
        while len(out) < 24:
            want = 24 - len(out) if plan is None else min(plan[i % len(plan)], 24 - len(out))
            out.extend(session.burst(want, k)[0])
            counters.append((session.streams.sctr, session.streams.uctr))
            i += 1
        return out, counters, session

    whole, c_whole, _ = bursts(None)
    split, c_split, session = bursts(sizes)
    assert split == whole and c_split[-1] == c_whole[-1]
    # the counters live on the session and never rewind across bursts, so no draw repeats:
    # one draw for the anchor, then k drafts and one bonus per round
    assert all(b[0] >= a[0] and b[1] >= a[1] for a, b in zip(c_split, c_split[1:]))
    assert c_split[-1][0] == 1 + session.metrics.rounds * (k + 1)


def test_sampled_sessions_refuse_demote_and_greedy_ones_demote(mini):
    drafter = load_drafter("native-mtp", mini)
    sampled = SpecSession(mini, PROMPT, drafter, 64, sampling=SamplingParams(seed=1))
    sampled.burst(4, 2)
    with pytest.raises(InputError, match="demote"):
        sampled.demote()
    greedy_session = SpecSession(mini, PROMPT, drafter, 64, sampling=SamplingParams(temperature=0))
    greedy_session.burst(4, 2)
    _, token = greedy_session.demote()
    assert 0 <= token < mini.cfg.vocab_size


PENALTIES = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5), dict(frequency_penalty=-0.2)]


@pytest.mark.parametrize("draft", [None, "native-mtp"])
@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda d: next(iter(d)))
def test_penalised_sampling_is_refused(mini, draft, penalty):
    with pytest.raises(InputError, match="penalt"):
        generate(mini, PROMPT, 4, draft=draft, sampling=SamplingParams(temperature=0.8, **penalty))


@pytest.mark.parametrize("draft", [None, "native-mtp"])
def test_penalised_greedy_is_refused_too(mini, draft):
    with pytest.raises(InputError, match="penalt"):
        generate(mini, PROMPT, 4, draft=draft, sampling=SamplingParams(temperature=0, repetition_penalty=1.3))


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_session_opened_directly_refuses_penalties_too(mini, temperature):
    with pytest.raises(InputError, match="penalt"):
        SpecSession(mini, PROMPT, load_drafter("native-mtp", mini), 64,
                    sampling=SamplingParams(temperature=temperature, presence_penalty=0.5))


# ---- a bigram target: many sessions ---------------------------------------------------------------------
BV = 6
BRNG = np.random.default_rng(11)
TARGET = BRNG.normal(0, 1.2, (BV, BV))       # logits after token t: TARGET[t]
BSP = dict(temperature=0.9, top_k=5)         # the filter removes one token per row
ROWS = np.stack([filtered_probs(row, SamplingParams(**BSP)) for row in TARGET])
DRAFT = BRNG.normal(0, 1.2, (BV, BV))        # an unrelated draft table, plus a confident pick on
DRAFT[np.arange(BV), np.argmin(np.where(ROWS > 0, ROWS, 2), axis=1)] += 2.0   # the least likely kept token


class BigramTarget:
    """SpecSession's model interface over a bigram table (cache = position only)."""

    def __init__(self, be):
        self.be, self.cfg = be, SimpleNamespace(vocab_size=BV)

    def new_cache(self, max_ctx):
        return SimpleNamespace(pos=0, max_ctx=max_ctx)

    def prime_rows(self, prompt, cache, tap_layers=()):
        cache.pos += len(prompt)
        return TARGET[prompt[-1]], np.zeros((len(prompt), 1)), {}

    def verify_rows(self, rows, cache, tap_layers=()):
        return TARGET[np.asarray(rows)], np.zeros((len(rows), 1)), SimpleNamespace(pos=cache.pos, taps={})

    verify_logits = verify_rows  # the rows are on the host already

    def rollback(self, cache, ckpt, keep):
        cache.pos = ckpt.pos + keep


class TableDrafter:
    """Drafts chained on DRAFT: 'dense' draws the request-filtered row (q = it), 'sparse' draws
    among the top-3 with a temperature-only softmax (a DFlash2-style selector), 'point' takes
    the argmax (q = None). Confidence = the slot's largest q, fixed before the draw (the
    Proposal contract); `drawn_conf` instead reports the drawn token's own q (the red arm)."""

    max_k, tap_layers = 14, ()

    def __init__(self, kind, drawn_conf=False):
        self.kind, self.drawn_conf = kind, drawn_conf

    def begin(self, start):
        self.last = start.anchor
        return self

    def propose(self, k, sampling):
        prev, tokens, rows, cands, confs = self.last, [], [], [], []
        for _ in range(k):
            logits = DRAFT[prev]
            if self.kind == "point":
                x, conf = int(np.argmax(logits)), 1.0
            elif self.kind == "dense":
                q = sampling.filter(logits)
                x = sampling.draw(q)
                rows.append(q)
                conf = q[x] if self.drawn_conf else q.max()
            else:
                ids = np.argsort(-logits, kind="stable")[:3]
                q = np.exp(logits[ids] / sampling.params.temperature)
                q /= q.sum()
                i = sampling.draw(q)
                x, conf = int(ids[i]), (q[i] if self.drawn_conf else q.max())
                rows.append(q)
                cands.append(ids)
            tokens.append(x)
            confs.append(float(conf))
            prev = x
        q = None if self.kind == "point" else DenseQ(np.stack(rows)) if self.kind == "dense" \
            else SparseQ(np.stack(cands), np.stack(rows))
        return Proposal(tokens=tokens, q=q, confidences=confs)

    def commit(self, outcome):
        self.last = outcome.bonus


def bigram_tapes(monkeypatch, kind, k, n, base, length=4, drawn_conf=False, **session_kw):
    seeds = list(range(base, base + n))
    draws = StreamTable(seeds, 4 * (k + 1), TAG_DRAW, BV)
    accepts = StreamTable(seeds, 4 * k, TAG_ACCEPT, 1)
    real_u01 = sampling_mod.host_u01

    def u01(seed, counter):   # the same numbers as host_u01, from the table (exactness tests)
        row = accepts.row.get(seed)
        if row is None or counter >= accepts.u.shape[1]:
            return real_u01(seed, counter)
        return float(accepts.u[row, counter, 0])

    monkeypatch.setattr(sampling_mod, "host_u01", u01)
    model = BigramTarget(ReplayBackend(draws))
    tapes = []
    for seed in seeds:
        session = SpecSession(model, [0, 1], TableDrafter(kind, drawn_conf), 64, sampling=SamplingParams(seed=seed, **BSP),
                              **session_kw)
        tapes.append(session.burst(length, k)[0][:length])
    return np.array(tapes)



def assert_bigram_law(tapes, what):
    assert_fits(np.bincount(tapes[:, 0], minlength=BV), ROWS[1], f"{what}: token 1")
    groups: dict = {}
    for pos in range(1, tapes.shape[1]):
        for prev, nxt in zip(tapes[:, pos - 1], tapes[:, pos]):
            groups.setdefault((pos, int(prev)), np.zeros(BV, np.int64))[nxt] += 1
    grouped_fit(groups, lambda key: ROWS[key[1]], f"{what}: token i+1 | token i")


@pytest.mark.parametrize("kind, k", [("dense", 3), ("sparse", 2), ("point", 2)])
def test_bigram_sessions_follow_the_target_chain(monkeypatch, kind, k):
    tapes = bigram_tapes(monkeypatch, kind, k, N_BIGRAM, base=50_000 * k)
    assert_bigram_law(tapes, f"{kind} k={k}")


def test_green_arm_slot_zero_is_never_gated_without_pmin0(monkeypatch):
    tapes = bigram_tapes(monkeypatch, "dense", 1, N_BIGRAM, base=7, length=2, p_min=0.5)
    assert_bigram_law(tapes, "p_min 0.5 at k=1 (slot 0 survives)")


def test_the_confidence_gate_keeps_sampled_exactness(monkeypatch):
    tapes = bigram_tapes(monkeypatch, "dense", 1, N_BIGRAM, base=7, length=2, p_min=0.5, pmin0=True)
    assert_bigram_law(tapes, "p_min 0.5 with pmin0")


def test_red_arm_gating_on_the_drawn_tokens_own_q_breaks_exactness(monkeypatch):
    """Why Proposal.confidences must be fixed before the draw: cutting a sampled draft on its own
    q(x) skews what survives, and the output stops following p."""
    tapes = bigram_tapes(monkeypatch, "dense", 1, N_BIGRAM, base=7, length=2, drawn_conf=True, p_min=0.5, pmin0=True)
    with pytest.raises(AssertionError, match="chi2"):
        assert_bigram_law(tapes, "p_min 0.5 with pmin0, gated on the drawn token")
