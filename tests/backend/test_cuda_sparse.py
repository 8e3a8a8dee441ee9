"""The CUDA sparse family (kpool indexer, MLA, MoE) against the numpy reference, and row exactness.

Runs on a GPU host only (python3 -m pytest -m gpu). Three gates, ggml / fla style:
* every op against NumpyBackend within its own bound (TOL); the selections (kpool positions,
  MoE expert ids) exactly, on inputs drawn until the deciding score gap clears a margin, so no
  near-tie can flip a choice; exact ties get their own tests (the lower index wins);
* row invariance: for t = 1..15, row r of a t-row call is bit-identical to the t = 1 call;
* red arm: router logits whose dot split count follows t fail that same check, and a
  one-ulp change of one row is caught.
"""

from __future__ import annotations

import inspect
import zlib

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda_sparse import SparseOps
from memra.backend.numpy_ref import NumpyBackend
from memra.safetensors_io import bf16_to_f32, f32_to_bf16
from tests.backend.inputs import normal, uniform

F32 = np.float32
T_MAX = 15  # the exact-class row cap
OPS, REF = SparseOps(), NumpyBackend()
PLANE, POOL, BUDGET, WIDTH = 64, 4, 2, 11  # a 64-position plane, P 4, index_topk 8 -> 2 pools
MARGIN = 1e-3  # relative float64 gap required at every selection boundary

# Per-op bounds against the reference, (rtol, atol). Integer outputs (positions, expert ids)
# are always compared exactly.
TOL = {
    "kpool_compress": (2e-5, 2e-6),  # softmax over P slots: expf ulps, P products
    "kpool_select": (0.0, 0.0),  # positions: exact
    "mla_attend": (1e-4, 1e-5),  # dots over R, softmax over <= W positions, sum of p_j c_j
    "moe_route": (2e-5, 2e-6),  # ids exact; weights: sigmoid ulps, one renormalising division
    "moe_experts": (1e-4, 1e-5),  # dots over D, D and I per unit, SwiGLU, k weighted experts
}






def _dev(args):
    return tuple(cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args)


def _host(out):
    return tuple(cp.asnumpy(o) for o in (out if isinstance(out, tuple) else (out,)))


def _same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ---- inputs ------------------------------------------------------------------------------------

def _compress_args(rng, npool, di):
    keys, gates = normal(rng, (npool, POOL, di)), normal(rng, (npool, POOL, di))
    return (keys, gates, normal(rng, (POOL, di), 0.5)), None


def _select_gap(q, w, pool_keys, pos0, scale) -> float:
    """Smallest relative float64 gap, over the sparse rows, between the last chosen pool's
    score and the best rejected one."""
    gaps = [np.inf]
    for r in range(q.shape[0]):
        n = (pos0 + r + 1) // POOL
        if n <= BUDGET:
            continue
        s = np.maximum(q[r].astype(np.float64) @ pool_keys[:n].astype(np.float64).T * scale, 0.0)
        top = np.sort(w[r].astype(np.float64) @ s)[::-1]
        gaps.append((top[BUDGET - 1] - top[BUDGET]) / (1.0 + abs(top[BUDGET - 1])))
    return min(gaps)


