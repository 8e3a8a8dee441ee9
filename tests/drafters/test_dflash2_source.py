"""The `dflash2` draft source end to end: greedy speculative output is the plain greedy tape for
every K, harvest and head combination; the block bound and bad options are refused by name; the
verify windows really truncate; the tap-shift red arm changes the drafts and never the output.

Fixture drafters are random (write_fixture_drafter), so natural acceptance is low; a forced
full-accept run (the gate's draft override) makes every round commit K+1 rows, so the drafter's
context really grows by multi-row verify taps.
"""

import numpy as np
import pytest

from memra.drafters.dflash2 import DFlash2Source
from memra.drafters.dflash2.window import ladder_vt
from memra.errors import CheckpointError, InputError, MemraError
from memra.generate import generate
from memra.speculative.contract import SamplingParams, SparseQ
from memra.speculative.session import GateInstruments, SpecSession

from .dflash2_helpers import TAPS, TRUNKS, drafter_maker

PROMPT_LEN, MAX_CTX, N = 24, 192, 24
VARIANTS = {
    "dflash": {"strategy": "dflash"},
    "dspark": {"strategy": "dspark"},
    "dflash-markov": {"strategy": "dflash", "with_markov": True},
    "dspark-confidence": {"strategy": "dspark", "with_confidence": True},
    "dspark-markov-confidence": {"strategy": "dspark", "with_markov": True, "with_confidence": True},
}


@pytest.fixture(scope="module")
def model(trunk):
    return trunk


@pytest.fixture(scope="module")
def drafter_dir(model, tmp_path_factory):
    return drafter_maker(model, tmp_path_factory, "dflash2", 0, VARIANTS)


@pytest.fixture(scope="module")
def prompt(model):
    return [int(t) for t in np.random.default_rng(7).integers(0, model.cfg.vocab_size, PROMPT_LEN)]


@pytest.fixture(scope="module")
def tape(model, prompt):
    return generate(model, prompt, 64).tokens


def run(session, n: int, k: int) -> list[int]:
    out: list[int] = []
    while len(out) < n and not session.done:
        tokens, _, _ = session.burst(n - len(out), k)
        out.extend(tokens)
    return out


def logged(session) -> list:
    """Every Proposal the session's draft state makes."""
    log, propose = [], session.state.propose

    def wrapped(k, sampling):
        log.append(propose(k, sampling))
        return log[-1]

    session.state.propose = wrapped
    return log


# ---- the tape ------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", range(1, 8))
def test_greedy_tape_is_the_plain_tape_for_every_k(model, drafter_dir, prompt, tape, k):
    result = generate(model, prompt, N, draft="dflash2", num_draft_tokens=k,
                      draft_options={"path": drafter_dir("dflash")})
    assert result.tokens == tape[:N]
    assert result.stats["rounds"] > 0 and result.stats["num_draft_tokens"] > 0


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_harvest_and_head_combination_keeps_the_tape(model, drafter_dir, prompt, tape, variant):
    drafter = DFlash2Source().load(model, {"path": drafter_dir(variant)})
    assert drafter.max_k == (8 if "dspark" in variant else 7), "dspark harvests all b rows"
    for k in (3, drafter.max_k):
        session = SpecSession(model, prompt, drafter, MAX_CTX)
        log = logged(session)
        assert run(session, N, k)[:N] == tape[:N]
        assert all(1 <= len(p.tokens) <= k and p.q is None for p in log)
        assert all(len(p.confidences) == len(p.tokens) and all(0 < c < 1 for c in p.confidences) for p in log)


@pytest.mark.parametrize("variant", ["dflash", "dspark-markov-confidence"])
def test_forced_full_accept_grows_the_drafter_context_by_whole_rounds(model, drafter_dir, prompt, tape, variant):
    """Every draft forced to the tape token: each round commits K+1 verify rows whose taps the
    state ingests before its next block forward (the KV holds exactly the committed rows)."""
    drafter = DFlash2Source().load(model, {"path": drafter_dir(variant), "window": "ladder", "adapt": False})
    k = 5

    def truth(rnd, slot, draft):
        idx = len(session.committed) - PROMPT_LEN + 1 + slot
        return tape[idx] if idx < len(tape) else draft

    session = SpecSession(model, prompt, drafter, MAX_CTX, instruments=GateInstruments(draft_override=truth))
    out = run(session, 40, k)
    assert out == tape[:len(out)] and len(out) >= 40
    m = session.metrics
    assert m.num_accepted_tokens == m.num_draft_tokens == k * m.rounds
    assert session.state.kv.len + sum(len(p[0]) for p in session.state.pending) == len(session.committed)


