"""Rounds are transactions: a fault injected at EVERY place the core calls into a draft source
(max_k and tap_layers reads, begin, propose, commit; q.truncate / q.prob / q.full in the sampled
walk) or into the target mid-round (verify_rows, rollback) never leaves the cache, the session
and the source out of step. After each fault the session either continues (the fault came before
anything moved) or refuses further bursts until demote(); either way the tokens are the plain
greedy tape and the cache equals, bit for bit, a fresh plain run over the same tokens. Sampled
sessions: a fault is undone so completely (cache, counters) that the session's tokens equal a
fault-free session's with the same seed. Also: demote with no room is refused.
"""

import re
from collections import Counter

import numpy as np
import pytest

from memra.drafters.registry import load_drafter
from memra.errors import InputError
from memra.speculative.contract import DenseQ, Proposal, SparseQ, label_source
from memra.speculative.sampling import SamplingParams
from memra.speculative.session import GateInstruments, SpecSession

from .battery import MAX_CTX, Oracle, decode_chain, live_state, model_fixture, primed, state_diff

model = model_fixture("numpy")

N, K, SIZE = 30, 3, 5
LABEL = "draft source 'faulty' (test)"


class Injected(RuntimeError):
    pass


class Faulty:
    """Wraps a drafter and raises Injected at call number `at` (from 0) of `site`. "-after"
    sites raise after the wrapped call ran (the source's state has moved), others before.
    At each propose it snapshots the session as the round found it."""

    def __init__(self, inner, site: str, at: int):
        self.inner, self.site, self.at = inner, site, at
        self.calls, self.fired, self.session, self.round_start = Counter(), 0, None, None

    def tick(self, site: str) -> None:
        n = self.calls[site]
        self.calls[site] += 1
        if site == self.site and n == self.at:
            self.fired += 1
            raise Injected(f"injected fault at {site} call {n}")

    @property
    def max_k(self):
        self.tick("max_k")
        return self.inner.max_k

    @property
    def tap_layers(self):
        self.tick("tap_layers")
        return self.inner.tap_layers

    def begin(self, start):
        self.tick("begin")
        return FaultyState(self, self.inner.begin(start))


class FaultyState:
    def __init__(self, owner: Faulty, inner):
        self.owner, self.inner = owner, inner

    def propose(self, k, sampling):
        s = self.owner.session
        if s is not None:
            self.owner.round_start = snapshot(s)
        self.owner.tick("propose")
        prop = self.inner.propose(k, sampling)
        self.owner.tick("propose-after")
        return prop

    def commit(self, outcome):
        self.owner.tick("commit")
        self.inner.commit(outcome)
        self.owner.tick("commit-after")


def snapshot(session) -> dict:
    counters = None if session.streams is None else (session.streams.sctr, session.streams.uctr)
    return {"cache": live_state(session.model, session.cache), "committed": list(session.committed),
            "anchor": session.anchor, "counters": counters}


def assert_as_the_round_found_it(session, before: dict) -> None:
    after = snapshot(session)
    assert state_diff(after["cache"], before["cache"]) == []
    assert (after["committed"], after["anchor"], after["counters"]) == \
           (before["committed"], before["anchor"], before["counters"])


def open_faulty(model, prompt, tape, site, at, inner=None, sampling=None, reject=True):
    inner = inner or load_drafter("native-mtp", model)
    faulty = Faulty(inner, site, at)
    label_source(faulty, LABEL)
    oracle = Oracle(tape, model.cfg.vocab_size, lambda r: r % (K + 1)) if reject else None
    instruments = GateInstruments(draft_override=oracle)
    session = SpecSession(model, prompt, faulty, MAX_CTX, instruments=instruments, sampling=sampling)
    if oracle is not None:
        oracle.bind(session)   # every partial keep 0..K, so rollback keeps vary round to round
    faulty.session = session
    return faulty, session


