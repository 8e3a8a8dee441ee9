"""HyperOps.hc_site on the GPU: a whole mHC site, its Sinkhorn mix on a side stream beside the
block (backend/cuda/hyper.py).

* Bit-identical to the ops in sequence (hc_weights, hc_collapse, the block, hc_combine): decode
  rows (t = 1, 7, 15, where the partials are hc_partials' chunks) and a prompt's rows (t = 40: the
  prime GEMM's one chunk; where D allows, the site's collapse moves four channels a thread while
  hc_collapse moves one), n = 3, 4, 8 streams; eagerly and replayed from a graph captured the
  way a walk is (graphs.CapturedWalk: programmatic dependent launch, a private pool).
* Red arm: the join is what orders it. With the side stream held busy by a spinning kernel, a
  site whose hc_combine does not wait for the mix reads a stale comb and differs; the same site
  with the join is bit-identical.
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_hc_site.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda import hyper  # noqa: E402
from memra.backend.cuda.backend import CudaBackend  # noqa: E402
from memra.backend.cuda.graphs import CapturedWalk  # noqa: E402
from memra.backend.cuda.streams import side_stream  # noqa: E402
from tests.backend.inputs import normal, uniform  # noqa: E402

RMS_EPS, HC_EPS = 1e-5, 1e-6
SPIN = cp.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}''', "spin")


@pytest.fixture(scope="module")
def be():
    return CudaBackend()


def site_weights(rng, n, d):
    return (cp.asarray(normal(rng, ((2 + n) * n, n * d), 2.0 / np.sqrt(n * d))),
            cp.asarray(normal(rng, ((2 + n) * n,), 0.5)), cp.asarray(uniform(rng, (3,), 0.5, 1.5)))


def block_of(be, d, rng):
    """A block that launches memra kernels: rmsnorm with a weight, then a scale."""
    w = cp.asarray(uniform(rng, (d,), 0.5, 1.5))
    return lambda x: be.rmsnorm(x, w, RMS_EPS) * np.float32(0.5)


def in_sequence(be, streams, weights, iters, block):
    pre, post, comb = be.hc_weights(streams, *weights, RMS_EPS, HC_EPS, iters)
    return be.hc_combine(streams, block(be.hc_collapse(streams, pre)), post, comb)


@pytest.mark.parametrize("n,d,iters", [(4, 4096, 20), (3, 67, 3), (8, 33, 4), (4, 128, 20)])
@pytest.mark.parametrize("t", [1, 7, 15, 40])
def test_hc_site_is_the_ops_in_sequence_bit_for_bit(be, n, d, iters, t):
    rng = np.random.default_rng(t * 100 + n)
    weights, block = site_weights(rng, n, d), block_of(be, d, rng)
    streams = cp.asarray(normal(rng, (t, n, d)))
    want = cp.asnumpy(in_sequence(be, streams, weights, iters, block))
    got = cp.asnumpy(be.hc_site(streams, *weights, RMS_EPS, HC_EPS, iters, block))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_captured_site_replays_the_ops_in_sequence(be):
    rng = np.random.default_rng(7)
    n, d, iters = 4, 4096, 20
    weights, block = site_weights(rng, n, d), block_of(be, d, rng)
    walk = lambda tokens, pos, streams: (be.hc_site(streams, *weights, RMS_EPS, HC_EPS, iters, block),)
    first = cp.asarray(normal(rng, (1, n, d)))
    captured = CapturedWalk(walk, [0], 0, (first,))
    for _ in range(3):
        streams = cp.asarray(normal(rng, (1, n, d)))
        (got,) = captured.replay([0], 0, (streams,))
        want = in_sequence(be, streams, weights, iters, block)
        assert np.array_equal(cp.asnumpy(got).view(np.uint32), cp.asnumpy(want).view(np.uint32))


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "red_arm_unjoined"])
def test_hc_combine_waits_for_the_side_streams_mix(be, monkeypatch, joined):
    rng = np.random.default_rng(11)
    n, d, iters = 4, 4096, 20
    weights, block = site_weights(rng, n, d), block_of(be, d, rng)
    streams, earlier = cp.asarray(normal(rng, (1, n, d))), cp.asarray(normal(rng, (1, n, d)))
    want = cp.asnumpy(in_sequence(be, streams, weights, iters, block))
    be.hc_site(earlier, *weights, RMS_EPS, HC_EPS, iters, block)  # its comb goes back to the pool
    cp.cuda.Device().synchronize()
    if not joined:
        monkeypatch.setattr(hyper, "join", lambda main, side: None)
    with side_stream(cp.cuda.Device().id, "mix"):
        SPIN((1,), (1,), (np.int64(20_000_000),))  # ~10 ms: the mix runs long after the combine
    got = cp.asnumpy(be.hc_site(streams, *weights, RMS_EPS, HC_EPS, iters, block))
    cp.cuda.Device().synchronize()
    same = np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert same == joined