# ---- bounds and options --------------------------------------------------------------------------
def test_k_past_the_block_is_refused_by_name(model, drafter_dir, prompt):
    path = drafter_dir("dflash")
    with pytest.raises(InputError, match="at most 7"):
        generate(model, prompt, N, draft="dflash2", num_draft_tokens=8, draft_options={"path": path})
    drafter = DFlash2Source().load(model, {"path": path})
    assert drafter.max_k == 7 and drafter.block_size == 8
    state = SpecSession(model, prompt, drafter, MAX_CTX).state
    with pytest.raises(InputError, match=r"block_size 8 makes 7 drafts .* num_draft_tokens <= 7"):
        state.propose(8, None)


def test_missing_or_wrong_path_is_refused(model, drafter_dir, prompt, tmp_path, fixture_dir):
    with pytest.raises(InputError, match="needs the drafter checkpoint"):
        generate(model, prompt, 4, draft="dflash2", draft_options={})
    with pytest.raises(InputError, match="not a directory"):
        generate(model, prompt, 4, draft="dflash2", draft_options={"path": str(tmp_path / "nowhere")})
    with pytest.raises(CheckpointError, match="no config.json"):
        DFlash2Source().load(model, {"path": str(tmp_path)})
    with pytest.raises(MemraError):   # a target checkpoint is not a drafter
        DFlash2Source().load(model, {"path": fixture_dir(model.preset_name, seed=dict(TRUNKS)[model.preset_name])})


@pytest.mark.parametrize("options, match", [
    ({"bogus": 1}, "unknown options"),
    ({"harvest": "shifted"}, "not a harvest convention"),
    ({"window": "static"}, "not a verify-window policy"),
    ({"window": "confidence", "tau": 1.5}, r"\(0, 1\)"),
    ({"window": "confidence-slot", "adapt": False}, "contradictory"),
    ({"window": "confidence"}, "has none"),          # this checkpoint has no confidence head
    ({"tap_shift": 9}, "outside the"),
    ({"tap_shift": "1"}, "must be an integer"),
    ({"precision": "fp8"}, "precision"),
])
def test_bad_options_are_refused_by_name(model, drafter_dir, options, match):
    with pytest.raises(MemraError, match=match):
        DFlash2Source().load(model, {"path": drafter_dir("dflash"), **options})


def test_options_resolve_from_the_checkpoint(model, drafter_dir):
    plain = DFlash2Source().load(model, {"path": drafter_dir("dflash")})
    assert plain.harvest.value == "dflash" and plain.policy.kind == "ladder"
    headed = DFlash2Source().load(model, {"path": drafter_dir("dspark-confidence")})
    assert headed.harvest.value == "dspark", "the strategy census picks the shifted harvest"
    assert (headed.policy.kind, headed.policy.tau) == ("confidence-slot", 0.5), "the head picks the slot window"
    forced = DFlash2Source().load(model, {"path": drafter_dir("dspark-confidence"), "harvest": "dflash",
                                          "window": "confidence", "tau": "0.3"})
    assert forced.harvest.value == "dflash" and forced.max_k == 7
    assert (forced.policy.kind, forced.policy.tau) == ("confidence", 0.3)
    assert plain.tap_layers == TAPS[model.preset_name]


# ---- verify windows ------------------------------------------------------------------------------
def _proposal_lengths(model, prompt, drafter, k: int) -> list[int]:
    session = SpecSession(model, prompt, drafter, MAX_CTX)
    log = logged(session)
    run(session, N, k)
    return [len(p.tokens) for p in log]


