"""The trunk end to end on the numpy reference: prefill and decode agree, sparse kpool is live."""

import dataclasses

import numpy as np
import pytest

from memra import load_model
from memra.checkpoint import load_checkpoint
from memra.model import trunk
from memra.model.trunk import Glm5Model

TOL = 1e-4  # max |diff| relative to max |logit|


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def _prompt(model, n, seed=7):
    return np.random.default_rng(seed).integers(0, model.cfg.vocab_size, n)


@pytest.fixture(scope="module", params=["mini", "small"])
def model(request, fixture_dir):
    return load_model(fixture_dir(request.param), backend="numpy")


@pytest.mark.parametrize("n_prompt,split", [(8, 3), (64, 5), (64, 40)])
def test_prime_then_decode_matches_prime_of_whole_prompt(model, n_prompt, split):
    p = _prompt(model, n_prompt)
    whole = model.prime(p, model.new_cache(n_prompt))
    cache = model.new_cache(n_prompt)
    logits = model.prime(p[:split], cache)
    for tok in p[split:]:
        logits = model.decode_step(tok, cache)
    assert cache.pos == n_prompt
    assert _rel(logits, whole) <= TOL
    # the reference walk is row-exact, so on numpy the two paths agree bit for bit
    assert np.array_equal(logits, whole)


def test_skipping_a_decode_token_breaks_the_match(model):
    """Red arm of the prefill/decode gate: a chain that drops one token must not pass."""
    p = _prompt(model, 64)
    whole = model.prime(p, model.new_cache(64))
    cache = model.new_cache(64)
    logits = model.prime(p[:40], cache)
    for tok in np.delete(p[40:], 3):
        logits = model.decode_step(tok, cache)
    assert _rel(logits, whole) > TOL


@pytest.mark.parametrize("chunk", [7, 16])
def test_a_prompt_past_prime_chunk_walks_in_chunks_bit_for_bit(model, monkeypatch, chunk):
    """A prompt longer than PRIME_CHUNK walks PRIME_CHUNK rows at a time; the numpy walk is row
    exact, so the logits, collapsed rows, taps and the cache after it equal one walk's."""
    p = _prompt(model, 40)
    caches = [model.new_cache(48) for _ in range(3)]
    whole = model.prime_rows(p, caches[0], tap_layers=(0,))
    monkeypatch.setattr(trunk, "PRIME_CHUNK", chunk)
    parts = model.prime_rows(p, caches[1], tap_layers=(0,))
    assert caches[1].pos == 40 and parts[1].shape == whole[1].shape and parts[2][0].shape == whole[2][0].shape
    assert np.array_equal(parts[0], whole[0]) and np.array_equal(parts[1], whole[1])
    assert np.array_equal(parts[2][0], whole[2][0])
    assert np.array_equal(model.decode_step(3, caches[1]), model.decode_step(3, caches[0]))
    # red arm: the first chunk's tokens reach the last logits (the state crosses the chunks)
    other = model.prime_rows(np.concatenate([[int(p[0]) ^ 1], p[1:]]), caches[2], tap_layers=(0,))
    assert not np.array_equal(other[0], parts[0])


def test_kpool_selection_matters_past_the_dense_threshold(model, fixture_dir):
    """A 64-token prompt is sparse: the same weights with a budget covering every pool differ."""
    cfg = model.cfg
    assert 64 > (cfg.index_pool_budget + 1) * cfg.index_kpool
    p = _prompt(model, 64)
    sparse = model.prime(p, model.new_cache(64))
    dense_cfg = dataclasses.replace(cfg, index_topk=64 * cfg.index_kpool)
    dense_model = _same_weights(fixture_dir, model, dense_cfg)
    dense = dense_model.prime(p, dense_model.new_cache(64))
    assert _rel(sparse, dense) > 10 * TOL
    # below the threshold the budget is irrelevant
    short = p[: (cfg.index_pool_budget + 1) * cfg.index_kpool - 1]
    a = model.prime(short, model.new_cache(64))
    b = dense_model.prime(short, dense_model.new_cache(64))
    assert np.array_equal(a, b)


def _same_weights(fixture_dir, model, cfg):
    name = "mini" if model.cfg.vocab_size == 32 else "small"
    return Glm5Model(cfg, load_checkpoint(fixture_dir(name), model.cfg), model.be)


def test_logits_are_well_spread_and_finite(model):
    logits = model.prime(_prompt(model, 16), model.new_cache(16))
    assert np.isfinite(logits).all()
    assert 0.5 < float(logits.std()) < 20.0


def test_bf16_fixture_runs_close_to_f32(fixture_dir):
    """bf16 weights widen in the loader; the model runs and stays near the f32 twin's scale."""
    m = load_model(fixture_dir("mini", dtype="bfloat16"), backend="numpy")
    logits = m.prime(_prompt(m, 12), m.new_cache(12))
    assert np.isfinite(logits).all() and logits.dtype == np.float32
