"""CUDA graphs of the decode and verify walks (GPU host only).

* A replayed walk is the eager walk, bit for bit: greedy decoding with graphs on and off gives
  identical logits at every step, across pool boundaries and the dense -> sparse kpool threshold,
  on two caches decoding in turn.
* Verify walks of t = 1..15 rows (with the KDA snapshots and a tap) replay bit-identically, and a
  rollback from a replayed walk leaves every state plane as the eager one does. A rollback's
  restore replays a graph per keep once that keep is seen twice, with the eager one's bits.
* The walks really replay: a captured graph per shape once a shape is seen twice; a prefill
  never is captured.
* Red arms: a replay that keeps the captured position instead of uploading the new one breaks
  the identity, so the comparison can fail; so does replaying one keep's restore for another.
"""

import numpy as np
import pytest

from tests.gpu import cupy_or_skip, stale_position_walks

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra import load_model  # noqa: E402
from memra.backend.cuda import dense  # noqa: E402
from memra.backend.cuda.graphs import WalkGraphs  # noqa: E402
from tests.speculative.battery import live_state  # noqa: E402

STEPS = 40  # from position 9: ten pool boundaries (P = 4) and the dense -> sparse switch


@pytest.fixture(scope="module", params=[("mini", 0, "float32"), ("small", 13, "bfloat16")])
def model(request, fixture_dir):
    name, seed, dtype = request.param
    return load_model(fixture_dir(name, seed=seed, dtype=dtype), backend="cuda")


def _prompt(model, n, seed):
    return np.random.default_rng(seed).integers(0, model.cfg.vocab_size, n)


def _cache(model, graphs: bool, walks=None):
    cache = model.new_cache(128)
    cache.walks = walks if walks is not None else WalkGraphs(enabled=graphs)
    return cache


def _greedy(model, caches_prompts, steps=STEPS):
    """Greedy decode several caches in turn -> one [steps + 1, V] logits stack per cache."""
    logits = [[model.prime(p, c)] for c, p in caches_prompts]
    for _ in range(steps):
        for (cache, _), out in zip(caches_prompts, logits):
            out.append(model.decode_step(int(np.argmax(out[-1])), cache))
    return [np.stack(out) for out in logits]


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def test_graph_decoding_is_eager_decoding_bit_for_bit_on_two_caches_in_turn(model):
    prompts = [_prompt(model, 9, 1), _prompt(model, 13, 2)]
    eager = _greedy(model, [(_cache(model, False), p) for p in prompts])
    caches = [_cache(model, True) for _ in prompts]
    graphed = _greedy(model, list(zip(caches, prompts)))
    for cache in caches:
        assert list(cache.walks.graphs) == [(1, False, ())], "the decode walk was not captured"
        assert cache.walks.captures == 1
    for e, g in zip(eager, graphed):
        assert _same(e, g)


def test_one_graph_serves_walks_on_both_sides_of_the_long_list_length_with_the_eager_bits(model, monkeypatch):
    """LONG_LIST lowered to 6 (mini and small select index_topk 8): from position 5 on every list
    holds 6 positions and the scores take the wider tile, chosen on the device (both tiles are
    launched, each guarded, and one returns at once: tests/backend/test_cuda_mla.py). The decode
    walk is captured once, before the switch, and replays across it with the eager bits."""
    from benchmarks.common import counted_launches
    from memra.backend.cuda import mla

    monkeypatch.setattr(mla, "LONG_LIST", 6)
    prompt = _prompt(model, 2, 5)
    eager = _greedy(model, [(_cache(model, False), prompt)], steps=8)
    cache = _cache(model, True)
    with counted_launches() as launches:
        graphed = _greedy(model, [(cache, prompt)], steps=8)
    assert list(cache.walks.graphs) == [(1, False, ())] and cache.walks.captures == 1
    assert launches["mla.mla_scores_h1p1"] and launches["mla.mla_scores_h2p2"]  # both guarded tiles
    assert _same(eager[0], graphed[0])


def test_a_captured_walk_owns_its_split_k_counters(model):
    """A graph's projection groups count split-K tiles on counters the graph owns, so capturing
    walks (a cache's, a session's) pins no per-stream buffer; the counters are 0 between replays."""
    before = dict(dense._COUNTERS)
    cache = _cache(model, True)
    _greedy(model, [(cache, _prompt(model, 9, 4))])
    (captured,) = cache.walks.graphs.values()
    assert dense._COUNTERS.keys() == before.keys()
    assert not captured.counters.any()


def test_a_prefill_is_never_captured(model):
    cache = _cache(model, True)
    model.prime(_prompt(model, 12, 3), cache)
    assert cache.walks.graphs == {} and cache.walks.seen == set()