def drive(model, session, n: int):
    """Burst to n tokens the way a careful caller would: a refused round is retried once; a
    session that refuses again, or says it stopped, is demoted and finished with plain greedy
    steps. -> (tokens, the cache the tokens went through, how it ended)."""
    got, refusals = [], 0
    while len(got) < n and not session.done:
        try:
            tokens = session.burst(SIZE, K)[0]
        except Exception as exc:  # the fault itself, or the session's refusal
            refusals += 1
            if refusals < 2 and "this session stopped" not in str(exc):
                continue
            if session.undelivered:
                got.extend(session.burst(1, K)[0])
            cache, token = session.demote()
            got.append(token)
            while len(got) < n:
                token = int(np.argmax(model.decode_step(token, cache)))
                got.append(token)
            return got, cache, "demoted"
        got.extend(tokens)
    return got, session.cache, "speculative"


def assert_plain(model, prompt, tape, got, cache) -> None:
    """The tokens are the tape, and the cache is bit for bit a fresh plain run's over them."""
    assert got[:N] == tape[:N]
    consumed = cache.pos - len(prompt)
    ref, _ = primed(model, prompt, MAX_CTX)
    decode_chain(model, ref, tape[:consumed])
    assert state_diff(live_state(model, cache), live_state(model, ref)) == []


# ---- greedy: every hook call site --------------------------------------------------------------------
ROUND_SITES = [("propose", 0), ("propose", 3), ("propose-after", 2), ("commit", 0), ("commit", 3),
               ("commit-after", 0), ("commit-after", 4)]


@pytest.mark.parametrize("site,at", ROUND_SITES, ids=[f"{s}-{a}" for s, a in ROUND_SITES])
def test_a_fault_at_a_round_hook_keeps_the_plain_greedy_tape(model, prompt, tape, site, at):
    faulty, session = open_faulty(model, prompt, tape, site, at)
    got, cache, how = drive(model, session, N)
    assert faulty.fired == 1
    assert_plain(model, prompt, tape, got, cache)
    # a failed commit stops the session (the source is out of step); a failed propose moved
    # nothing, and only a source that cannot propose twice in a row ends up demoted
    assert how == ("demoted" if site.startswith(("commit", "propose-after")) else "speculative")


def burst_until_fault(session) -> tuple[list[int], BaseException]:
    """Burst until a burst raises: (the tokens returned before it, what it raised)."""
    out = []
    for _ in range(40):
        try:
            out.extend(session.burst(SIZE, K)[0])
        except Exception as exc:
            return out, exc
    raise AssertionError("the fault never fired")


@pytest.mark.parametrize("site", ["commit", "commit-after"])
def test_a_failed_commit_undoes_the_round_and_stops_the_session(model, prompt, tape, site):
    faulty, session = open_faulty(model, prompt, tape, site, 4)
    out, exc = burst_until_fault(session)
    assert isinstance(exc, InputError)
    msg = str(exc)
    assert msg.startswith(f"this session stopped: {LABEL}: commit raised Injected: injected fault at {site}")
    assert "call demote()" in msg and "\n" not in msg
    assert_as_the_round_found_it(session, faulty.round_start)
    out.extend(session.burst(N, K)[0])          # what the failed burst committed before the fault
    with pytest.raises(InputError, match="this session stopped: .*call demote"):
        session.burst(N, K)
    assert faulty.calls["propose"] == 5          # no round ran after the failure
    cache, token = session.demote()
    assert out + [token] == tape[:len(out) + 1]


@pytest.mark.parametrize("site", ["propose", "propose-after"])
def test_a_failed_propose_moves_nothing(model, prompt, tape, site):
    faulty, session = open_faulty(model, prompt, tape, site, 4)
    _, exc = burst_until_fault(session)
    assert isinstance(exc, InputError)
    assert str(exc).startswith(f"{LABEL}: propose(k=3) raised Injected: injected fault at {site} call 4")
    assert_as_the_round_found_it(session, faulty.round_start)
    assert session.stopped is None