def test_confidence_windows_truncate_with_a_high_tau(model, drafter_dir, prompt):
    path, k = drafter_dir("dspark-markov-confidence"), 8
    lengths = {tau: _proposal_lengths(model, prompt, DFlash2Source().load(
        model, {"path": path, "window": "confidence-slot", "tau": tau}), k) for tau in (0.01, 0.99)}
    assert np.mean(lengths[0.99]) < np.mean(lengths[0.01])
    assert max(lengths[0.99]) < k and min(lengths[0.01]) > 1


def test_ladder_carries_the_accepted_run_between_rounds(model, drafter_dir, prompt, tape):
    drafter = DFlash2Source().load(model, {"path": drafter_dir("dflash")})
    k = 6
    session = SpecSession(model, prompt, drafter, MAX_CTX)
    log, accepted = logged(session), []
    commit = session.state.commit
    session.state.commit = lambda outcome: (accepted.append(len(outcome.kept) - 1), commit(outcome))[1]
    assert run(session, N, k)[:N] == tape[:N]
    lengths = [len(p.tokens) for p in log]
    assert lengths[0] == k, "the ladder opens at the cap"
    assert lengths[1:] == [min(k, ladder_vt(m, drafter.max_k + 1) - 1) for m in accepted[:-1]]
    pinned = DFlash2Source().load(model, {"path": drafter_dir("dflash"), "adapt": False})
    assert set(_proposal_lengths(model, prompt, pinned, k)) == {k}


# ---- the tap-shift red arm -----------------------------------------------------------------------
def test_tap_shift_changes_the_drafts_and_never_the_tape(model, drafter_dir, prompt, tape):
    path, k = drafter_dir("dflash"), 4
    drafts, tapes = {}, {}
    for shift in (0, 1):
        drafter = DFlash2Source().load(model, {"path": path, "tap_shift": shift, "adapt": False})
        assert drafter.tap_layers == tuple(t + shift for t in TAPS[model.preset_name])
        session = SpecSession(model, prompt, drafter, MAX_CTX)
        log = logged(session)
        tapes[shift] = run(session, N, k)[:N]
        drafts[shift] = [p.tokens for p in log]
    assert tapes[0] == tapes[1] == tape[:N]
    assert drafts[0] != drafts[1], "wrong features must change what the drafter proposes"


def test_a_mask_embedding_override_moves_the_drafts_not_the_tape(model, drafter_dir, prompt, tape):
    path, k, drafts = drafter_dir("dflash"), 4, []
    for extra in ({}, {"mask_embedding": np.full(model.cfg.hidden_size, 0.5, dtype=np.float32)}):
        session = SpecSession(model, prompt, DFlash2Source().load(model, {"path": path, "adapt": False, **extra}),
                              MAX_CTX)
        log = logged(session)
        assert run(session, N, k)[:N] == tape[:N]
        drafts.append([p.tokens for p in log])
    assert drafts[0] != drafts[1]
    with pytest.raises(InputError, match="mask embedding has shape"):
        DFlash2Source().load(model, {"path": path, "mask_embedding": np.ones(3)})


# ---- sampled proposals ---------------------------------------------------------------------------
def test_sampled_proposals_carry_the_selector_sparse_q(model, drafter_dir, prompt):
    drafter = DFlash2Source().load(model, {"path": drafter_dir("dflash-markov"), "adapt": False})
    session = SpecSession(model, prompt, drafter, MAX_CTX, sampling=SamplingParams(temperature=0.8, seed=3))
    log = logged(session)
    out = run(session, 16, 4)
    assert len(out) >= 16 and all(0 <= t < model.cfg.vocab_size for t in out)
    for p in log:
        assert isinstance(p.q, SparseQ) and p.q.cand.shape == p.q.q_rows.shape == (len(p.tokens), 8)
        np.testing.assert_allclose(p.q.q_rows.sum(axis=1), 1.0)
        assert all(t in p.q.cand[i] and p.q.prob(i, t) > 0 for i, t in enumerate(p.tokens))
    assert session.streams.uctr >= 4 * len(log), "one selector uniform per drafted slot, never reused"