@pytest.mark.parametrize("t", [1, 2, 5, 8, 15])
def test_replayed_verify_walks_and_their_rollbacks_are_the_eager_ones(model, t):
    """Four rounds (eager, capture, replay, replay), each rolled back to a different keep."""
    prompt, tap = _prompt(model, 10, t), (1,)
    runs = {}
    for graphs in (False, True):
        cache = _cache(model, graphs)
        model.prime(prompt, cache)
        rng = np.random.default_rng(t)
        rounds = []
        for keep in (t, 1, (t + 1) // 2, t):
            tokens = rng.integers(0, model.cfg.vocab_size, t)
            logits, collapsed, ckpt = model.verify_rows(tokens, cache, tap_layers=tap)
            rounds.append((logits, cp.asnumpy(collapsed), cp.asnumpy(ckpt.taps[1])))
            model.rollback(cache, ckpt, keep)
            rounds.append(live_state(model, cache))
        runs[graphs] = rounds
        if graphs:
            assert (t, True, tap) in cache.walks.graphs
    for eager, graphed in zip(runs[False], runs[True]):
        assert _same(eager, graphed)


RESTORE_KEEPS = (2, 2, 2, 2, 4, 4, 4)  # per keep: eager, capture, replays


def _rolled_back(model, walks, keeps=RESTORE_KEEPS, t=5):
    """Verify walks of t rows, each rolled back to its keep -> every state plane after each."""
    cache = _cache(model, True, walks=walks)
    model.prime(_prompt(model, 10, 7), cache)
    rng, states = np.random.default_rng(7), []
    for keep in keeps:
        _, _, ckpt = model.verify_rows(rng.integers(0, model.cfg.vocab_size, t), cache)
        model.rollback(cache, ckpt, keep)
        states.append(live_state(model, cache))
    return states, cache


def test_replayed_rollbacks_are_the_eager_ones(model):
    eager, _ = _rolled_back(model, WalkGraphs(enabled=False))
    graphed, cache = _rolled_back(model, WalkGraphs())
    first = cache.kda_parts[0].layers[0]
    assert set(cache.walks.fixed) == {("restore", first, 2), ("restore", first, 4)}
    for e, g in zip(eager, graphed):
        assert _same(e, g)


def test_red_arm_replaying_one_keeps_restore_for_another_breaks_the_identity(model):
    class OneRestore(WalkGraphs):
        def steps(self, key, fn):
            super().steps(key[:2], fn)  # the keep left out of the key

    eager, _ = _rolled_back(model, WalkGraphs(enabled=False))
    wrong, _ = _rolled_back(model, OneRestore())
    assert _same(tuple(eager[:4]), tuple(wrong[:4]))  # keep 2 throughout: eager, capture, replays
    assert not _same(eager[4], wrong[4])  # keep 4 replays keep 2's restore


def test_red_arm_a_replay_at_a_stale_position_breaks_the_identity(model):
    prompt = _prompt(model, 9, 1)
    eager = _greedy(model, [(_cache(model, False), prompt)])[0]
    stale = _greedy(model, [(_cache(model, True, walks=stale_position_walks()), prompt)])[0]
    assert np.array_equal(eager[:3], stale[:3])  # eager, eager-before-capture, capture
    assert not _same(eager, stale)


def test_replayed_mtp_draft_steps_are_the_eager_ones(model):
    """The native-mtp draft chain: a first step of 3 rows, then t = 1 steps fed their own carrier
    (eager, capture, replays), on a graph runner and without one: the same bits throughout. With
    last_only (what native-mtp runs) each step's one row is the last row of the call over every
    row, bit for bit, replayed too."""
    if model.mtp is None:
        pytest.skip("this preset has no MTP block")
    prompt = _prompt(model, 12, 4)
    cache = model.new_cache(64)
    _, collapsed, _ = model.prime_rows(prompt, cache)
    runs = {}
    for walks, last_only in ((None, False), (WalkGraphs(), False), (WalkGraphs(), True)):
        plane = model.mtp.new_plane(64)
        model.mtp.warm(prompt[1:9], collapsed[:8], plane, 0)
        tokens, h, out = prompt[9:12], collapsed[8:11], []
        for step in range(6):
            logits, carrier = model.mtp(tokens, h, plane, plane.length, walks=walks, last_only=last_only)
            out.append((cp.asnumpy(logits), cp.asnumpy(carrier)))
            tokens, h = [int(np.argmax(out[-1][0][-1]))], carrier[-1:]
        runs[walks is None, last_only] = out
        if walks is not None:
            assert set(walks.graphs) == {(1, last_only)}  # the 3-row step ran once: eager only
    assert _same(tuple(runs[True, False]), tuple(runs[False, False]))
    assert _same(tuple((lg[-1:], c[-1:]) for lg, c in runs[True, False]), tuple(runs[False, True]))