# ---- greedy: the declarations and begin ----------------------------------------------------------------
@pytest.mark.parametrize("site", ["max_k", "tap_layers", "begin"])
def test_a_fault_while_opening_refuses_the_session_naming_the_source(model, prompt, tape, site):
    with pytest.raises(InputError, match=rf"^{re.escape(LABEL)}: .*{site}.*Injected") as err:
        open_faulty(model, prompt, tape, site, 0)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("site", ["max_k", "tap_layers"])
def test_declarations_are_read_once_so_a_later_fault_cannot_reach_a_round(model, prompt, tape, site):
    faulty, session = open_faulty(model, prompt, tape, site, 1)
    got, cache, how = drive(model, session, N)
    assert faulty.calls[site] == 1 and not faulty.fired and how == "speculative"
    assert_plain(model, prompt, tape, got, cache)


# ---- greedy: the target mid-round ----------------------------------------------------------------------
def _fail_on(monkeypatch, model, method: str, at: int, after: bool):
    """Make model.<method> raise Injected on call `at`, before or after the real call ran."""
    real, calls = getattr(model, method), Counter()

    def wrapped(*args, **kwargs):
        n = calls["n"]
        calls["n"] += 1
        if n == at and not after:
            raise Injected(f"{method} failed")
        out = real(*args, **kwargs)
        if n == at:
            raise Injected(f"{method} failed after running")
        return out

    monkeypatch.setattr(model, method, wrapped)
    return calls


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_a_failed_rollback_is_rewound_and_the_session_continues(model, prompt, tape, monkeypatch, after):
    faulty, session = open_faulty(model, prompt, tape, "none", 0, inner=EchoDrafter())
    calls = _fail_on(monkeypatch, model, "rollback", 3, after)
    got, cache, how = drive(model, session, N)
    assert calls["n"] > 4 and how == "speculative"
    assert_plain(model, prompt, tape, got, cache)


def test_a_verify_walk_that_fails_midway_stops_even_demote(model, prompt, tape, monkeypatch):
    faulty, session = open_faulty(model, prompt, tape, "none", 0, inner=EchoDrafter())
    _fail_on(monkeypatch, model, "verify_greedy", 4, after=True)  # a greedy session's walk
    out, exc = burst_until_fault(session)
    assert isinstance(exc, InputError) and "could not be rewound" in str(exc) and session.cache_lost
    out.extend(session.burst(N, K)[0])
    assert out == tape[:len(out)]                # what came before the failed walk is kept and right
    for call in (lambda: session.burst(N, K), session.demote):
        with pytest.raises(InputError, match="Injected: verify_greedy failed after running.*could not be rewound"
                                             ".*open a new session"):
            call()


# ---- sampled: the q methods the walk calls, and the hooks ---------------------------------------------
class EchoDrafter:
    """Stateless: drafts the last emitted token (greedy), or (sampled) draws each slot from a
    two-token distribution around it, returning that q as a DenseQ or a SparseQ."""

    max_k, tap_layers = 14, ()

    def __init__(self, kind: str = "dense"):
        self.kind = kind

    def begin(self, start):
        return EchoDraftState(self, start)


class EchoDraftState:
    def __init__(self, drafter, start):
        self.kind, self.vocab, self.last = drafter.kind, start.model.cfg.vocab_size, start.anchor

    def propose(self, k, sampling):
        if sampling is None:
            return Proposal(tokens=[self.last] * k)
        pair = [self.last, (self.last + 1) % self.vocab]
        row = np.zeros(self.vocab)
        row[pair] = [0.6, 0.4]
        tokens = [sampling.draw(row) for _ in range(k)]
        q = DenseQ(np.tile(row, (k, 1))) if self.kind == "dense" else \
            SparseQ(np.tile(pair, (k, 1)), np.tile([0.6, 0.4], (k, 1)))
        return Proposal(tokens=tokens, q=q)

    def commit(self, outcome):
        self.last = outcome.bonus


