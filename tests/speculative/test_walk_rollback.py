"""The verify walk and its rollback against the plain decode chain (the W and A gates).

W: row r of a t-row `verify_rows` walk is bit-identical to the plain decode step that consumes
token r from the same primed state, for t = 1..15, and the walk leaves the planes exactly where
t decode steps would (cache.pos unmoved). A: after `rollback(keep = j + 1)` the cache is the
never-drafted cache and every later decode step is bit-identical, across kpool pool boundaries.
Red arms beside them: a stale KDA state must diverge, an unclamped pool count must trip the
residency wire by name.
"""

import numpy as np
import pytest

from memra.errors import InputError, ResidencyError
from memra.limits import VERIFY_CAP

from .battery import (
    POOL,
    PROMPT_LEN,
    collapsed_chain,
    decode_chain,
    full_state,
    host,
    indexer_planes,
    live_state,
    model_fixture,
    primed,
    prompt_ids,
    state_diff,
)

model = model_fixture("numpy")

K = 7
CONTINUATION_LEN = 6  # > P: every continuation crosses at least one pool boundary


def _tokens(model, n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, model.cfg.vocab_size, n)]


def _walk_rows(model, prompt, n, seed=11):
    """[anchor, drafts...]: row 0 is the token the plain chain would consume next."""
    _, logits = primed(model, prompt)
    return [int(np.argmax(logits))] + _tokens(model, n - 1, seed)


# ---- W: the walk is the decode chain -------------------------------------------------------------
@pytest.fixture(scope="module")
def chain(model):
    """The never-drafted reference for VERIFY_CAP rows: logits, collapsed rows and the live cache
    state after each step."""
    prompt = prompt_ids(model)
    rows = _walk_rows(model, prompt, VERIFY_CAP)
    cache, _ = primed(model, prompt)
    states = [live_state(model, cache)]
    logits = []
    for tok in rows:
        logits.append(decode_chain(model, cache, [tok])[0])
        states.append(live_state(model, cache))
    collapsed = collapsed_chain(model, primed(model, prompt)[0], rows)
    return {"prompt": prompt, "rows": rows, "logits": np.stack(logits), "collapsed": collapsed,
            "states": states}


@pytest.mark.parametrize("t", range(1, VERIFY_CAP + 1))
def test_verify_rows_are_bit_identical_to_the_plain_decode_chain(model, chain, t):
    cache, _ = primed(model, chain["prompt"])
    logits, collapsed, ckpt = model.verify_rows(chain["rows"][:t], cache)
    assert logits.shape == (t, model.cfg.vocab_size)
    assert np.array_equal(host(model, logits), chain["logits"][:t])
    assert np.array_equal(host(model, collapsed), chain["collapsed"][:t])
    assert cache.pos == PROMPT_LEN and ckpt.pos == PROMPT_LEN and ckpt.rows == t
    assert all(plane.length == PROMPT_LEN + t for plane in cache.mla.values())
    # every plane (KDA rings and states, latent rows, finalized pool keys) sits where t steps put it
    assert state_diff(live_state(model, cache), chain["states"][t], ignore=("pos",)) == []


@pytest.mark.parametrize("t", [1, 8, VERIFY_CAP])
def test_verify_greedy_targets_are_the_plain_chain_argmaxes(model, chain, t):
    """The greedy session's walk: the same walk, each row's argmax taken where the logits are."""
    cache, _ = primed(model, chain["prompt"])
    targets, collapsed, ckpt = model.verify_greedy(chain["rows"][:t], cache)
    want = np.argmax(chain["logits"][:t], axis=-1).tolist()
    assert targets == want and all(type(x) is int for x in targets)
    assert np.array_equal(host(model, collapsed), chain["collapsed"][:t]) and ckpt.rows == t
    if t == VERIFY_CAP:  # non-vacuous: the rows disagree, so a row-shifted target list would fail
        assert len(set(want)) > 1 and targets[1:] != want[:-1]


def test_decode_greedy_is_the_argmax_of_decode_step(model, chain):
    greedy, _ = primed(model, chain["prompt"])
    plain, _ = primed(model, chain["prompt"])
    for tok in chain["rows"][:4]:
        got = model.decode_greedy(tok, greedy)
        assert type(got) is int and got == int(np.argmax(model.decode_step(tok, plain)))
    assert greedy.pos == plain.pos and state_diff(live_state(model, greedy), live_state(model, plain)) == []


