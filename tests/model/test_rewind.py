"""`model.rewind(cache, ckpt)`: a verify walk undone entirely, right after the walk or right after
its rollback. The cache must be the never-walked cache (every live array bit-identical, the next
decode steps bit-identical), and a checkpoint the cache has moved past is refused by name with
the cache left as it was. Red arm beside the green: a walk left in place is seen by the check.
"""

import numpy as np
import pytest

from memra.errors import InputError
from tests.speculative.battery import (
    PROMPT_LEN, decode_chain, full_state, live_state, model_fixture, primed, prompt_ids, state_diff,
)

model = model_fixture("numpy")

T = 8  # crosses two kpool pool boundaries from PROMPT_LEN (pool 4): pool keys are finalized and clamped


def _rows(model, seed=3):
    return [int(t) for t in np.random.default_rng(seed).integers(0, model.cfg.vocab_size, T)]


def _assert_never_walked(model, cache, prompt):
    ref, _ = primed(model, prompt)
    assert state_diff(live_state(model, cache), live_state(model, ref)) == []
    follow = _rows(model, seed=9)[:5]
    assert np.array_equal(decode_chain(model, cache, follow), decode_chain(model, ref, follow))


@pytest.mark.parametrize("keep", [None, 1, 3, T], ids=["no rollback", "keep=1", "keep=3", "keep=t"])
def test_rewind_returns_the_cache_to_where_the_walk_found_it(model, keep):
    prompt = prompt_ids(model)
    cache, _ = primed(model, prompt)
    _, _, ckpt = model.verify_rows(_rows(model), cache)
    if keep is not None:
        model.rollback(cache, ckpt, keep)
    model.rewind(cache, ckpt)
    assert cache.pos == PROMPT_LEN
    _assert_never_walked(model, cache, prompt)


def test_a_walk_left_in_place_is_seen_by_the_check(model):
    """Red arm: rollback(keep=1) alone leaves the anchor row committed; the check must say so."""
    prompt = prompt_ids(model)
    cache, _ = primed(model, prompt)
    _, _, ckpt = model.verify_rows(_rows(model), cache)
    model.rollback(cache, ckpt, 1)
    with pytest.raises(AssertionError):
        _assert_never_walked(model, cache, prompt)


@pytest.mark.parametrize("bad", ["twice", "rollback after rewind", "a second walk", "walk after rollback",
                                 "ckpt of another cache", "not a ckpt"])
def test_rewind_refuses_a_checkpoint_the_cache_moved_past(model, bad):
    prompt = prompt_ids(model)
    cache, _ = primed(model, prompt)
    rows = _rows(model)
    _, _, ckpt = model.verify_rows(rows, cache)
    target, use, call = cache, ckpt, model.rewind
    if bad == "twice":
        model.rewind(cache, ckpt)
    elif bad == "rollback after rewind":
        model.rewind(cache, ckpt)
        call = lambda c, k: model.rollback(c, k, 1)  # noqa: E731
    elif bad == "a second walk":
        model.rollback(cache, ckpt, 2)
        model.verify_rows(rows[2:], cache)  # the planes are past the rollback now
    elif bad == "walk after rollback":
        model.rollback(cache, ckpt, T)
        model.decode_step(rows[0], cache)   # pos past ckpt.pos + t
    elif bad == "ckpt of another cache":
        target, _ = primed(model, prompt)
    elif bad == "not a ckpt":
        use = {"pos": ckpt.pos, "rows": ckpt.rows}
    before = full_state(model, target)
    with pytest.raises(InputError, match="rewind|rollback"):
        call(target, use)
    assert state_diff(full_state(model, target), before) == []


def test_each_parts_restore_goes_through_the_caches_runner_keyed_by_part_and_keep(model):
    """What the CUDA runner captures per key: every KDA part's restore, keyed (part, keep), a
    rewind as keep 0; none for a rollback that keeps every row (nothing to restore)."""
    class Recorded(type(model.be.walks())):
        def __init__(self, be):
            super().__init__(be)
            self.keys = []

        def steps(self, key, fn):
            self.keys.append(key)
            super().steps(key, fn)

    cache, _ = primed(model, prompt_ids(model))
    cache.walks = Recorded(model.be)
    firsts = [part.layers[0] for part in cache.kda_parts]
    assert firsts, "the fixture has KDA layers"
    for keep in (3, T):
        _, _, ckpt = model.verify_rows(_rows(model), cache)
        model.rollback(cache, ckpt, keep)
        model.rewind(cache, ckpt)
    assert cache.walks.keys == [("restore", f, k) for k in (3, 0, 0) for f in firsts]
