"""A draft source that misbehaves in ways a proposal check cannot see: it writes into what a round
hands it, calls sys.exit, raises an exception whose message cannot be read, or declares a max_k
that raises or allows no draft. The tokens stay plain decoding's, or the call is ONE InputError
naming the source (never a traceback of the plugin's own, and never the user's K to blame)."""

import pytest

import memra
from memra.errors import InputError
from memra.speculative.contract import Proposal, label_source
from memra.speculative.session import SpecSession

from .battery import MAX_CTX

K = 3  # model, prompt and tape: tests/speculative/conftest.py


class Oracle:
    """Drafts plain decoding's own continuation (every draft is accepted), then does `after` to
    the round's outcome in commit, or raises `fail` from propose."""

    tap_layers, max_k = (), 14

    def __init__(self, tape, after=None, fail=None):
        self.tape, self.after, self.fail = tape, after, fail

    def begin(self, start):
        return OracleState(self)


class OracleState:
    def __init__(self, source):
        self.source, self.at = source, 0   # the anchor's index in the tape

    def propose(self, k, sampling):
        if self.source.fail is not None:
            raise self.source.fail
        return Proposal(tokens=self.source.tape[self.at + 1:self.at + 1 + k])

    def commit(self, outcome):
        self.at += len(outcome.kept)
        if self.source.after is not None:
            self.source.after(outcome)


def spec_tokens(model, prompt, source, n=24) -> list[int]:
    label_source(source, "draft source 'oracle' (test)")
    session = SpecSession(model, prompt, source, MAX_CTX)
    out = []
    while len(out) < n and not session.done:
        out.extend(session.burst(n - len(out), K)[0])
    return out[:n], session.metrics


def test_a_source_writing_into_its_outcome_changes_no_token(model, prompt, tape):
    def scribble(outcome):
        outcome.drafted[:] = [1] * len(outcome.drafted)
        outcome.kept[:] = [1] * len(outcome.kept)
    tokens, metrics = spec_tokens(model, prompt, Oracle(tape, after=scribble))
    assert metrics.num_accepted_tokens > 0, "no draft was accepted: the scribble had nothing to reach"
    assert tokens == tape[:24]


class Unprintable(Exception):
    def __str__(self):
        raise ZeroDivisionError


@pytest.mark.parametrize("fail, needle", [(SystemExit(3), "raised SystemExit: 3"),
                                          (Unprintable(), "raised Unprintable: (its message could not be read)")])
def test_a_source_that_exits_or_cannot_say_why_is_one_input_error(model, prompt, tape, fail, needle):
    with pytest.raises(InputError) as info:
        spec_tokens(model, prompt, Oracle(tape, fail=fail))
    assert "draft source 'oracle' (test): propose(k=3)" in str(info.value) and needle in str(info.value)
    assert memra.generate(model, prompt, 8).tokens == tape[:8]   # the model is fine after it


class MaxK(Oracle):
    def __init__(self, tape, max_k):
        super().__init__(tape)
        self._max_k = max_k

    @property
    def max_k(self):
        if isinstance(self._max_k, Exception):
            raise self._max_k
        return self._max_k


@pytest.mark.parametrize("max_k, needle", [(RuntimeError("boom"), "reading max_k raised RuntimeError: boom"),
                                           (0, "max_k=0 must be an integer >= 1"),
                                           (-1, "max_k=-1 must be an integer >= 1")])
def test_a_bad_max_k_blames_the_source_not_the_users_k(model, prompt, tape, monkeypatch, max_k, needle):
    from memra.drafters import registry

    source = MaxK(tape, max_k)
    monkeypatch.setattr(registry, "load_drafter", lambda name, model, options: source)
    with pytest.raises(InputError) as info:
        memra.generate(model, prompt, 4, draft="native-mtp", num_draft_tokens=K)
    assert needle in str(info.value) and "num_draft_tokens" not in str(info.value)
