"""The core refuses what a draft source hands it malformed: a declaration (max_k, tap_layers), a
state from begin, a Proposal from propose (tokens, q, confidences). Each is ONE InputError line
naming the source and what was wrong; a refused proposal moves nothing (the cache to the last
bit, the committed tokens, the anchor, the random counters) and the session then continues on
the plain tape. Well-formed edge cases (numpy ids, empty proposals, float32 q) still pass.
More than k drafts is refused, not cut (docs/plugins.md: a proposal holds at most k)."""

import re

import numpy as np
import pytest

from memra.drafters import registry
from memra.drafters.hookspecs import hookimpl
from memra.errors import InputError
from memra.speculative.contract import DenseQ, Proposal, SparseQ, label_source
from memra.speculative.sampling import SamplingParams
from memra.speculative.session import SpecSession

from .battery import MAX_CTX, full_state, run_bursts, state_diff

K = 3
LABEL = "draft source 'scripted' (test)"


class Scripted:
    """Echoes the last emitted token (point masses; sampled: a two-token draw with its q),
    except that round `bad_round` returns make(k, last, vocab), once (a retry gets an echo);
    bad_round=None: every round returns make(...)."""

    tap_layers = ()

    def __init__(self, make=None, bad_round=2, max_k=14):
        self.make, self.bad_round, self.max_k = make, bad_round, max_k

    def begin(self, start):
        return ScriptedState(self, start)


class ScriptedState:
    def __init__(self, source, start):
        self.source, self.last, self.round, self.spent = source, start.anchor, 0, False
        self.vocab = start.model.cfg.vocab_size

    def propose(self, k, sampling):
        src = self.source
        if src.make is not None and src.bad_round is None:
            return src.make(k, self.last, self.vocab)
        if src.make is not None and self.round == src.bad_round and not self.spent:
            self.spent = True
            return src.make(k, self.last, self.vocab)
        if sampling is None:
            return Proposal(tokens=[self.last] * k)
        row = np.zeros(self.vocab)
        row[[self.last, (self.last + 1) % self.vocab]] = [0.5, 0.5]
        return Proposal(tokens=[sampling.draw(row) for _ in range(k)], q=DenseQ(np.tile(row, (k, 1))))

    def commit(self, outcome):
        self.last, self.round = outcome.bonus, self.round + 1


def dense(k, vocab, at=None, value=1.0, dtype=np.float64):
    """k one-hot rows (at[j] per row, or token 0)."""
    rows = np.zeros((k, vocab), dtype=dtype)
    rows[np.arange(k), at if at is not None else 0] = value
    return rows


class Duck:
    def prob(self, j, token):
        return 1.0

    def full(self, j, vocab):
        return np.ones(vocab) / vocab

    def truncate(self, n):
        return self


