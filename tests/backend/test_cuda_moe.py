"""The MoE family on the GPU (MoeOps, backend/cuda/moe.py -> kernels_cu/moe.cu): noaux_tc sigmoid
routing and the routed experts (float32 CUDA cores, bf16 tensor cores over a listed expert set).

The table runs through the shared gates of tests/backend/harness.py. Expert ids are compared
exactly, on inputs redrawn until the deciding score gaps (group and expert boundaries) clear a
margin, so no near-tie can flip a choice; exact ties get their own test (the lower index wins).
Red arms: router logits whose dot split count follows t fail the row gate while a fixed split
passes, and a one-ulp change of one row is caught. The rest pins the device expert list the
bf16 kernels run on.
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_moe.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda.moe import MoeOps  # noqa: E402
from memra.backend.cuda.runtime import launch  # noqa: E402
from memra.backend.numpy_ref import NumpyBackend  # noqa: E402
from memra.safetensors_io import f32_to_bf16  # noqa: E402
from tests.backend.harness import NUMPY, OpGates, RedArm, SplitDot, dot_case, table  # noqa: E402
from tests.backend.inputs import normal, uniform  # noqa: E402

F32 = np.float32
MARGIN = 1e-3  # float64 gap required at every selection boundary

# op -> (rtol, atol) against NumpyBackend; expert ids are always compared exactly.
TOL = {
    "moe_route": (2e-5, 2e-6),  # ids exact; weights: sigmoid ulps, one renormalising division
    "moe_experts": (1e-4, 1e-5),  # dots over D, D and I per unit, SwiGLU, k weighted experts
}


def _route_gap(x, w_gate, bias, n_group, topk_group, k) -> float:
    """Smallest float64 gap at the group boundary and at the expert boundary, over rows."""
    s = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ w_gate.astype(np.float64).T)))
    sb = s + bias.astype(np.float64)
    gaps = [np.inf]
    for r in range(x.shape[0]):
        groups = sb[r].reshape(n_group, -1)
        top2 = -np.sort(-groups, axis=1)[:, :2]
        gscore = top2[:, 0] + top2[:, 1]
        order = np.sort(gscore)[::-1]
        if topk_group < n_group:
            gaps.append(order[topk_group - 1] - order[topk_group])
        keep = np.argsort(-gscore, kind="stable")[:topk_group]
        cand = np.sort(groups[keep].reshape(-1))[::-1]
        if k < cand.size:
            gaps.append(cand[k - 1] - cand[k])
    return min(gaps)


def _route(d, e, n_group, topk_group, k, renormalize=True, shared=-1):
    def make(rng, t):
        for _ in range(1000):
            x, w_gate = normal(rng, (t, d)), normal(rng, (e, d), d ** -0.5)
            bias = uniform(rng, (e,), -0.1, 0.1)
            if _route_gap(x, w_gate, bias, n_group, topk_group, k) > MARGIN:
                return {"x": x}, {"w_gate": w_gate, "bias": bias}
        raise AssertionError("no moe_route input with a clear selection margin")

    def call(be, r, s):
        return be.moe_route(r["x"], s["w_gate"], s["bias"], n_group, topk_group, k, renormalize, 2.5, shared)
    return make, call


def _experts(e, inter, d, k, bf16=False, limit=10.0):
    """Weights as bf16 bits when `bf16`: the device keeps the bits, the reference widens them."""
    def make(rng, t):
        idx = np.sort(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), axis=1)
        rows = {"x": normal(rng, (t, d)), "idx": idx.astype(np.int64), "wts": uniform(rng, (t, k), 0.1, 2.5)}
        mats = [normal(rng, (e, inter, d), d ** -0.5), normal(rng, (e, inter, d), d ** -0.5),
                normal(rng, (e, d, inter), inter ** -0.5)]
        return rows, dict(zip(("gate_w", "up_w", "down_w"), [f32_to_bf16(m) for m in mats] if bf16 else mats))

    def call(be, r, s):
        return be.moe_experts(r["x"], r["idx"], r["wts"], s["gate_w"], s["up_w"], s["down_w"], limit)
    return make, call


case = table(TOL)
CASES = [
    case("moe_route_mini", *_route(128, 4, 1, 1, 2)),
    case("moe_route_small", *_route(64, 8, 2, 1, 2)),
    case("moe_route_groups_unnormalised", *_route(96, 8, 2, 2, 3, renormalize=False), ts=(1, 7, 9, 15)),
    # the router's D past one batch of loads (2048 per warp), with a partial tail; bench's shape
    case("moe_route_wide_tail", *_route(2100, 16, 2, 1, 3), ts=(1, 7, 15)),
    case("moe_route_bench", *_route(4096, 64, 1, 1, 8), ts=(1, 7, 15)),
    # a thread per expert: E = 256 in one pass (8 groups, 4 kept), E = 512 over two passes
    case("moe_route_256_grouped", *_route(128, 256, 8, 4, 8), ts=(1, 7)),
    case("moe_route_two_passes", *_route(64, 512, 8, 3, 8), ts=(1, 7)),
    # the bench layer with its shared expert stacked as expert 64: every row's slot 8, weight 1
    case("moe_route_bench_shared", *_route(4096, 64, 1, 1, 8, shared=64), ts=(1, 7, 15)),
    case("moe_experts_mini", *_experts(4, 64, 128, 2)),
    case("moe_experts_mini_bf16", *_experts(4, 64, 128, 2, bf16=True)),
    case("moe_experts_small", *_experts(8, 32, 64, 2)),
    case("moe_experts_small_bf16", *_experts(8, 32, 64, 2, bf16=True)),
    case("moe_experts_odd_bf16", *_experts(5, 33, 67, 3, bf16=True)),
    case("moe_experts_odd_clamped", *_experts(5, 33, 67, 3, limit=0.75), ts=(1, 7, 11, 15)),
    case("moe_experts_odd_clamped_bf16", *_experts(5, 33, 67, 3, bf16=True, limit=0.75), ts=(1, 7, 11, 15)),
    # prime class: cuBLAS GEMMs over each routed expert's rows (backend/cuda/prime.py)
    case("moe_experts_prime_bf16", *_experts(4, 40, 264, 2, bf16=True), gates=frozenset({NUMPY}), ts=(40,)),
    case("moe_experts_prime_bf16_sparse", *_experts(16, 40, 264, 3, bf16=True), gates=frozenset({NUMPY}), ts=(17,)),
    case("moe_route_prime", *_route(64, 8, 2, 1, 2), gates=frozenset({NUMPY}), ts=(40,)),
]


class TestMoeOps(OpGates):
    ops, tol, cases = MoeOps, TOL, CASES
    # router logits [t, 8] over D = 128 in contiguous chunks: ceil(D / t) wide against a fixed 4
    red_arms = (RedArm("router_logits_split_count_follows_t", dot_case("router_logits", 128, 8),
                       lambda: SplitDot(lambda t: t, interleaved=False),
                       green=lambda: SplitDot(lambda t: 4, interleaved=False)),)
    ulp_cases = ("moe_experts_small", "moe_experts_mini_bf16", "moe_route_small")


def _warp_dot_order(w, x):
    """The router's float32 dot as the kernel sums it: lane l adds w[c] x[c] for c = l, l + 32,
    ... in order, then lane 0 gathers the shuffle-down tree (16, 8, 4, 2, 1)."""
    acc = np.zeros(32, F32)
    for c0 in range(0, w.size, 32):
        n = min(32, w.size - c0)
        acc[:n] = acc[:n] + w[c0:c0 + n] * x[c0:c0 + n]
    for off in (16, 8, 4, 2, 1):
        acc[:32 - off] = acc[:32 - off] + acc[off:].copy()
    return acc[0]


@pytest.mark.parametrize("d", [4096, 2100, 31])
def test_router_logits_sum_in_the_fixed_lane_order_bit_for_bit(d):
    """Each logit's order is pinned (not only tolerated): a float32 emulation of the lane order
    gives the kernel's bits, at every row of a 5-row call."""
    rng = np.random.default_rng(d)
    t, e = 5, 6
    x, w = normal(rng, (t, d)), normal(rng, (e, d), d ** -0.5)
    got = cp.empty((t, e), cp.float32)
    launch("moe", "moe_router_logits", (e, t), (32,),
           (cp.asarray(x), cp.asarray(w), got, np.int32(t), np.int32(e), np.int32(d)))
    want = np.array([[_warp_dot_order(w[j], x[r]) for j in range(e)] for r in range(t)], F32)
    assert cp.asnumpy(got).tobytes() == want.tobytes()


