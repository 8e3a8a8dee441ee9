"""The norm family on the GPU (NormOps, backend/cuda/norm.py -> kernels_cu/norm.cu): RMSNorm (plain
and gated), LayerNorm, L2 norm, softmax, log-softmax and argmax (alone or with its softmax
probability), one row reduction each, top-k (a drafter's candidates), and pick (a row's entry at a device index).

The table below runs through the shared gates of tests/backend/harness.py (numpy twin within
each op's bound, t = 1..15 row invariance, red arms: a sum of squares split into t parts, a
one-ulp change); the rest pins argmax's NaN / inf / tie rules and the wrapper's refusals.
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_norm.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda.backend import CudaBackend  # noqa: E402
from memra.backend.cuda.norm import ARGMAX_SPAN, NormOps, launch_norm  # noqa: E402
from memra.backend.numpy_ref import NumpyBackend  # noqa: E402
from memra.kernels_cu.constants import NORM_WARP_ROW  # noqa: E402
from tests.backend.harness import OpGates, RedArm, split_dot, table  # noqa: E402
from tests.backend.inputs import make_norm, make_rows, normal  # noqa: E402

F32 = np.float32

# op -> (rtol, atol) against NumpyBackend. argmax does no arithmetic: exact. Row sums differ
# from numpy's (pairwise) order; expf / logf from CUDA's by an ulp or two.
TOL = {
    "rmsnorm": (1e-5, 1e-6),
    "layernorm": (1e-5, 1e-5),
    "l2norm": (1e-5, 1e-6),
    "gated_rmsnorm": (1e-5, 1e-6),
    "softmax": (1e-5, 1e-8),
    "log_softmax": (1e-5, 1e-5),
    "argmax": (0.0, 0.0),
    "argmax_prob": (1e-5, 1e-8),
    "top_k": (0.0, 0.0),  # picks: values and ids exact  # the id exact (an int); the probability's sum order differs
}


def _make_gated(shape):
    def make(rng, t):
        rows = {"o": normal(rng, (t, *shape)), "gate": normal(rng, (t, *shape), 2.0)}
        return rows, {"w": (1 + 0.3 * normal(rng, shape[-1:])).astype(F32)}
    return make


def _make_argmax_ties(n):
    def make(rng, t):  # small integers: many exact ties, broken to the lowest index in every row
        return {"x": rng.integers(0, 5, (t, n)).astype(F32)}, {}
    return make


def _rmsnorm(eps):
    return lambda be, r, s: be.rmsnorm(r["x"], s["w"], eps)


def _layernorm(eps):
    return lambda be, r, s: be.layernorm(r["x"], s["w"], s["b"], eps)


def _gated(be, r, s):
    return be.gated_rmsnorm(r["o"], r["gate"], s["w"], 1e-5)


case = table(TOL)
CASES = [
    case("rmsnorm", make_norm((128,)), _rmsnorm(1e-5)),
    case("rmsnorm_per_head", make_norm((2, 33)), _rmsnorm(1e-5)),
    case("rmsnorm_unweighted", make_norm((256,), weighted=False), _rmsnorm(1e-5)),
    case("rmsnorm_long", make_norm((1000,)), _rmsnorm(1e-6)),
    # past one batch of loads (16 a thread: 4096), with a partial tail; unweighted the same
    case("rmsnorm_wide", make_norm((5000,)), _rmsnorm(1e-6)),
    case("rmsnorm_wide_unweighted", make_norm((4097,), weighted=False), _rmsnorm(1e-6)),
    case("layernorm", make_norm((16,), bias=True), _layernorm(1e-6)),
    case("layernorm_odd", make_norm((301,), bias=True), _layernorm(1e-5)),
    case("l2norm", make_rows(x=(2, 32, 1.0)), lambda be, r, s: be.l2norm(r["x"], 1e-6)),
    case("l2norm_odd", make_rows(x=(1, 129, 1.0)), lambda be, r, s: be.l2norm(r["x"], 1e-6)),
    case("l2norm_wide", make_rows(x=(1, 4500, 1.0)), lambda be, r, s: be.l2norm(r["x"], 1e-6)),
    case("l2norm_scaled", make_rows(x=(4, 128, 1.0)), lambda be, r, s: be.l2norm(r["x"], 1e-6, scale=128 ** -0.5)),
    case("gated_rmsnorm", _make_gated((2, 64)), _gated),
    case("gated_rmsnorm_odd", _make_gated((3, 65)), _gated),
    case("softmax", make_rows(x=(256, 3.0)), lambda be, r, s: be.softmax(r["x"])),
    case("log_softmax", make_rows(x=(256, 3.0)), lambda be, r, s: be.log_softmax(r["x"])),
    case("softmax_odd", make_rows(x=(3, 67, 3.0)), lambda be, r, s: be.softmax(r["x"])),
    case("argmax", make_rows(x=(1001, 1.0)), lambda be, r, s: be.argmax(r["x"])),
    case("argmax_ties", _make_argmax_ties(300), lambda be, r, s: be.argmax(r["x"])),
    # past one argmax_parts block (ARGMAX_SPAN): the best of several parts, ties across parts
    case("argmax_parts", make_rows(x=(3 * ARGMAX_SPAN + 7, 1.0)), lambda be, r, s: be.argmax(r["x"])),
    case("argmax_parts_ties", _make_argmax_ties(2 * ARGMAX_SPAN + 1), lambda be, r, s: be.argmax(r["x"])),
    case("argmax_prob", make_rows(x=(3 * ARGMAX_SPAN + 7, 3.0)), lambda be, r, s: be.argmax_prob(r["x"])),
    case("argmax_prob_ties", _make_argmax_ties(2 * ARGMAX_SPAN + 1), lambda be, r, s: be.argmax_prob(r["x"])),
    case("argmax_prob_one_part", make_rows(x=(1001, 3.0)), lambda be, r, s: be.argmax_prob(r["x"])),
    case("top_k", make_rows(x=(3 * ARGMAX_SPAN + 7, 1.0)), lambda be, r, s: be.top_k(r["x"], 16)),
    # ties within and across parts; k past a part's worth of distinct values
    case("top_k_ties", _make_argmax_ties(2 * ARGMAX_SPAN + 1), lambda be, r, s: be.top_k(r["x"], 40)),
    case("top_k_short_row", make_rows(x=(5, 1.0)), lambda be, r, s: be.top_k(r["x"], 5)),
]


class _SumOfSquaresSplitByRowCount(NormOps):
    """The mutation: rmsnorm whose sum of squares is cut into t interleaved partial sums."""

    def rmsnorm(self, x, w, eps):
        n = x.shape[-1]
        flat = x.reshape(-1, n)
        ss = split_dot(flat * flat, cp.ones((1, n), cp.float32), splits=flat.shape[0])
        y = flat * (F32(1) / cp.sqrt(ss / F32(n) + F32(eps)))
        return (y if w is None else y * w).reshape(x.shape)


class TestNormOps(OpGates):
    ops, tol, cases = NormOps, TOL, CASES
    untabled = ("pick",)  # a gather: test_pick_... below
    red_arms = (RedArm("rmsnorm_sum_split_count_tied_to_t", CASES[0], _SumOfSquaresSplitByRowCount),)
    ulp_cases = ("rmsnorm", "softmax")


@pytest.mark.parametrize("where", [(ARGMAX_SPAN, 2 * ARGMAX_SPAN + 5), (2 * ARGMAX_SPAN - 1, ARGMAX_SPAN)])
def test_argmax_across_parts_takes_the_lowest_tied_index_and_the_first_nan(where):
    x = np.zeros((2, 3 * ARGMAX_SPAN), F32)
    x[0, list(where)] = 1.0
    x[1, list(where)] = np.nan
    assert cp.asnumpy(NormOps().argmax(cp.asarray(x))).tolist() == [min(where)] * 2


def test_argmax_follows_numpy_on_nan_inf_and_ties():
    x = np.array([[1.0, np.nan, 3.0, np.nan], [-np.inf] * 4, [2.0, 5.0, 5.0, -1.0],
                  [-0.0, 0.0, -1.0, -0.0]], F32)
    assert np.array_equal(cp.asnumpy(NormOps().argmax(cp.asarray(x))), np.argmax(x, axis=-1))


def test_pick_gathers_each_rows_entry_at_its_device_index_like_numpy():
    x = normal(np.random.default_rng(7), (3, 5, 1001))
    idx = np.random.default_rng(8).integers(0, 1001, (3, 5))
    got = cp.asnumpy(NormOps().pick(cp.asarray(x), cp.asarray(idx, dtype=cp.int32)))
    assert np.array_equal(got, NumpyBackend().pick(x, idx))
    assert np.array_equal(got, x[np.arange(3)[:, None], np.arange(5)[None, :], idx])


def test_argmax_prob_of_degenerate_rows_follows_numpys_softmax():
    """A part of -inf alone adds nothing; a row of -inf alone, a NaN or a +inf has no softmax
    (NaN, as numpy's); a peak far above the rest has probability 1."""
    n = 3 * ARGMAX_SPAN
    x = np.zeros((5, n), F32)
    x[0, :ARGMAX_SPAN] = -np.inf  # the first part: -inf alone
    x[1] = -np.inf
    x[2, 5] = np.nan
    x[3, 7] = np.inf
    x[4, 9] = 200.0
    ids, probs = NormOps().argmax_prob(cp.asarray(x))
    want_ids, want = NumpyBackend().argmax_prob(x)
    assert cp.asnumpy(ids).tolist() == want_ids.tolist() == [ARGMAX_SPAN, 0, 5, 7, 9]
    got = cp.asnumpy(probs)
    assert np.isnan(got[1:4]).all() and np.isnan(want[1:4]).all()
    np.testing.assert_allclose(got[[0, 4]], want[[0, 4]], rtol=1e-5, atol=0)
    assert got[4] == 1.0


def test_top_k_of_degenerate_rows_follows_the_numpy_twin():
    """NaN first (by index), +inf, then values; a part of -inf alone; -0 and +0 tie to the lower id."""
    n = 2 * ARGMAX_SPAN + 3
    x = np.full((3, n), -np.inf, F32)
    x[0, [9, ARGMAX_SPAN + 1]] = np.nan
    x[0, [3, n - 1]] = np.inf
    x[1, ARGMAX_SPAN:] = 1.0
    x[2, [ARGMAX_SPAN + 2, 4]] = [-0.0, 0.0]
    vals, ids = NormOps().top_k(cp.asarray(x), 6)
    want_vals, want_ids = NumpyBackend().top_k(x, 6)
    assert cp.asnumpy(ids).tolist() == want_ids.tolist()
    assert np.array_equal(cp.asnumpy(vals), want_vals, equal_nan=True)
    assert want_ids[0, :4].tolist() == [9, ARGMAX_SPAN + 1, 3, n - 1]
    assert want_ids[2, :2].tolist() == [4, ARGMAX_SPAN + 2]


def test_wrapper_refuses_non_contiguous_or_wrongly_typed_inputs():
    ops = NormOps()
    x = cp.asarray(normal(np.random.default_rng(6), (8, 64)))
    with pytest.raises(AssertionError, match="C-contiguous"):
        ops.rmsnorm(x.T, None, 1e-5)
    with pytest.raises(AssertionError, match="float32"):
        ops.softmax(x.astype(cp.float64))


# n around the warp path's edges: a lane's first element, one fold of the tree, NORM_WARP_ROW
WARP_NS = (1, 31, 33, 100, 128, 255, 256, 257, 1000, NORM_WARP_ROW)


def _both_paths(kernel, n, make_args):
    """The kernel's output over 13 rows of n, a block a row and a warp a row."""
    outs = []
    for per_warp in (False, True):
        out = cp.zeros((13, n), cp.float32)
        launch_norm(kernel, 13, n, make_args(out), per_warp=per_warp)
        outs.append(cp.asnumpy(out))
    return outs


@pytest.mark.parametrize("n", WARP_NS)
def test_a_warp_a_row_gives_the_blocks_bits(n):
    rng = np.random.default_rng(n)
    x, gate = (cp.asarray(normal(rng, (13, n), s)) for s in (1.0, 2.0))
    w = cp.asarray((1 + 0.3 * normal(rng, (n,))).astype(F32))
    eps = F32(1e-6)
    for kernel, make_args in (
            ("rmsnorm_rows", lambda out: (x, w, out, np.int32(n), eps)),
            ("rmsnorm_rows", lambda out: (x, None, out, np.int32(n), eps)),
            ("l2norm_rows", lambda out: (x, out, np.int32(n), eps, F32(0.125))),
            ("gated_rmsnorm_rows", lambda out: (x, gate, w, out, np.int32(n), eps))):
        block, warp = _both_paths(kernel, n, make_args)
        assert block.tobytes() == warp.tobytes(), f"{kernel} n={n}"


@pytest.mark.parametrize("n", [128, 1000])
def test_the_warp_paths_inputs_feel_the_summation_order(n):
    """Red arm of the test above: on the same kind of rows, another order of the same sum of
    squares (numpy's pairwise one) moves the bits of some row's norm, so equal bits say the
    warp plays the block's order, not that any order would do (a KDA head's short rows, and
    longer ones)."""
    x = cp.asarray(normal(np.random.default_rng(n), (13, n)))
    block, _ = _both_paths("l2norm_rows", n, lambda out: (x, out, np.int32(n), F32(1e-6), F32(1)))
    host = cp.asnumpy(x)
    other = host / np.sqrt(np.sum(host * host, axis=-1, keepdims=True, dtype=F32) + F32(1e-6))
    assert block.tobytes() != other.astype(F32).tobytes()


@pytest.mark.parametrize("n", [128, 4500])
def test_a_scaled_l2norm_is_the_scale_of_the_l2norm(n):
    """l2norm(x, eps, scale) (KDA's q in one launch) has the bits of scale(l2norm(x, eps))."""
    x = cp.asarray(normal(np.random.default_rng(n), (64, n)))
    be = CudaBackend()
    assert be.l2norm(x, 1e-6, scale=n ** -0.5).tobytes() == be.scale(be.l2norm(x, 1e-6), n ** -0.5).tobytes()
