"""The plane writes a walk makes at its position (write_rows, kpool_finalize) and the tripwires
around them, on the numpy reference. The CUDA twins take the position from a device buffer so
a captured graph can replay them (tests/backend/test_cuda_dense.py and test_cuda_mla.py,
tests/model/test_walk_graphs.py)."""

import numpy as np
import pytest

from memra import load_model
from memra.backend.numpy_ref import NumpyBackend
from memra.errors import ResidencyError
from memra.model.cache import LatentPlane
from tests.backend.inputs import normal

BE = NumpyBackend()
POOL, DI = 4, 8


def test_write_rows_writes_exactly_the_rows_at_the_position():
    dst = np.zeros((10, 3), np.float32)
    src = normal(np.random.default_rng(0), (4, 3))
    BE.write_rows(dst, src, 5)
    assert np.array_equal(dst[5:9], src)
    assert not dst[:5].any() and not dst[9:].any()


@pytest.mark.parametrize("at, t", [(0, 1), (3, 1), (2, 6), (5, 15), (4, 4), (7, 9)])
def test_kpool_finalize_writes_the_pools_the_rows_complete_and_nothing_else(at, t):
    rng = np.random.default_rng([at, t])
    keys, gates = normal(rng, (32, DI)), normal(rng, (32, DI))
    ape = normal(rng, (POOL, DI), 0.5)
    pool_keys = np.full((32 // POOL + 1, DI), 7.0, np.float32)  # a sentinel in every pool
    BE.kpool_finalize(keys, gates, ape, pool_keys, at, t)
    first, last = at // POOL, (at + t) // POOL
    for j in range(pool_keys.shape[0]):
        if first <= j < last:
            rows = slice(j * POOL, (j + 1) * POOL)
            want = BE.kpool_compress(keys[rows][None], gates[rows][None], ape)[0]
            assert np.array_equal(pool_keys[j], want), f"pool {j}"
        else:
            assert (pool_keys[j] == 7.0).all(), f"pool {j} outside {first}..{last} was written"


def test_residency_tripwire_fires_both_ways():
    plane = LatentPlane(latent=np.zeros((16, 4), np.float32), pool_keys=np.zeros((5, 4), np.float32),
                        length=9, pools_ready=2)
    plane.check(9, POOL, "layer 3")  # in step: silent
    plane.pools_ready = 3
    with pytest.raises(ResidencyError, match="stale"):
        plane.check(9, POOL, "layer 3")
    plane.pools_ready = 1
    with pytest.raises(ResidencyError, match="layer 3: index_pools_ready=1 .* without being finalized"):
        plane.check(9, POOL, "layer 3")


def test_a_walk_leaves_every_indexer_plane_with_exactly_its_complete_pools(fixture_dir):
    model = load_model(fixture_dir("mini"), backend="numpy")
    cache = model.new_cache(64)
    model.prime(np.arange(1, 11), cache)
    for tok in (3, 1, 4):
        model.decode_step(tok, cache)
    for plane in cache.mla.values():
        assert plane.length == 13 and plane.pools_ready == 13 // model.cfg.index_kpool


def test_the_numpy_walk_runner_runs_every_walk_eagerly(fixture_dir):
    model = load_model(fixture_dir("mini"), backend="numpy")
    cache = model.new_cache(32)
    seen = []
    out = cache.walks.run((1, False, ()), lambda tok, at: seen.append((tok.tolist(), at)) or "out",
                          np.array([5]), 9)
    assert out == "out" and seen == [([5], 9)]