# name -> (make(k, last, vocab), what the refusal must say)
BAD = {
    "none": (lambda k, t, v: None, r"returned None, not a memra\.speculative\.contract\.Proposal"),
    "tuple": (lambda k, t, v: ([t] * k,), r"returned a tuple, not a"),
    "tokens-none": (lambda k, t, v: Proposal(tokens=None), r"must be integers .*got None"),
    "tokens-float": (lambda k, t, v: Proposal(tokens=[float(t)]), r"must be integers .*\(float\)"),
    "tokens-bool": (lambda k, t, v: Proposal(tokens=[True]), r"must be integers .*got True \(bool\)"),
    "tokens-numpy-float": (lambda k, t, v: Proposal(tokens=[np.float64(t)]), r"\(float64\)"),
    "tokens-float-array": (lambda k, t, v: Proposal(tokens=np.array([t, t], dtype=np.float32)), r"\(float\)"),
    "tokens-str": (lambda k, t, v: Proposal(tokens="ab"), r"got 'ab' \(str\)"),
    "tokens-2d": (lambda k, t, v: Proposal(tokens=[[t, t]]), r"1-D sequence of integers"),
    "id-too-big": (lambda k, t, v: Proposal(tokens=[t, v]), r"draft token id \d+ is outside the vocab"),
    "id-negative": (lambda k, t, v: Proposal(tokens=[-1]), r"draft token id -1 is outside the vocab"),
    "more-than-k": (lambda k, t, v: Proposal(tokens=[t] * (k + 1)), r"returned 4 draft tokens for k=3: .*at most k"),
    "q-list": (lambda k, t, v: Proposal([t] * k, q=dense(k, v, t).tolist()), r"q is a list; give a contract\.DenseQ"),
    "q-duck": (lambda k, t, v: Proposal([t] * k, q=Duck()), r"q is a Duck"),
    "dense-rows": (lambda k, t, v: Proposal([t] * k, q=DenseQ(dense(k - 1, v, t))), r"want floats \[3, \d+\]"),
    "dense-vocab": (lambda k, t, v: Proposal([t] * k, q=DenseQ(np.ones((k, v - 1)) / (v - 1))), r"want floats"),
    "dense-ints": (lambda k, t, v: Proposal([t] * k, q=DenseQ(dense(k, v, t, 1, np.int64))), r"int64 .*want floats"),
    "dense-sum": (lambda k, t, v: Proposal([t] * k, q=DenseQ(dense(k, v, t, 2.0))), r"row 0 sums to 2, not 1"),
    "dense-negative": (lambda k, t, v: Proposal([t] * k, q=DenseQ(dense(k, v, t) - dense(k, v, (t + 1) % v))),
                       r"negative or non-finite"),
    "dense-nan": (lambda k, t, v: Proposal([t] * k, q=DenseQ(dense(k, v, t, np.nan))), r"negative or non-finite"),
    "dense-zero-at-draft": (lambda k, t, v: Proposal([t] * k, q=DenseQ(dense(k, v, (t + 1) % v))),
                            r"gives draft 0 \(token \d+\) probability 0"),
    "dense-not-array": (lambda k, t, v: Proposal([t] * k, q=DenseQ("rows")), r"numeric host \(numpy\) array"),
    "sparse-shapes": (lambda k, t, v: Proposal([t] * k, q=SparseQ(np.zeros((k, 2), int), np.ones((k, 3)) / 3)),
                      r"SparseQ cand int64 \(3, 2\) and q_rows float64 \(3, 3\)"),
    "sparse-float-ids": (lambda k, t, v: Proposal([t] * k, q=SparseQ(np.full((k, 1), float(t)), np.ones((k, 1)))),
                         r"want integer ids"),
    "sparse-id-outside": (lambda k, t, v: Proposal([t] * k, q=SparseQ(np.array([[t, v]] * k), np.full((k, 2), .5))),
                          r"candidate ids must lie in the vocab"),
    "sparse-sum": (lambda k, t, v: Proposal([t] * k, q=SparseQ(np.array([[t, 0]] * k), np.array([[.5, .6]] * k))),
                   r"sums to 1\.1, not 1"),
    "sparse-draft-missing": (lambda k, t, v: Proposal([t] * k, q=SparseQ(np.full((k, 1), (t + 1) % v), np.ones((k, 1)))),
                             r"gives draft 0 \(token \d+\) probability 0"),
    "conf-length": (lambda k, t, v: Proposal([t] * k, confidences=[0.5] * (k - 1)),
                    r"2 confidences for 3 draft tokens: give one per draft"),
    "conf-nan": (lambda k, t, v: Proposal([t] * k, confidences=[0.5, float("nan"), 0.5]), r"confidence 1 is nan"),
    "conf-negative": (lambda k, t, v: Proposal([t] * k, confidences=[-0.1] * k), r"confidence 0 is -0\.1: .*\[0, 1\]"),
    "conf-above-one": (lambda k, t, v: Proposal([t] * k, confidences=[1.5] * k), r"confidence 0 is 1\.5"),
    "conf-bool": (lambda k, t, v: Proposal([t] * k, confidences=[True] * k), r"confidence 0 is True"),
    "conf-str": (lambda k, t, v: Proposal([t] * k, confidences=["0.5"] * k), r"confidence 0 is '0\.5'"),
    "conf-scalar": (lambda k, t, v: Proposal([t] * k, confidences=0.5), r"confidences must be a list of 3 numbers"),
}


