"""End-to-end tapes (the E gate): speculative greedy output is the plain greedy tape, byte for byte.

Natural native-MTP drafts for K = 1..7 and 14; forced full acceptance and a forced-rejection
sweep that cycles every partial keep (through the GateInstruments draft override, with the
per-round counts checked so the pattern really happened); burst splits; EOS; the context guard;
demotion to plain decoding; a draft source the core never saw. Red arms beside their green arms:
rollback disabled must break the tape or raise, and a skipped FR-Spec d2t remap must change the
drafts while the tape stays identical (the silent failure made loud).
"""

import numpy as np
import pytest

from memra.drafters.registry import load_drafter
from memra.errors import InputError, MemraError
from memra.generate import generate
from memra.speculative.contract import Proposal
from memra.speculative.session import GateInstruments, SpecSession

from .battery import (
    MAX_CTX,
    PROMPT_LEN,
    Oracle,
    first_new_token_index,
    model_fixture,
    open_session,
    plain_tape,
    proposal_log,
    round_log,
    run_bursts,
    tape_or_error,
)

model = model_fixture("numpy")

N = 32


@pytest.fixture(scope="module")
def tape(model, prompt):
    return plain_tape(model, prompt, 100)


def _oracle(model, tape, pattern, k):
    """The draft override for a named pattern (round -> the slot that gets a wrong draft);
    None for natural drafts."""
    reject_at = {
        "natural": None,
        "full-accept": lambda r: None,
        "cycle": lambda r: r % (k + 1),
        "reject-slot-1": lambda r: 1,
    }[pattern]
    return None if reject_at is None else Oracle(tape, model.cfg.vocab_size, reject_at)


# ---- natural drafts ------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 14])
def test_native_mtp_drafts_keep_the_plain_tape(model, prompt, tape, k):
    result = generate(model, prompt, N, draft="native-mtp", num_draft_tokens=k)
    assert result.tokens == tape[:N]
    stats = result.stats
    assert stats["num_drafts"] == stats["rounds"] > 0
    assert stats["num_draft_tokens"] == k * stats["num_drafts"]


# ---- forced acceptance patterns ------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 4, 7, 14])
def test_forced_full_accept_keeps_the_tape_and_really_accepts_everything(model, prompt, tape, k):
    session = open_session(model, prompt, oracle=_oracle(model, tape, "full-accept", k))
    log = round_log(session)
    out = run_bursts(session, 40, k)
    assert out[:40] == tape[:40] and out == tape[:len(out)]
    m = session.metrics
    assert log and all(entry == (k, k) for entry in log)
    assert m.num_accepted_tokens == m.num_draft_tokens == k * m.rounds
    assert m.accepted_per_pos == [m.rounds] * k
    assert m.mean_acceptance_length == k + 1


@pytest.mark.parametrize("k", [3, 7])
def test_forced_rejection_sweep_cycles_every_partial_keep(model, prompt, tape, k):
    """Round r rejects at slot r % (K+1) (slot K: full accept), two full cycles, one round per
    burst so each burst's counts are one round's."""
    session = open_session(model, prompt, oracle=_oracle(model, tape, "cycle", k))
    out, _, _ = session.burst(1, k)  # the prime's boundary token, no round
    rounds = 2 * (k + 1)
    per_round = []
    for _ in range(rounds):
        tokens, drafted, accepted = session.burst(1, k)
        assert drafted == k and len(tokens) == accepted + 1
        per_round.append(accepted)
        out.extend(tokens)
    expected = [r % (k + 1) for r in range(rounds)]
    assert per_round == expected
    assert out == tape[:len(out)] and len(out) == 1 + sum(j + 1 for j in expected)
    m = session.metrics
    assert (m.rounds, m.num_drafts, m.num_draft_tokens) == (rounds, rounds, rounds * k)
    assert m.num_accepted_tokens == sum(expected)
    assert m.accepted_per_pos == [sum(j > p for j in expected) for p in range(k)]
    assert m.mean_acceptance_length == 1 + sum(expected) / rounds


@pytest.mark.parametrize("pattern", ["natural", "cycle"])
def test_burst_split_does_not_change_the_tape(model, prompt, tape, pattern):
    k, n = 4, 40

    def session():
        return open_session(model, prompt, oracle=_oracle(model, tape, pattern, k))

    one = run_bursts(session(), n, k)
    many = run_bursts(session(), n, k, sizes=(1, 2, 3, 4, 5))
    assert one[:n] == many[:n] == tape[:n]


# ---- EOS and the context guard -------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 4])
def test_generate_stops_right_after_the_first_eos_like_greedy(model, prompt, tape, k):
    i = first_new_token_index(tape)
    eos = (tape[i],)
    spec = generate(model, prompt, 60, draft="native-mtp", num_draft_tokens=k, eos=eos)
    assert spec.tokens == generate(model, prompt, 60, eos=eos).tokens == tape[:i + 1]


def test_eos_as_the_first_token_ends_generation_at_once(model, prompt, tape):
    spec = generate(model, prompt, 20, draft="native-mtp", num_draft_tokens=3, eos=(tape[0],))
    assert spec.tokens == generate(model, prompt, 20, eos=(tape[0],)).tokens == tape[:1]
    assert spec.stats["rounds"] == 0