def test_the_walk_finalizes_pools_completed_by_drafted_rows(model, chain):
    """The premise of the pool-key clamp: a walk from a pool boundary over 8 rows finalizes the
    pools its (drafted) rows complete."""
    cache, _ = primed(model, chain["prompt"])
    assert PROMPT_LEN % POOL == 0
    before = {i: p.pools_ready for i, p in indexer_planes(cache).items()}
    model.verify_rows(chain["rows"][:8], cache)
    assert indexer_planes(cache)
    for i, plane in indexer_planes(cache).items():
        assert before[i] == PROMPT_LEN // POOL
        assert plane.pools_ready == (PROMPT_LEN + 8) // POOL


@pytest.mark.parametrize("bad", ["empty", "t=16", "id=vocab", "id=-1", "late id=vocab", "bool id"])
def test_verify_rows_refuses_bad_walks_and_leaves_the_cache_untouched(model, chain, bad):
    vocab, anchor = model.cfg.vocab_size, chain["rows"][0]
    rows = {
        "empty": [],
        "t=16": (chain["rows"] + chain["rows"])[:VERIFY_CAP + 1],
        "id=vocab": [vocab],
        "id=-1": [anchor, -1],
        "late id=vocab": [anchor, 1, 2, vocab],
        "bool id": [anchor, True],
    }[bad]
    cache, _ = primed(model, chain["prompt"])
    before = full_state(model, cache)
    with pytest.raises(InputError):
        model.verify_rows(rows, cache)
    assert state_diff(full_state(model, cache), before) == []


def test_a_second_walk_without_rollback_trips_the_residency_wire(model, chain):
    """Planes ahead of cache.pos (a missed rollback) are refused before anything is written."""
    cache, _ = primed(model, chain["prompt"])
    _, _, ckpt = model.verify_rows(chain["rows"][:4], cache)
    before = full_state(model, cache)
    with pytest.raises(ResidencyError):
        model.verify_rows(chain["rows"][:4], cache)
    assert state_diff(full_state(model, cache), before) == []
    model.rollback(cache, ckpt, 4)  # the first walk's checkpoint is still good
    assert state_diff(live_state(model, cache), chain["states"][4]) == []


# ---- A: accept j, roll back, continue ------------------------------------------------------------
def _accept_then_continue(model, prompt_len, keep, stale_kda=False, snapshot_shift=0):
    """Walk K+1 rows, roll back to `keep`, decode a continuation. Returns the spec cache, the
    never-drafted cache, both continuations' logits, and the post-walk pool counts."""
    prompt = prompt_ids(model, prompt_len)
    rows = _walk_rows(model, prompt, K + 1)
    cont = _tokens(model, CONTINUATION_LEN, seed=29)
    cache, _ = primed(model, prompt)
    walk_logits, _, ckpt = model.verify_rows(rows, cache)
    walked = {i: p.pools_ready for i, p in indexer_planes(cache).items()}
    kda_after_walk = {i: (st.ring.copy(), st.state.copy()) for i, st in cache.kda.items()}
    model.rollback(cache, ckpt, keep)
    if stale_kda:  # red arm: the restore never happened
        for i, (ring, state) in kda_after_walk.items():
            cache.kda[i].ring[...] = ring
            cache.kda[i].state[...] = state
    for part in cache.kda_parts if snapshot_shift else ():  # red arm: the snapshot of another row
        part.restore(keep + snapshot_shift, model.be)
    ref, _ = primed(model, prompt)
    kept_logits = decode_chain(model, ref, rows[:keep])
    assert np.array_equal(host(model, walk_logits)[:keep], kept_logits)
    return {
        "cache": cache, "ref": ref, "walked": walked, "cont": cont,
        "rolled": live_state(model, cache), "ref_rolled": live_state(model, ref),
    }


@pytest.mark.parametrize("j", range(K + 1))
def test_accept_j_then_continue_is_the_never_drafted_chain(model, j):
    keep = j + 1
    run = _accept_then_continue(model, PROMPT_LEN, keep)
    cache, ref = run["cache"], run["ref"]
    assert cache.pos == PROMPT_LEN + keep
    assert state_diff(run["rolled"], run["ref_rolled"]) == []
    for plane in indexer_planes(cache).values():
        assert plane.pools_ready == (PROMPT_LEN + keep) // POOL
    spec = decode_chain(model, cache, run["cont"])
    plain = decode_chain(model, ref, run["cont"])
    assert np.array_equal(spec, plain)
    assert state_diff(live_state(model, cache), live_state(model, ref)) == []


@pytest.mark.parametrize("prompt_len,keep", [(24, 4), (24, 5), (26, 1), (26, 2)],
                         ids=["on-boundary", "past-boundary", "drafted-row-completes-pool",
                              "kept-row-completes-pool"])