def test_moe_route_exact_ties_go_to_the_lower_group_and_expert():
    # logits exactly [1, 2, 1, 2 | 1, 2, 1, 2]: the groups tie (group 0 kept), experts 1 and 3
    # lead, and 0 beats 2 for the third slot
    x = np.ones((2, 8), F32)
    w_gate = np.repeat(np.array([1, 2, 1, 2, 1, 2, 1, 2], F32)[:, None] / 8, 8, axis=1).astype(F32)
    args = (x, w_gate, np.zeros(8, F32), 2, 1, 3, True, 2.5)
    want = np.array([[0, 1, 3]] * 2, np.int64)
    ref_idx, ref_wts = NumpyBackend().moe_route(*args)
    np.testing.assert_array_equal(ref_idx, want)
    got_idx, got_wts = MoeOps().moe_route(*[cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args])
    np.testing.assert_array_equal(cp.asnumpy(got_idx), want)
    np.testing.assert_allclose(cp.asnumpy(got_wts), ref_wts, rtol=TOL["moe_route"][0], atol=TOL["moe_route"][1])


@pytest.mark.parametrize("t, k, e", [(1, 8, 64), (15, 8, 64), (40, 2, 8), (3, 4, 3072), (600, 8, 300)])
def test_moe_expert_list_is_the_ascending_distinct_experts_routed(t, k, e):
    """The bf16 expert kernels run one block row per listed expert, so the list must be exact."""
    rng = np.random.default_rng([t, k, e])
    idx = np.sort(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), axis=1).astype(np.int64)
    listed, count = cp.full(min(e, t * k), -1, cp.int32), cp.empty(1, cp.int32)
    launch("moe", "moe_expert_list", (1,), (256,), (cp.asarray(idx), np.int32(t * k), np.int32(e), listed, count))
    want = np.unique(idx)
    assert int(count.get()[0]) == want.size
    assert np.array_equal(cp.asnumpy(listed)[:want.size], want)


@pytest.mark.parametrize("bf16", [False, True])
def test_a_slot_no_expert_serves_adds_zero(bf16):
    """A slot whose expert id is outside [0, E) has no block writing its rows (the buffers are not
    zeroed): the combine adds 0 for it, as if it were a real expert at weight 0."""
    make, _ = _experts(5, 33, 67, 3, bf16=bf16)
    rows, mats = make(np.random.default_rng(3), 6)
    ops, dev = MoeOps(), {n: cp.asarray(m) for n, m in mats.items()}
    x, idx, wts = (cp.asarray(rows[n]) for n in ("x", "idx", "wts"))
    weights = (dev["gate_w"], dev["up_w"], dev["down_w"])
    ops.moe_experts(x * 7, idx, wts, *weights, 10.0)  # leaves other values in the freed buffers
    bad, zero = idx.copy(), wts.copy()
    bad[1, 0], bad[4, 2] = -1, 5
    zero[1, 0], zero[4, 2] = 0.0, 0.0
    got = ops.moe_experts(x, bad, wts, *weights, 10.0)
    assert cp.array_equal(got, ops.moe_experts(x, idx, zero, *weights, 10.0))