def test_eos_inside_a_fully_accepted_round_ends_the_session(model, prompt, tape):
    """The round that commits EOS may carry accepted drafts past it (the caller clips); no
    further round runs and the next burst is empty."""
    k = 7
    i = first_new_token_index(tape)
    session = open_session(model, prompt, oracle=_oracle(model, tape, "full-accept", k))
    out, _, _ = session.burst(60, k, eos=(tape[i],))
    assert out == tape[:len(out)] and i < len(out) <= i + 1 + k
    assert session.done
    assert session.burst(10, k, eos=(tape[i],)) == ([], 0, 0)


@pytest.mark.parametrize("pattern", ["natural", "full-accept"])
def test_the_context_guard_ends_a_session_without_error(model, prompt, tape, pattern):
    k, max_ctx = 4, PROMPT_LEN + 16
    session = open_session(model, prompt, max_ctx=max_ctx, oracle=_oracle(model, tape, pattern, k))
    out = run_bursts(session, 100, k)
    assert session.done and 1 < len(out) < 100
    assert out == tape[:len(out)]
    assert session.cache.pos + k + 2 > max_ctx
    assert session.burst(5, k) == ([], 0, 0)


def test_a_session_without_room_for_one_round_is_refused(model, prompt):
    with pytest.raises(InputError, match="max_ctx"):
        open_session(model, prompt, max_ctx=PROMPT_LEN + 3)


@pytest.mark.parametrize("k", [0, 15, True])
def test_k_outside_the_verify_cap_is_refused_before_anything_moves(model, prompt, k):
    session = open_session(model, prompt)
    with pytest.raises(InputError, match="k="):
        session.burst(4, k)
    assert session.cache.pos == PROMPT_LEN and not session.anchor_emitted
    if k == 15:
        with pytest.raises(InputError):
            generate(model, prompt, 8, draft="native-mtp", num_draft_tokens=k)


# ---- demotion ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern,k,sizes", [
    ("natural", 3, (1,)), ("natural", 3, (5, 3)), ("cycle", 4, (7, 4)),
    ("full-accept", 3, (9,)), ("reject-slot-1", 5, (6, 6, 6)),
], ids=["anchor-only", "natural", "cycle", "full-accept", "reject-slot-1"])
def test_demote_hands_plain_decoding_the_exact_continuation(model, prompt, tape, pattern, k, sizes):
    session = open_session(model, prompt, oracle=_oracle(model, tape, pattern, k))
    out = []
    for size in sizes:
        out.extend(session.burst(size, k)[0])
    cache, token = session.demote()
    assert cache.pos == PROMPT_LEN + len(out)
    stream = out + [token]
    for _ in range(6):  # crosses a kpool pool boundary
        token = int(np.argmax(model.decode_step(token, cache)))
        stream.append(token)
    assert stream == tape[:len(stream)]
    assert session.burst(4, k) == ([], 0, 0)


# ---- red arm: rollback disabled --------------------------------------------------------------------
ROLLBACK_CONFIGS = [("cycle", 4), ("reject-slot-1", 2), ("natural", 3)]


@pytest.mark.parametrize("pattern,k", ROLLBACK_CONFIGS, ids=[p for p, _ in ROLLBACK_CONFIGS])
@pytest.mark.parametrize("arm", ["rollback", "no-rollback"])
def test_rollback_is_what_keeps_the_tape(model, prompt, tape, arm, pattern, k):
    """Green: the tape is plain. Red (GateInstruments(disable_rollback=True)) with rejections:
    the tape differs from plain or a MemraError is raised, never byte-identical-and-green."""
    instruments = GateInstruments(disable_rollback=arm == "no-rollback")
    session = open_session(model, prompt, oracle=_oracle(model, tape, pattern, k), instruments=instruments)
    kind, value = tape_or_error(lambda: run_bursts(session, N, k)[:N])
    if arm == "rollback":
        assert (kind, value) == ("tape", tape[:N])
    else:
        assert session.metrics.num_accepted_tokens < session.metrics.num_draft_tokens  # rejections ran
        assert kind == "error" or value != tape[:N]


def test_disabled_rollback_with_nothing_to_roll_back_stays_plain(model, prompt, tape):
    """Control for the red arm: under forced full acceptance rollback has nothing to undo, so
    the instrument alone changes nothing; its bite above comes from the rejections."""
    session = open_session(model, prompt, oracle=_oracle(model, tape, "full-accept", 3),
                           instruments=GateInstruments(disable_rollback=True))
    assert run_bursts(session, N, 3)[:N] == tape[:N]


# ---- red arm: FR-Spec d2t remap skipped --------------------------------------------------------------
def _trim(model, tape, kind):
    vocab = model.cfg.vocab_size
    if kind == "reversed":  # a permutation with no fixed point (vocab is even)
        return list(range(vocab))[::-1]
    return sorted(set(tape) | set(range(0, vocab, 3)))  # a subset holding every tape token