def test_rollback_at_a_pool_boundary_clamps_and_recomputes_drafted_pool_keys(model, prompt_len, keep):
    """The walk finalized pools that drafted rows completed; rollback must clamp them and the
    continuation must recompute them from the kept rows (the stale keys differ)."""
    run = _accept_then_continue(model, prompt_len, keep)
    cache, ref = run["cache"], run["ref"]
    length = prompt_len + keep
    planes = indexer_planes(cache)
    stale = {}
    for i, plane in planes.items():
        assert run["walked"][i] == (prompt_len + K + 1) // POOL > length // POOL
        assert plane.pools_ready == length // POOL
        stale[i] = host(model, plane.pool_keys)[length // POOL].copy()
    spec = decode_chain(model, cache, run["cont"])
    plain = decode_chain(model, ref, run["cont"])
    assert np.array_equal(spec, plain)
    assert state_diff(live_state(model, cache), live_state(model, ref)) == []
    for i, plane in planes.items():
        assert plane.pools_ready > length // POOL
        assert not np.array_equal(host(model, plane.pool_keys)[length // POOL], stale[i])


@pytest.mark.parametrize("bad", ["keep=0", "keep=t+1", "keep=True", "keep=2.0", "spent ckpt",
                                 "ckpt of another cache", "not a ckpt"])
def test_rollback_refuses_bad_requests_and_leaves_the_cache_untouched(model, bad):
    prompt = prompt_ids(model)
    rows = _walk_rows(model, prompt, K + 1)
    cache, _ = primed(model, prompt)
    _, _, ckpt = model.verify_rows(rows, cache)
    target, keep, use = cache, {"keep=0": 0, "keep=t+1": K + 2, "keep=True": True,
                                "keep=2.0": 2.0}.get(bad, 3), ckpt
    if bad == "spent ckpt":
        model.rollback(cache, ckpt, 3)
    elif bad == "ckpt of another cache":
        target, _ = primed(model, prompt)
        model.verify_rows(rows, target)
    elif bad == "not a ckpt":
        use = {"pos": ckpt.pos, "rows": ckpt.rows}
    before = full_state(model, target)
    with pytest.raises(InputError):
        model.rollback(target, use, keep)
    assert state_diff(full_state(model, target), before) == []
    if bad != "spent ckpt":  # the refusal did not spend the real checkpoint
        model.rollback(cache, ckpt, 3)
    assert cache.pos == PROMPT_LEN + 3


# ---- red arms ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arm", ["restored", "stale", "next_row_snapshot", "previous_row_snapshot"])
def test_kda_restore_is_what_makes_the_continuation_exact(model, arm):
    """Green: rollback copies the kept rows' KDA rings and states back from the walk's per-row
    snapshots. Red: put back the post-walk rings and states, or the snapshot one row after or
    before the kept one (an off-by-one index); the continuation must diverge."""
    shift = {"next_row_snapshot": 1, "previous_row_snapshot": -1}.get(arm, 0)
    run = _accept_then_continue(model, PROMPT_LEN, keep=3, stale_kda=arm == "stale", snapshot_shift=shift)
    diff = state_diff(run["rolled"], run["ref_rolled"])
    spec = decode_chain(model, run["cache"], run["cont"])
    plain = decode_chain(model, run["ref"], run["cont"])
    if arm == "restored":
        assert diff == [] and np.array_equal(spec, plain)
    else:
        assert diff and all(key.startswith("kda") for key in diff)  # only KDA is stale
        assert not np.array_equal(spec, plain)


@pytest.mark.parametrize("arm", ["clamped", "unclamped"])
def test_unclamped_pool_keys_trip_the_residency_wire_by_name(model, arm):
    """Green: the clamped cache decodes exactly. Red: put a plane's index_pools_ready back to
    its post-walk value; the next decode_step must refuse by name, writing nothing."""
    run = _accept_then_continue(model, PROMPT_LEN, keep=3)
    cache, ref = run["cache"], run["ref"]
    if arm == "clamped":
        assert np.array_equal(decode_chain(model, cache, run["cont"][:1]),
                              decode_chain(model, ref, run["cont"][:1]))
        return
    i, plane = next(iter(indexer_planes(cache).items()))
    assert run["walked"][i] > plane.pools_ready
    plane.pools_ready = run["walked"][i]
    before = full_state(model, cache)
    with pytest.raises(ResidencyError, match="index_pools_ready"):
        model.decode_step(run["cont"][0], cache)
    assert state_diff(full_state(model, cache), before) == []