def open_scripted(model, prompt, source, **kwargs) -> SpecSession:
    label_source(source, LABEL)
    return SpecSession(model, prompt, source, MAX_CTX, **kwargs)


def refused_round(session):
    """Burst one round at a time until one is refused: (tokens before it, the refusal, the
    session's state as that round found it)."""
    out = []
    for _ in range(10):
        before = (full_state(session.model, session.cache), list(session.committed), session.anchor,
                  None if session.streams is None else (session.streams.sctr, session.streams.uctr))
        try:
            out.extend(session.burst(1, K)[0])
        except InputError as exc:
            return out, exc, before
    raise AssertionError("no round was refused")


def assert_untouched(session, before) -> None:
    state, committed, anchor, counters = before
    assert state_diff(full_state(session.model, session.cache), state) == []   # dead rows included
    assert (session.committed, session.anchor) == (committed, anchor)
    assert (None if session.streams is None else (session.streams.sctr, session.streams.uctr)) == counters


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_proposal_is_refused_naming_the_source_and_moves_nothing(model, prompt, tape, case):
    make, what = BAD[case]
    session = open_scripted(model, prompt, Scripted(make))
    out, exc, before = refused_round(session)
    msg = str(exc)
    assert msg.startswith(f"{LABEL}: propose(k={K})") and re.search(what, msg), msg
    assert "\n" not in msg
    assert_untouched(session, before)
    assert session.stopped is None
    out.extend(run_bursts(session, 30, K))   # the source is well-behaved again: the tape goes on
    assert out == tape[:len(out)]


@pytest.mark.parametrize("case", ["dense-sum", "sparse-draft-missing", "conf-nan", "more-than-k"])
def test_a_malformed_proposal_in_a_sampled_session_draws_nothing(model, prompt, case):
    make, what = BAD[case]
    session = open_scripted(model, prompt, Scripted(make), sampling=SamplingParams(temperature=0.9, seed=3))
    out, exc, before = refused_round(session)
    assert re.search(what, str(exc))
    assert_untouched(session, before)
    assert session.burst(4, K)[0]


def test_more_than_k_drafts_is_refused_not_truncated_and_k_is_fine(model, prompt, tape):
    exact = open_scripted(model, prompt, Scripted(lambda k, t, v: Proposal([t] * k, confidences=[1.0] * k),
                                                 bad_round=None))
    assert run_bursts(exact, 20, K)[:20] == tape[:20]
    over = open_scripted(model, prompt, Scripted(lambda k, t, v: Proposal([t] * (k + 2))))
    _, exc, _ = refused_round(over)
    assert "returned 5 draft tokens for k=3" in str(exc)


class Trap(DenseQ):
    """A DenseQ subclass whose methods fail: the core verifies with its own copy of the rows."""

    def prob(self, j, token):
        raise AssertionError("the core called a plugin's q.prob")

    full = truncate = prob