def _trimmed_run(model, prompt, d2t, skip, k=3):
    drafter = load_drafter("native-mtp", model, {"d2t": d2t})
    drafter.skip_d2t_remap = skip
    session = open_session(model, prompt, drafter=drafter)
    proposals = proposal_log(session)
    out = run_bursts(session, N, k)[:N]
    return out, [list(p.tokens) for p in proposals]


@pytest.mark.parametrize("trim", ["reversed", "subset"])
def test_fr_spec_trim_keeps_the_tape_and_a_skipped_remap_changes_only_the_drafts(model, prompt, tape, trim):
    d2t = _trim(model, tape, trim)
    out, drafts = _trimmed_run(model, prompt, d2t, skip=False)
    assert out == tape[:N]
    assert all(t in set(d2t) for round_ in drafts for t in round_)
    red_out, red_drafts = _trimmed_run(model, prompt, d2t, skip=True)
    assert red_out == tape[:N]            # every exactness gate stays green...
    assert red_drafts != drafts           # ...while the drafts are rank ids, not tokens
    assert all(0 <= t < len(d2t) for round_ in red_drafts for t in round_)


def test_a_permutation_trim_drafts_what_the_full_head_drafts(model, prompt, tape):
    session = open_session(model, prompt)
    proposals = proposal_log(session)
    run_bursts(session, N, 3)
    full = [list(p.tokens) for p in proposals]  # the trimmed run below also bursts N with k=3
    _, trimmed = _trimmed_run(model, prompt, _trim(model, tape, "reversed"), skip=False)
    assert trimmed == full


@pytest.mark.parametrize("d2t", ["id=vocab", "id=-1", "empty", "2-D", "floats"])
def test_d2t_outside_the_vocab_is_refused(model, d2t):
    vocab = model.cfg.vocab_size
    ids = {"id=vocab": [0, 1, vocab], "id=-1": [-1, 0], "empty": [], "2-D": [[0, 1]],
           "floats": [0.0, 1.0]}[d2t]
    with pytest.raises(InputError):
        load_drafter("native-mtp", model, {"d2t": ids})


def test_unknown_drafter_options_and_sources_are_refused(model):
    with pytest.raises(InputError, match="unknown options"):
        load_drafter("native-mtp", model, {"d2t": [0], "tau": 1})
    with pytest.raises(InputError, match="unknown draft source"):
        load_drafter("no-such-source", model)


# ---- a draft source the core never saw ---------------------------------------------------------------
class EchoSource:
    """Drafts the last emitted token k times; `bad_round` proposes an out-of-vocab id once."""

    max_k, tap_layers = 14, ()

    def __init__(self, vocab, bad_round=None):
        self.vocab, self.bad_round = vocab, bad_round

    def begin(self, start):
        return EchoState(self, start.anchor)


class EchoState:
    def __init__(self, source, last):
        self.source, self.last, self.rounds = source, last, 0

    def propose(self, k, sampling):
        if self.rounds == self.source.bad_round:
            self.source.bad_round = None
            return Proposal(tokens=[self.last, self.source.vocab][:k])
        return Proposal(tokens=[self.last] * k)

    def commit(self, outcome):
        self.last, self.rounds = outcome.bonus, self.rounds + 1


def test_a_draft_source_the_core_never_saw_keeps_the_tape(model, prompt, tape):
    session = SpecSession(model, prompt, EchoSource(model.cfg.vocab_size), MAX_CTX)
    out = run_bursts(session, 64, 5)
    assert out[:64] == tape[:64]


def test_a_refused_round_leaves_the_session_whole(model, prompt, tape):
    """An out-of-vocab draft is refused before the verify: the cache, the committed stream and
    the anchor are as the last good round left them, and the session continues exactly."""
    source = EchoSource(model.cfg.vocab_size, bad_round=2)
    session = SpecSession(model, prompt, source, MAX_CTX)
    out = []
    for _ in range(3):  # the anchor, round 0, round 1
        out.extend(session.burst(1, 3)[0])
    pos, committed, anchor = session.cache.pos, list(session.committed), session.anchor
    with pytest.raises(InputError, match="outside the vocab"):
        session.burst(1, 3)
    assert (session.cache.pos, session.committed, session.anchor) == (pos, committed, anchor)
    session.cache.check_planes()
    out.extend(run_bursts(session, 40, 3))
    assert out == tape[:len(out)]


def test_a_refused_round_mid_burst_loses_no_committed_tokens(model, prompt, tape):
    session = SpecSession(model, prompt, EchoSource(model.cfg.vocab_size, bad_round=2), MAX_CTX)
    out = []
    with pytest.raises(MemraError):
        out.extend(session.burst(20, 3)[0])  # anchor, rounds 0 and 1, then the refusal
    out.extend(run_bursts(session, 20, 3))
    assert out == tape[:len(out)]


def test_demote_before_the_first_burst_is_refused_so_the_anchor_is_not_lost(model, prompt):
    session = SpecSession(model, prompt, load_drafter("native-mtp", model), MAX_CTX)
    with pytest.raises(InputError, match="burst"):
        session.demote()
    assert session.burst(1, 2)[0]  # the session is intact
