"""The NextN/MTP block: rows over its own latent plane, fed by the trunk's collapsed rows."""

import numpy as np
import pytest

from memra import load_model
from memra.errors import ResidencyError


@pytest.fixture(scope="module")
def model(fixture_dir):
    return load_model(fixture_dir("small"), backend="numpy")


def _trunk_rows(model, n):
    tokens = np.random.default_rng(3).integers(0, model.cfg.vocab_size, n + 1)
    _, collapsed = model.forward_rows(tokens[:n], model.new_cache(n))
    return tokens, collapsed


def test_mtp_rows_in_one_call_equal_rows_one_at_a_time(model):
    n = 30  # past the dense threshold, so the MTP block's own kpool indexer selects
    tokens, h = _trunk_rows(model, n)
    plane = model.mtp.new_plane(n)
    logits, carrier = model.mtp(tokens[1:n + 1], h, plane, 0)
    assert logits.shape == (n, model.cfg.vocab_size) and carrier.shape == (n, model.cfg.hidden_size)
    solo = model.mtp.new_plane(n)
    for i in range(n):
        row_logits, row_carrier = model.mtp(tokens[i + 1:i + 2], h[i:i + 1], solo, i)
        assert np.array_equal(row_logits[0], logits[i])
        assert np.array_equal(row_carrier[0], carrier[i])
    assert plane.pools_ready == n // model.cfg.index_kpool


def test_a_last_row_draft_step_is_the_last_row_of_the_call_over_every_row(model):
    """last_only (native-mtp's draft steps): the MoE, norm and head run on the last row alone,
    with that row's bits, and the plane takes every row as before. Red arm: the row before it
    is another row, so the comparison can fail."""
    n = 9
    tokens, h = _trunk_rows(model, n)
    every, last = model.mtp.new_plane(n), model.mtp.new_plane(n)
    logits, carrier = model.mtp(tokens[1:n + 1], h, every, 0)
    one_logits, one_carrier = model.mtp(tokens[1:n + 1], h, last, 0, last_only=True)
    assert one_logits.shape == (1, model.cfg.vocab_size) and one_carrier.shape == (1, model.cfg.hidden_size)
    assert np.array_equal(one_logits, logits[-1:]) and np.array_equal(one_carrier, carrier[-1:])
    assert not np.array_equal(one_logits, logits[-2:-1])
    assert every.length == last.length == n and np.array_equal(every.latent, last.latent)


def test_mtp_depends_on_both_the_token_and_the_hidden_row(model):
    tokens, h = _trunk_rows(model, 4)
    base, _ = model.mtp(tokens[1:5], h, model.mtp.new_plane(4), 0)
    other_tok, _ = model.mtp((tokens[1:5] + 1) % model.cfg.vocab_size, h, model.mtp.new_plane(4), 0)
    other_h, _ = model.mtp(tokens[1:5], h[::-1].copy(), model.mtp.new_plane(4), 0)
    assert not np.allclose(base, other_tok) and not np.allclose(base, other_h)


def test_mini_has_its_mtp_block(fixture_dir):
    m = load_model(fixture_dir("mini"), backend="numpy")
    assert m.mtp is not None and m.cfg.num_nextn_predict_layers == 1


def test_plane_reset_shortens_clamps_pool_keys_and_refuses_to_grow(model):
    n, pool = 14, model.cfg.index_kpool
    tokens, h = _trunk_rows(model, n)
    plane = model.mtp.new_plane(n + 4)
    model.mtp(tokens[1:n + 1], h, plane, 0)
    assert (plane.length, plane.pools_ready) == (n, n // pool)
    model.mtp.reset_plane(plane, 5)
    assert (plane.length, plane.pools_ready) == (5, 5 // pool)   # stale pool keys go with the rows
    for bad in (6, n, -1, 2.0, True):
        with pytest.raises(ResidencyError, match="only ever shortens"):
            model.mtp.reset_plane(plane, bad)
        assert (plane.length, plane.pools_ready) == (5, 5 // pool), "a refused reset moves nothing"
    # red arm: the bare truncate under the reset "grows" a plane over rows it never wrote
    plane.truncate(n, pool)
    assert plane.length == n