SAMPLED = SamplingParams(temperature=1.0, seed=11)
Q_SITES = [(kind, method, at) for kind in ("dense", "sparse") for method, at in
           (("truncate", 2), ("prob", 5), ("full", 1))]


def _sampled_run(model, prompt, tape, kind, site="none"):
    faulty, session = open_faulty(model, prompt, tape, site, 2, inner=EchoDrafter(kind), sampling=SAMPLED,
                                  reject=False)
    return faulty, session


@pytest.mark.parametrize("kind,method,at", Q_SITES, ids=[f"{k}-{m}" for k, m, _ in Q_SITES])
def test_a_fault_in_the_sampled_walk_is_undone_to_the_bit(model, prompt, tape, monkeypatch, kind, method, at):
    _, ref = _sampled_run(model, prompt, tape, kind)
    want = drive(model, ref, N)[0]
    cls = DenseQ if kind == "dense" else SparseQ
    real, calls = getattr(cls, method), Counter()

    def faulty_method(self, *args):
        calls["n"] += 1
        if calls["n"] == at + 1:
            raise Injected(f"{cls.__name__}.{method} failed")
        return real(self, *args)

    monkeypatch.setattr(cls, method, faulty_method)
    faulty, session = _sampled_run(model, prompt, tape, kind)
    out, exc = burst_until_fault(session)
    assert isinstance(exc, Injected) and calls["n"] == at + 1
    assert_as_the_round_found_it(session, faulty.round_start)
    monkeypatch.setattr(cls, method, real)
    got = drive(model, session, N)[0]
    assert (out + got)[:N] == want[:N]   # the same random numbers drawn again: the same tokens


@pytest.mark.parametrize("site", ["propose", "commit-after"])
def test_a_sampled_session_after_a_hook_fault(model, prompt, tape, site):
    faulty, session = _sampled_run(model, prompt, tape, "sparse", site)
    _, exc = burst_until_fault(session)
    assert isinstance(exc, InputError) and LABEL in str(exc)
    assert_as_the_round_found_it(session, faulty.round_start)
    if site == "propose":   # nothing moved: the session goes on
        assert session.burst(SIZE, K)[0]
        return
    session.burst(SIZE, K)  # what the failed burst committed before the fault
    with pytest.raises(InputError, match="open a new session \\(a sampled session cannot demote\\)"):
        session.burst(N, K)
    with pytest.raises(InputError, match="sampled sessions stay speculative"):
        session.demote()


# ---- demote ------------------------------------------------------------------------------------------
def test_demote_twice_is_refused(model, prompt, tape):
    _, session = open_faulty(model, prompt, tape, "none", 0, inner=EchoDrafter())
    session.burst(SIZE, K)
    cache, _ = session.demote()
    pos = cache.pos
    with pytest.raises(InputError, match="already demoted"):
        session.demote()
    assert cache.pos == pos


@pytest.mark.parametrize("k", [1, 4])
def test_demote_with_no_room_is_refused_and_the_context_guard_keeps_room(model, prompt, tape, k):
    max_ctx = len(prompt) + 12
    session = SpecSession(model, prompt, EchoDrafter(), max_ctx)
    out = []
    while not session.done:
        out.extend(session.burst(4, k)[0])
    # green arm: the guard ends a session with room for the anchor, so demote continues the tape
    assert session.cache.pos + 1 <= max_ctx
    state = live_state(model, session.cache)
    # red arm: a cache filled to max_ctx behind the session's back (the guard never allows it)
    full_pos = session.cache.pos
    session.cache.pos = max_ctx
    with pytest.raises(InputError, match=rf"demote: no room to commit the anchor \(pos {max_ctx} \+ 1 > "
                                         rf"max_ctx {max_ctx}\)"):
        session.demote()
    session.cache.pos = full_pos
    assert state_diff(live_state(model, session.cache), state) == [] and not session.demoted
    cache, token = session.demote()
    assert out + [token] == tape[:len(out) + 1]