def _select_args(rng, t, hi, di, pos0):
    """kpool_select inputs on the 64-position plane, redrawn until every boundary is clear.
    Mostly positive dots (uniform, shifted) so relu rarely ties pools at exactly zero."""
    scale = di ** -0.5
    for _ in range(1000):
        q = uniform(rng, (t, hi, di), -0.25, 1.0)
        w = (uniform(rng, (t, hi), 0.2, 1.0) * F32(hi ** -0.5)).astype(F32)
        pool_keys = uniform(rng, (PLANE // POOL + 1, di), -0.25, 1.0)
        if _select_gap(q, w, pool_keys, pos0, scale) > MARGIN:
            return (q, w, pool_keys, pos0, POOL, BUDGET, WIDTH, scale), None
    raise AssertionError("no kpool_select input with a clear selection margin")


def _mla_args(rng, t, h, rank, pos0):
    sel, _ = _select_args(rng, t, 2, 8, pos0)
    positions = REF.kpool_select(*sel)  # realistic lists: pools, tail, -1 padding
    q_lat, latent = normal(rng, (t, h, rank)), normal(rng, (PLANE, rank))
    return (q_lat, latent, positions, F32(rank ** -0.5)), None


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


def _route_args(rng, t, d, e, n_group, topk_group, k, renormalize=True):
    for _ in range(1000):
        x, w_gate = normal(rng, (t, d)), normal(rng, (e, d), d ** -0.5)
        bias = uniform(rng, (e,), -0.1, 0.1)
        if _route_gap(x, w_gate, bias, n_group, topk_group, k) > MARGIN:
            return (x, w_gate, bias, n_group, topk_group, k, renormalize, 2.5), None
    raise AssertionError("no moe_route input with a clear selection margin")


def _experts_args(rng, t, e, inter, d, k, bf16=False, limit=10.0):
    idx = np.sort(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), axis=1)
    x, wts = normal(rng, (t, d)), uniform(rng, (t, k), 0.1, 2.5)
    mats = [normal(rng, (e, inter, d), d ** -0.5), normal(rng, (e, inter, d), d ** -0.5),
            normal(rng, (e, d, inter), inter ** -0.5)]
    if not bf16:
        return (x, idx.astype(np.int64), wts, *mats, limit), None
    bits = [f32_to_bf16(m) for m in mats]  # the device keeps the bits; the reference widens
    return ((x, idx.astype(np.int64), wts, *bits, limit),
            (x, idx.astype(np.int64), wts, *[bf16_to_f32(b) for b in bits], limit))


CASES = {
    "kpool_compress-mini": ("kpool_compress", lambda rng: _compress_args(rng, 16, 8)),
    "kpool_compress-small": ("kpool_compress", lambda rng: _compress_args(rng, 7, 16)),
    "kpool_compress-odd": ("kpool_compress", lambda rng: _compress_args(rng, 5, 13)),
    "kpool_select-mini-dense-to-sparse": ("kpool_select", lambda rng: _select_args(rng, 15, 1, 8, 0)),
    "kpool_select-mini-sparse": ("kpool_select", lambda rng: _select_args(rng, 15, 1, 8, 49)),
    "kpool_select-small-dense-to-sparse": ("kpool_select", lambda rng: _select_args(rng, 15, 4, 16, 0)),
    "kpool_select-small-sparse": ("kpool_select", lambda rng: _select_args(rng, 15, 4, 16, 49)),
    "mla_attend-mini": ("mla_attend", lambda rng: _mla_args(rng, 15, 2, 16, 49)),
    "mla_attend-small": ("mla_attend", lambda rng: _mla_args(rng, 15, 4, 32, 49)),
    "mla_attend-odd-dense": ("mla_attend", lambda rng: _mla_args(rng, 13, 3, 67, 0)),
    "moe_route-mini": ("moe_route", lambda rng: _route_args(rng, 15, 128, 4, 1, 1, 2)),
    "moe_route-small": ("moe_route", lambda rng: _route_args(rng, 15, 64, 8, 2, 1, 2)),
    "moe_route-groups-unnormalised": (
        "moe_route", lambda rng: _route_args(rng, 9, 96, 8, 2, 2, 3, renormalize=False)),
    "moe_experts-mini": ("moe_experts", lambda rng: _experts_args(rng, 15, 4, 64, 128, 2)),
    "moe_experts-mini-bf16": ("moe_experts", lambda rng: _experts_args(rng, 15, 4, 64, 128, 2, True)),
    "moe_experts-small": ("moe_experts", lambda rng: _experts_args(rng, 15, 8, 32, 64, 2)),
    "moe_experts-small-bf16": ("moe_experts", lambda rng: _experts_args(rng, 15, 8, 32, 64, 2, True)),
    "moe_experts-odd-clamped": (
        "moe_experts", lambda rng: _experts_args(rng, 11, 5, 33, 67, 3, limit=0.75)),
    "moe_experts-odd-clamped-bf16": (
        "moe_experts", lambda rng: _experts_args(rng, 11, 5, 33, 67, 3, True, limit=0.75)),
    # prime class: more rows than one tensor-core pass per expert
    "moe_experts-prime-bf16": ("moe_experts", lambda rng: _experts_args(rng, 40, 4, 40, 264, 2, True)),
}


def _rng(name: str):
    return np.random.default_rng(zlib.crc32(name.encode()))


def test_every_sparse_op_has_a_bound_a_case_and_the_reference_signature():
    assert {op for op, _ in CASES.values()} == set(TOL)
    for op in (*TOL, "kpool_finalize"):  # a plane write: its own tests at the end of this file
        ours, ref = (inspect.signature(getattr(c, op)).parameters for c in (SparseOps, NumpyBackend))
        assert [(p.name, p.default) for p in ours.values()] == [(p.name, p.default) for p in ref.values()], op


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_numpy_reference(case):
    op, build = CASES[case]
    args, ref_args = build(_rng(case))
    got = _host(getattr(OPS, op)(*_dev(args)))
    want = _host(getattr(REF, op)(*(ref_args or args)))  # cp.asnumpy passes numpy through
    rtol, atol = TOL[op]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        if w.dtype.kind in "iu":
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def test_kpool_select_exact_ties_go_to_the_lower_pool():
    # exact arithmetic (halves, quarters): pools 2, 5 and 9 tie at the top, so 2 and 5 win;
    # with all pools equal, pools 0 and 1 win. Rows at 61..63: tails 60..61, 60..62, none.
    q, w = np.ones((3, 2, 8), F32), np.full((3, 2), 0.5, F32)
    top3 = np.full((PLANE // POOL + 1, 8), 0.5, F32)
    top3[[2, 5, 9]] = 1.0
    flat = np.full((PLANE // POOL + 1, 8), 0.5, F32)
    tails = [[60, 61, -1], [60, 61, 62], [-1, -1, -1]]
    for pool_keys, pools in ((top3, [2, 5]), (flat, [0, 1])):
        cols = [j * POOL + m for j in pools for m in range(POOL)]
        want = np.array([cols + tail for tail in tails], np.int32)
        args = (q, w, pool_keys, 61, POOL, BUDGET, WIDTH, 0.25)
        np.testing.assert_array_equal(REF.kpool_select(*args), want)
        np.testing.assert_array_equal(cp.asnumpy(OPS.kpool_select(*_dev(args))), want)


def test_moe_route_exact_ties_go_to_the_lower_group_and_expert():
    # logits exactly [1, 2, 1, 2 | 1, 2, 1, 2]: the groups tie (group 0 kept), experts 1 and 3
    # lead, and 0 beats 2 for the third slot
    x = np.ones((2, 8), F32)
    w_gate = np.repeat(np.array([1, 2, 1, 2, 1, 2, 1, 2], F32)[:, None] / 8, 8, axis=1).astype(F32)
    args = (x, w_gate, np.zeros(8, F32), 2, 1, 3, True, 2.5)
    want = np.array([[0, 1, 3]] * 2, np.int64)
    np.testing.assert_array_equal(REF.moe_route(*args)[0], want)
    got_idx, got_wts = _host(OPS.moe_route(*_dev(args)))
    np.testing.assert_array_equal(got_idx, want)
    np.testing.assert_allclose(got_wts, REF.moe_route(*args)[1], rtol=2e-5, atol=2e-6)


# ---- row invariance ----------------------------------------------------------------------------

def _rows_differ(call) -> list[int]:
    """The t in 1..15 for which some row of the t-row call is not bit-identical to that row
    computed alone. call(rows: slice) -> device output(s) for those rows."""
    alone = [_host(call(slice(r, r + 1))) for r in range(T_MAX)]
    bad = []
    for t in range(1, T_MAX + 1):
        many = _host(call(slice(0, t)))
        if not all(_same_bits(m[r], a[0]) for r in range(t) for m, a in zip(many, alone[r])):
            bad.append(t)
    return bad


def _select_rows(pos0):
    def make(rng):
        q, w, pool_keys, *_ = _dev(_select_args(rng, T_MAX, 4, 16, pos0)[0])
        return lambda rows: OPS.kpool_select(
            q[rows], w[rows], pool_keys, pos0 + rows.start, POOL, BUDGET, WIDTH, 0.25)
    return make


def _plain_rows(build, op, row_args):
    """Ops whose first `row_args` arguments carry the row axis and the rest are shared."""
    def make(rng):
        args = _dev(build(rng)[0])
        return lambda rows: getattr(OPS, op)(*(a[rows] for a in args[:row_args]), *args[row_args:])
    return make


def _mla_rows(rng):
    q_lat, latent, positions, scale = _dev(_mla_args(rng, T_MAX, 4, 32, 3)[0])
    return lambda rows: OPS.mla_attend(q_lat[rows], latent, positions[rows], scale)


ROW_CASES = {
    "kpool_compress": _plain_rows(lambda rng: _compress_args(rng, T_MAX, 16), "kpool_compress", 2),
    "kpool_select-dense-to-sparse": _select_rows(3),
    "kpool_select-sparse": _select_rows(49),
    "mla_attend": _mla_rows,
    "moe_route-mini": _plain_rows(lambda rng: _route_args(rng, T_MAX, 128, 4, 1, 1, 2), "moe_route", 1),
    "moe_route-small": _plain_rows(lambda rng: _route_args(rng, T_MAX, 64, 8, 2, 1, 2), "moe_route", 1),
    "moe_experts-f32": _plain_rows(
        lambda rng: _experts_args(rng, T_MAX, 8, 32, 64, 2), "moe_experts", 3),
    "moe_experts-bf16": _plain_rows(
        lambda rng: _experts_args(rng, T_MAX, 4, 64, 128, 2, True), "moe_experts", 3),
    "moe_experts-bf16-odd": _plain_rows(
        lambda rng: _experts_args(rng, T_MAX, 5, 33, 67, 3, True), "moe_experts", 3),
}


@pytest.mark.parametrize("case", sorted(ROW_CASES))
def test_row_r_of_t_rows_is_bit_identical_to_row_r_alone(case):
    assert _rows_differ(ROW_CASES[case](_rng(case))) == []


# ---- red arm -----------------------------------------------------------------------------------

# Router logits with the split COUNT equal to t (chunk = ceil(D / t)): the reduction order of a
# row follows the number of rows, exactly what the exact class forbids.
_SPLIT_BY_T = r"""
extern "C" __global__ void logits_split_by_t(const float* x, const float* w, float* out,
                                             int t, int D, int E) {
    int r = blockIdx.x, e = threadIdx.x;
    if (e >= E) return;
    int chunk = (D + t - 1) / t;
    float total = 0.0f;
    for (int c0 = 0; c0 < D; c0 += chunk) {
        float part = 0.0f;
        for (int c = c0; c < min(c0 + chunk, D); ++c) part += x[r * D + c] * w[e * D + c];
        total += part;
    }
    out[r * E + e] = total;
}
"""


def test_red_arm_a_split_count_that_follows_t_is_caught():
    kern = cp.RawKernel(_SPLIT_BY_T, "logits_split_by_t", options=("--std=c++17", "--fmad=false"))
    rng = _rng("red")
    x, w = cp.asarray(normal(rng, (T_MAX, 128))), cp.asarray(normal(rng, (8, 128), 128 ** -0.5))

    def call(rows):
        xs = x[rows]
        out = cp.empty((xs.shape[0], 8), cp.float32)
        kern((xs.shape[0],), (32,), (xs, w, out, np.int32(xs.shape[0]), np.int32(128), np.int32(8)))
        return out

    assert _rows_differ(call) != []


def test_red_arm_a_one_ulp_change_of_one_row_is_caught():
    args, _ = _experts_args(_rng("ulp"), 4, 8, 32, 64, 2)
    out = _host(OPS.moe_experts(*_dev(args)))[0]
    bumped = out.copy()
    bumped[2, 7] = np.nextafter(bumped[2, 7], np.inf)
    assert _same_bits(out[2], out[2]) and not _same_bits(bumped[2], out[2])


# ---- the position read from the device (what a captured walk replays) -------------------------

@pytest.mark.parametrize("at, t", [(0, 1), (3, 1), (2, 6), (5, 15), (47, 15), (60, 4)])
def test_kpool_finalize_at_a_device_position_is_kpool_compress_of_the_completed_pools(at, t):
    """Bit for bit the compress kernel on the same pools; pools outside the rows untouched."""
    from memra.backend.cuda_runtime import position

    rng = np.random.default_rng([at, t])
    keys, gates = normal(rng, (PLANE, 8)), normal(rng, (PLANE, 8))
    ape = normal(rng, (POOL, 8), 0.5)
    pool_keys = cp.full((PLANE // POOL + 1, 8), 7.0, cp.float32)
    OPS.kpool_finalize(cp.asarray(keys), cp.asarray(gates), cp.asarray(ape), pool_keys, position(at), t)
    got = cp.asnumpy(pool_keys)
    first, last = at // POOL, (at + t) // POOL
    done = slice(first * POOL, last * POOL)
    shape = (last - first, POOL, 8)
    want = cp.asnumpy(OPS.kpool_compress(cp.asarray(keys[done].reshape(shape)),
                                         cp.asarray(gates[done].reshape(shape)), cp.asarray(ape)))
    assert _same_bits(got[first:last], want)
    assert (np.delete(got, range(first, last), axis=0) == 7.0).all()


@pytest.mark.parametrize("pos0", [0, 9, 49])
def test_kpool_select_reads_the_same_positions_from_a_host_int_or_a_device_buffer(pos0):
    from memra.backend.cuda_runtime import position

    args, _ = _select_args(np.random.default_rng(pos0), T_MAX, 4, 16, pos0)
    dev = _dev(args)
    from_int = cp.asnumpy(OPS.kpool_select(*dev))
    from_buffer = cp.asnumpy(OPS.kpool_select(*dev[:3], position(pos0), *dev[4:]))
    assert np.array_equal(from_int, from_buffer)
    np.testing.assert_array_equal(from_int, REF.kpool_select(*args))


@pytest.mark.parametrize("t, k, e", [(1, 8, 64), (15, 8, 64), (40, 2, 8), (3, 4, 3072), (600, 8, 300)])
def test_moe_expert_list_is_the_ascending_distinct_experts_routed(t, k, e):
    """The bf16 expert kernels run one block row per listed expert, so the list must be exact."""
    from memra.backend.cuda_runtime import launch

    rng = np.random.default_rng([t, k, e])
    idx = np.sort(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), axis=1).astype(np.int64)
    listed, count = cp.full(min(e, t * k), -1, cp.int32), cp.empty(1, cp.int32)
    launch("moe", "moe_expert_list", (1,), (256,), (cp.asarray(idx), np.int32(t * k), np.int32(e), listed, count))
    want = np.unique(idx)
    assert int(count.get()[0]) == want.size
    assert np.array_equal(cp.asnumpy(listed)[:want.size], want)
