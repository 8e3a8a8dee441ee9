"""A cache is bound to the model that made it.

Two models with an identical config (here: the same preset with other weights, and the very same
checkpoint loaded twice) are different models: planes written under one model's weights are
garbage under the other's. Every entry that reads or moves a cache (prime, decode_step,
verify_rows, rollback, rewind, forward_rows) refuses another model's cache by the call's name,
and the refused call leaves the cache exactly as it was.
"""

from __future__ import annotations

import numpy as np
import pytest

import memra
from memra.errors import InputError

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def models(fixture_dir):
    """(owner, a twin with other weights, the owner's checkpoint loaded again)."""
    path = fixture_dir("small", seed=0)
    return (memra.load_model(path, backend="numpy"), memra.load_model(fixture_dir("small", seed=1), backend="numpy"),
            memra.load_model(path, backend="numpy"))


def planes(cache) -> bytes:
    """Every byte and counter of the cache, to compare before and after a refusal."""
    parts = [str(cache.pos).encode()]
    for st in cache.kda.values():
        parts += [np.asarray(st.ring).tobytes(), np.asarray(st.state).tobytes()]
    for plane in cache.mla.values():
        parts += [str((plane.length, plane.pools_ready)).encode(), np.asarray(plane.latent).tobytes()]
    return b"".join(parts)


CALLS = {
    "prime": lambda m, cache, ckpt: m.prime([7, 8], cache),
    "decode_step": lambda m, cache, ckpt: m.decode_step(7, cache),
    "verify_rows": lambda m, cache, ckpt: m.verify_rows([7, 8, 9], cache),
    "rollback": lambda m, cache, ckpt: m.rollback(cache, ckpt, 1),
    "rewind": lambda m, cache, ckpt: m.rewind(cache, ckpt),
    "forward_rows": lambda m, cache, ckpt: m.forward_rows(np.asarray([7], dtype=np.int64), cache),
}


@pytest.mark.parametrize("other", ["other weights", "same checkpoint loaded again"])
@pytest.mark.parametrize("call", list(CALLS))
def test_another_models_cache_is_refused_by_the_calls_name_and_left_as_it_was(models, call, other):
    owner, twin = models[0], models[1] if other == "other weights" else models[2]
    assert twin.cfg == owner.cfg  # the old check compared configs: it let these through
    cache = owner.new_cache(32)
    owner.prime(PROMPT, cache)
    _, _, ckpt = owner.verify_rows([5, 6], cache)  # rows written, pos not moved: rollback/rewind have work
    before = planes(cache)
    with pytest.raises(InputError, match=rf"^{call}: this cache was made by another model"):
        CALLS[call](twin, cache, ckpt)
    assert planes(cache) == before
    # the owner carries on exactly as a cache that never met the twin
    owner.rollback(cache, ckpt, 1)
    fresh = owner.new_cache(32)
    owner.prime(PROMPT, fresh)
    owner.decode_step(5, fresh)
    assert owner.decode_step(7, cache).tobytes() == owner.decode_step(7, fresh).tobytes()


def test_a_cache_records_the_model_that_made_it(models):
    owner, twin, _ = models
    cache = owner.new_cache(16)
    assert cache.owner is owner and twin.new_cache(16).owner is twin
    assert owner.prime(PROMPT, cache).shape == (owner.cfg.vocab_size,)  # the green arm


@pytest.mark.parametrize("call", ["prime", "decode_step", "verify_rows"])
def test_something_that_is_not_a_cache_is_named(models, call):
    with pytest.raises(InputError, match=rf"^{call}: expected a cache from model.new_cache"):
        CALLS[call](models[0], {"pos": 0}, None)
