"""The mHC family on the GPU (HyperOps, backend/cuda/hyper.py -> kernels_cu/hyper.cu): the
hyper-connection site's weights (fn matvec, softmax, Sinkhorn), collapse, combine, the whole
site (hc_site), stream mean.

The table (preset-like sizes: mini, small, odd) runs through the shared gates of
tests/backend/harness.py. hc_collapse / hc_combine / stream_mean repeat the reference's
operations in its order with no transcendental, so their bound is 0. Red arms: a matvec whose
split count grows with t (32 t slices) fails the row gate while a fixed 32-slice split passes,
and a one-ulp change of one row is caught.
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_hyper.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda.hyper import HyperOps  # noqa: E402
from tests.backend.harness import NUMPY, OpGates, RedArm, SplitDot, dot_case, table  # noqa: E402
from tests.backend.inputs import normal, uniform  # noqa: E402

# op -> (rtol, atol) against NumpyBackend: CUDA expf (a few ulp) and the fixed GPU reduction
# orders (block tree over fixed chunks) against numpy's.
TOL = {
    "hc_weights": (2e-5, 2e-6),   # 512-long matvec, softmax, 20 Sinkhorn rounds
    # hc_weights' error carried through the combine: terms up to ~5 (normal streams, f = x / 2 + 1)
    # that may cancel, so the absolute bound is 2e-5 of such a term
    "hc_site": (2e-5, 1e-4),
    "hc_collapse": (0.0, 0.0),    # same ops, same order, no transcendental: bit-equal
    "hc_combine": (0.0, 0.0),
    "stream_mean": (0.0, 0.0),
}


def _hc_weights(n, d, iters):
    def make(rng, t):
        shared = {"fn": normal(rng, ((2 + n) * n, n * d), 2.0 / np.sqrt(n * d)),
                  "base": normal(rng, ((2 + n) * n,), 0.5), "scale": uniform(rng, (3,), 0.5, 1.5)}
        return {"streams": normal(rng, (t, n, d))}, shared

    def call(be, r, s):
        return be.hc_weights(r["streams"], s["fn"], s["base"], s["scale"], 1e-5, 1e-6, iters)
    return make, call


def _hc_site(n, d, iters):
    make, _ = _hc_weights(n, d, iters)

    def call(be, r, s):
        return be.hc_site(r["streams"], s["fn"], s["base"], s["scale"], 1e-5, 1e-6, iters,
                          lambda x: x * np.float32(0.5) + np.float32(1.0))
    return make, call


def _hc_collapse(n, d):
    def make(rng, t):
        return {"streams": normal(rng, (t, n, d)), "pre": uniform(rng, (t, n), 0.0, 1.0)}, {}
    return make, lambda be, r, s: be.hc_collapse(r["streams"], r["pre"])


def _hc_combine(n, d):
    def make(rng, t):
        return {"streams": normal(rng, (t, n, d)), "f": normal(rng, (t, d)),
                "post": uniform(rng, (t, n), 0.0, 2.0), "comb": uniform(rng, (t, n, n), 0.0, 0.5)}, {}
    return make, lambda be, r, s: be.hc_combine(r["streams"], r["f"], r["post"], r["comb"])


def _stream_mean(n, d):
    return (lambda rng, t: ({"streams": normal(rng, (t, n, d))}, {}),
            lambda be, r, s: be.stream_mean(r["streams"]))


case = table(TOL)
CASES = [
    case("hc_weights_mini", *_hc_weights(4, 128, 20)),
    case("hc_weights_small", *_hc_weights(4, 64, 20)),
    case("hc_weights_odd", *_hc_weights(3, 67, 3)),
    # n * n past one entry a lane (36, 64 = HC_MAX_N^2); bench's D: eight chunks of the matvec
    case("hc_weights_n6", *_hc_weights(6, 40, 5)),
    case("hc_weights_n8", *_hc_weights(8, 33, 4)),
    case("hc_weights_bench", *_hc_weights(4, 4096, 20), ts=(1, 7, 15)),
    # prime class: the matvec as one float32 GEMM (backend/cuda/prime.py)
    case("hc_weights_prime", *_hc_weights(4, 128, 20), gates=frozenset({NUMPY}), ts=(16, 40)),
    case("hc_weights_prime_odd", *_hc_weights(3, 67, 3), gates=frozenset({NUMPY}), ts=(17,)),
    # the whole site, its mix on a side stream (bit-equal to the ops in sequence: test_cuda_hc_site.py)
    case("hc_site_mini", *_hc_site(4, 128, 20)),
    case("hc_site_odd", *_hc_site(3, 67, 3)),
    case("hc_site_bench", *_hc_site(4, 4096, 20), ts=(1, 7, 15)),
    case("hc_site_prime", *_hc_site(4, 128, 20), gates=frozenset({NUMPY}), ts=(16, 40)),
    case("hc_collapse_mini", *_hc_collapse(4, 128)),
    case("hc_collapse_small", *_hc_collapse(4, 64)),
    case("hc_collapse_odd", *_hc_collapse(3, 67)),
    case("hc_combine_mini", *_hc_combine(4, 128)),
    case("hc_combine_small", *_hc_combine(4, 64)),
    case("hc_combine_odd", *_hc_combine(3, 67)),
    case("hc_combine_n8", *_hc_combine(8, 300)),  # HC_MAX_N streams, D past one block
    case("stream_mean_mini", *_stream_mean(4, 128)),
    case("stream_mean_odd", *_stream_mean(3, 67)),
    # a prompt's rows through the same kernels (a thread per channel, rows over grid y, looped
    # past its 65535)
    case("hc_combine_rows", *_hc_combine(4, 300), gates=frozenset({NUMPY}), ts=(600,)),
    case("hc_collapse_rows", *_hc_collapse(4, 300), gates=frozenset({NUMPY}), ts=(600,)),
    case("hc_combine_past_grid_y", *_hc_combine(2, 3), gates=frozenset({NUMPY}), ts=(70000,)),
    case("stream_mean_past_grid_y", *_stream_mean(2, 3), gates=frozenset({NUMPY}), ts=(70000,)),
]


class TestHyperOps(OpGates):
    ops, tol, cases = HyperOps, TOL, CASES
    # hc_weights spreads its fn matvec over chunks of a fixed SIZE; a split COUNT that follows t
    # is what the exact class forbids (a 4096-long dot: 32 t slices against a fixed 32)
    red_arms = (RedArm("matvec_split_count_growing_with_t", dot_case("matvec_4096", 4096, 1),
                       lambda: SplitDot(lambda t: 32 * t), green=lambda: SplitDot(lambda t: 32)),)
    ulp_cases = ("hc_weights_mini", "hc_combine_odd")
