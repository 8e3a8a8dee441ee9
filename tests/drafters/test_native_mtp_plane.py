"""The native-MTP draft plane is reset to the committed boundary every round, pinned by exactness.

Every round's drafts are recomputed from scratch: a fresh MTP plane warmed over the whole
committed tape (pairs (c[i+1], h_i) from one plain trunk forward), then the anchor step and the
chain. The session's proposals must match that reference slot for slot: greedy tokens and their
confidences, and sampled q rows. A state that skips the per-round reset keeps the chain rows in
its plane and feeds the next round's pairs behind them, so its drafts drift from the second
round on (test_a_plane_that_is_not_reset_drafts_wrong is that red arm); the plane itself refuses
to be "reset" past its rows (tests/model/test_mtp.py).
"""

import numpy as np
import pytest

import memra
from memra.speculative.sampling import SamplingParams, filtered_probs
from tests.speculative.battery import (
    Oracle,
    open_session,
    plain_tape,
    prompt_ids,
    run_bursts,
)

K = 3
PROMPT_LEN = 8    # the tape crosses the MTP indexer's dense threshold (11 rows) mid-session
N_TOKENS = 20


@pytest.fixture(scope="module")
def model(fixture_dir):
    return memra.load_model(fixture_dir("mini"), backend="numpy")


def reference_logits(model, committed, anchor, drafts) -> list[np.ndarray]:
    """Draft logits of each slot of a round, from a plane warmed over the committed tape."""
    n = len(committed)
    _, h = model.forward_rows(np.asarray(committed, dtype=np.int64), model.new_cache(n))
    mtp, be = model.mtp, model.be
    plane = mtp.new_plane(n + len(drafts) + 1)
    mtp.warm(np.asarray(committed[1:], dtype=np.int64), h[:-1], plane, 0)
    logits, carrier = mtp(np.asarray([anchor], dtype=np.int64), h[-1:], plane, n - 1)
    rows = [np.asarray(be.to_host(logits[-1]), np.float64)]
    for token in drafts[:-1]:
        logits, carrier = mtp(np.asarray([token], dtype=np.int64), carrier[-1:], plane, plane.length)
        rows.append(np.asarray(be.to_host(logits[-1]), np.float64))
    return rows


def recorded_rounds(session) -> list:
    """(committed, anchor, proposal) of every round, captured around the state's propose."""
    log, propose = [], session.state.propose

    def wrapped(k, sampling):
        before = (list(session.committed), int(session.anchor))
        prop = propose(k, sampling)
        log.append((*before, prop))
        return prop

    session.state.propose = wrapped
    return log


def mismatches(model, log, sampling=None) -> list[str]:
    """Rounds whose proposal differs from the from-scratch reference (greedy: tokens and
    confidences; sampled: the q rows the drafts were drawn from)."""
    bad = []
    for rnd, (committed, anchor, prop) in enumerate(log):
        ref = reference_logits(model, committed, anchor, prop.tokens)
        for slot, row in enumerate(ref):
            if sampling is None:
                z = np.exp(row - row.max())
                ok = int(np.argmax(row)) == prop.tokens[slot] and \
                    np.isclose(z.max() / z.sum(), prop.confidences[slot], rtol=1e-5, atol=0)
            else:
                ok = np.allclose(filtered_probs(row, sampling), prop.q.rows[slot], rtol=1e-5, atol=1e-7)
            if not ok:
                bad.append(f"round {rnd} slot {slot}")
    return bad


def _greedy_session(model, reject_at=None):
    """A greedy native-mtp session; with `reject_at`, drafts are forced (battery.Oracle)."""
    prompt = prompt_ids(model, PROMPT_LEN)
    oracle = None if reject_at is None else Oracle(plain_tape(model, prompt, 64), model.cfg.vocab_size, reject_at)
    return open_session(model, prompt, oracle=oracle), prompt


@pytest.mark.parametrize("pattern", ["accept-j-cycle", "natural"])
def test_every_rounds_drafts_equal_a_plane_warmed_from_scratch(model, pattern):
    """Forced patterns commit 1..K+1 rows per round, so the reset lands at every offset."""
    session, _ = _greedy_session(model, (lambda r: r % (K + 1)) if pattern == "accept-j-cycle" else None)
    log = recorded_rounds(session)
    run_bursts(session, N_TOKENS, K)
    assert len(log) >= 5
    assert mismatches(model, log) == []


def test_sampled_q_rows_equal_the_reference(model):
    sp = SamplingParams(temperature=0.9, top_k=6, seed=5)
    session = open_session(model, prompt_ids(model, PROMPT_LEN), sampling=sp)
    log = recorded_rounds(session)
    run_bursts(session, N_TOKENS, K)
    assert len(log) >= 5
    assert mismatches(model, log, sp) == []


def test_a_plane_that_is_not_reset_drafts_wrong(model, monkeypatch):
    """Red arm of the two tests above: the per-round reset removed (the plane keeps its chain
    rows). The tape stays exact (the target verifies), so only the reference comparison sees it."""
    monkeypatch.setattr(type(model.mtp), "reset_plane", lambda self, plane, length: None)
    session, prompt = _greedy_session(model, lambda r: r % (K + 1))
    log = recorded_rounds(session)
    tokens = run_bursts(session, 12, K)
    assert tokens == plain_tape(model, prompt, 64)[:len(tokens)]
    bad = mismatches(model, log)
    assert bad and bad[0].startswith("round 1"), bad


def test_the_reset_lands_on_the_committed_boundary(model):
    """After each round the plane holds the pairs of the tape before the round; the round's
    kept rows wait as pending pairs (their h comes from the verify walk)."""
    session, _ = _greedy_session(model, lambda r: r % (K + 1))
    for _ in range(6):
        session.burst(1, K)
        state = session.state
        assert state.plane.length == state.committed_len
        assert state.plane.length + len(state.pending_tokens) == len(session.committed)