# name -> make(k, last, vocab): proposals at the edges of the contract that must pass
GOOD = {
    "numpy-int64-array": lambda k, t, v: Proposal(np.full(k, t, dtype=np.int64)),
    "numpy-int32-items": lambda k, t, v: Proposal([np.int32(t)] * k),
    "tuple": lambda k, t, v: Proposal((t,) * k),
    "empty": lambda k, t, v: Proposal([]),
    "empty-with-q": lambda k, t, v: Proposal([], q=DenseQ(np.zeros((0, v))), confidences=[]),
    "fewer-than-k": lambda k, t, v: Proposal([t]),
    "float32-q": lambda k, t, v: Proposal([t] * k, q=DenseQ(dense(k, v, t, dtype=np.float32))),
    "sparse-with-duplicates": lambda k, t, v: Proposal([t] * k, q=SparseQ(np.array([[t, t]] * k),
                                                                          np.full((k, 2), .5))),
    "subclassed-q": lambda k, t, v: Proposal([t] * k, q=Trap(dense(k, v, t))),
    "numpy-confidences": lambda k, t, v: Proposal([t] * k, confidences=np.array([1, 0.5, 0], np.float32)[:k]),
    "int-confidences": lambda k, t, v: Proposal([t] * k, confidences=[1, 0, 1][:k]),
}


@pytest.mark.parametrize("case", list(GOOD))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_well_formed_edge_cases_pass(model, prompt, tape, case, sampled):
    sampling = SamplingParams(temperature=0.9, seed=3) if sampled else None
    session = open_scripted(model, prompt, Scripted(GOOD[case], bad_round=None), sampling=sampling, p_min=0.6)
    out = run_bursts(session, 16, K)
    assert session.metrics.rounds > 2
    if not sampled:
        assert out[:16] == tape[:16]


# ---- declarations and begin ------------------------------------------------------------------------
class BadBegin(Scripted):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def begin(self, start):
        return self.state


class NoCommit:
    def propose(self, k, sampling):
        return Proposal([])

    commit = 3


@pytest.mark.parametrize("state, what", [
    (None, r"begin\(\) returned NoneType without propose and commit\(\)"),
    (NoCommit(), r"begin\(\) returned NoCommit without commit\(\)"),
    (Scripted(), r"begin\(\) returned Scripted without propose and commit\(\)"),
])
def test_begin_must_return_a_state(model, prompt, state, what):
    with pytest.raises(InputError, match=rf"^{re.escape(LABEL)}: {what}"):
        open_scripted(model, prompt, BadBegin(state))


@pytest.mark.parametrize("max_k", [0, -1, "4", True, 2.5, None])
def test_max_k_must_be_a_positive_integer(model, prompt, max_k):
    with pytest.raises(InputError, match=rf"^{re.escape(LABEL)}: max_k={re.escape(repr(max_k))} must be an integer"):
        open_scripted(model, prompt, Scripted(max_k=max_k))


@pytest.mark.parametrize("taps, what", [
    ("0", "must be a tuple"), (None, "must be a tuple"), (3, "must be a tuple"),
    ((1.5,), "must hold integer layer indices"), ((True,), "must hold integer layer indices"),
    ((0, 99), r"reach outside the trunk 0\.\.\d+; the drafter was made for another model"),
])
def test_tap_layers_must_be_layer_indices(model, prompt, taps, what):
    source = Scripted()
    source.tap_layers = taps
    with pytest.raises(InputError, match=rf"^{re.escape(LABEL)}: tap_layers=.*{what}"):
        open_scripted(model, prompt, source)


def test_a_registered_source_is_named_by_its_registry_name_and_origin(model, prompt, monkeypatch):
    class Plugin:
        @hookimpl
        def memra_register_draft_sources(self, register):
            register("scripted", type("Src", (), {"load": lambda self, model, options: Scripted(BAD["none"][0])})())

    monkeypatch.delenv(registry.ALLOW_LIST_ENV, raising=False)
    registry.reset_registry()
    registry.plugin_manager().register(Plugin(), name="scripted-plugin")
    try:
        session = SpecSession(model, prompt, registry.load_drafter("scripted", model), MAX_CTX)
        _, exc, _ = refused_round(session)
        assert str(exc).startswith("draft source 'scripted' (plugin scripted-plugin): propose(k=3) returned None")
    finally:
        registry.reset_registry()
