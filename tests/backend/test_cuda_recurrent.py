"""The CUDA recurrent family (mHC + KDA: kernels_cu/hyper.cu, kda.cu) against the numpy reference,
and its exact-class contract on the GPU.

1. Every op on random preset-like inputs (mini, small, dk=128 with Hk=2, odd sizes) matches
   NumpyBackend within its own bound (TOL, ggml style). hc_collapse / hc_combine / stream_mean
   repeat the reference's operations in its order with no transcendental, so their bound is 0.
2. Row invariance for t = 1..15, bit for bit: row r of a t-row call equals the row alone; the
   stateful ops (short_conv, kda_recurrence) equal t successive one-row calls, outputs and final
   ring / state.
3. Red arm: a dot product whose split count grows with t (a RawKernel written here) breaks the
   same check for some t, while the same kernel with a fixed split passes; and the comparison
   catches a one-ulp change in one row of kda_recurrence's output.

Runs on the GPU host only: python3 -m pytest -m gpu tests/backend/test_cuda_recurrent.py
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda_recurrent import RecurrentOps
from memra.backend.numpy_ref import NumpyBackend
from tests.backend.inputs import mismatched_rows, normal, uniform

F32 = np.float32
T_MAX = 15  # the exact-class row cap (K <= 14)

# op -> (rtol, atol) against NumpyBackend. Sources of difference: CUDA expf/log1pf (a few ulp),
# and the fixed GPU reduction orders (warp butterfly / block tree) vs numpy's order.
TOL = {
    "hc_weights": (2e-5, 2e-6),   # 512-long matvec, softmax, 20 Sinkhorn rounds
    "hc_collapse": (0.0, 0.0),    # same ops, same order, no transcendental: bit-equal
    "hc_combine": (0.0, 0.0),
    "stream_mean": (0.0, 0.0),
    "short_conv": (1e-5, 1e-6),   # K-tap sum in the reference's order; SiLU's expf
    "kda_gate": (1e-5, 1e-6),     # expf(a_log) times z, then sigmoid or softplus
    "kda_recurrence": (1e-4, 1e-6),  # 15 rows of dk-reductions through the carried state
}






@dataclass(frozen=True)
class Case:
    """`make(rng, t)` -> (row inputs with a leading t axis, shared inputs, state or None);
    `call(be, rows, shared, state)` -> tuple of outputs with a leading row axis. A stateful op
    advances `state` (ring or KDA state) in place."""

    name: str
    op: str
    make: Callable
    call: Callable


# ---- input builders -----------------------------------------------------------------------------

def _hc_weights_case(n, d, iters):
    def make(rng, t):
        shared = {"fn": normal(rng, ((2 + n) * n, n * d), 2.0 / np.sqrt(n * d)),
                  "base": normal(rng, ((2 + n) * n,), 0.5), "scale": uniform(rng, (3,), 0.5, 1.5)}
        return {"streams": normal(rng, (t, n, d))}, shared, None

    def call(be, r, s, _):
        return be.hc_weights(r["streams"], s["fn"], s["base"], s["scale"], 1e-5, 1e-6, iters)
    return make, call


def _hc_collapse_case(n, d):
    def make(rng, t):
        return {"streams": normal(rng, (t, n, d)), "pre": uniform(rng, (t, n), 0.0, 1.0)}, {}, None
    return make, lambda be, r, s, _: (be.hc_collapse(r["streams"], r["pre"]),)


def _hc_combine_case(n, d):
    def make(rng, t):
        rows = {"streams": normal(rng, (t, n, d)), "f": normal(rng, (t, d)),
                "post": uniform(rng, (t, n), 0.0, 2.0), "comb": uniform(rng, (t, n, n), 0.0, 0.5)}
        return rows, {}, None
    return make, lambda be, r, s, _: (be.hc_combine(r["streams"], r["f"], r["post"], r["comb"]),)


def _stream_mean_case(n, d):
    return (lambda rng, t: ({"streams": normal(rng, (t, n, d))}, {}, None),
            lambda be, r, s, _: (be.stream_mean(r["streams"]),))


def _kda_gate_case(hk, dk, lower_bound):
    def make(rng, t):
        shared = {"a_log": uniform(rng, (hk,), 0.0, np.log(16.0)), "dt_bias": normal(rng, (hk, dk), 0.5)}
        return {"f": normal(rng, (t, hk, dk), 2.0)}, shared, None
    return make, lambda be, r, s, _: (be.kda_gate(r["f"], s["a_log"], s["dt_bias"], lower_bound),)


def _short_conv_case(c, k):
    def make(rng, t):  # the ring starts with history, as mid-sequence
        return {"x": normal(rng, (t, c))}, {"w": normal(rng, (c, k), 0.5)}, normal(rng, (k - 1, c))
    return make, lambda be, r, s, ring: (be.short_conv(r["x"], ring, s["w"]),)


def _unit(a):
    return (a / np.sqrt((a * a).sum(-1, keepdims=True) + F32(1e-6))).astype(F32)


def _kda_recurrence_case(hk, dk, dv):
    def make(rng, t):  # q, k as the mixer makes them: L2-normalised, q scaled by dk^-0.5
        rows = {"q": (_unit(normal(rng, (t, hk, dk))) * F32(dk ** -0.5)).astype(F32),
                "k": _unit(normal(rng, (t, hk, dk))), "v": normal(rng, (t, hk, dv)),
                "g": uniform(rng, (t, hk, dk), -5.0, -0.01), "beta": uniform(rng, (t, hk), 0.05, 0.95)}
        return rows, {}, normal(rng, (hk, dk, dv), 0.3)

    def call(be, r, s, state):
        return (be.kda_recurrence(r["q"], r["k"], r["v"], r["g"], r["beta"], state),)
    return make, call


def _case(name, op, make_call):
    return Case(name, op, *make_call)


CASES = [
    _case("hc_weights_mini", "hc_weights", _hc_weights_case(4, 128, 20)),
    _case("hc_weights_small", "hc_weights", _hc_weights_case(4, 64, 20)),
    _case("hc_weights_odd", "hc_weights", _hc_weights_case(3, 67, 3)),
    _case("hc_collapse_mini", "hc_collapse", _hc_collapse_case(4, 128)),
    _case("hc_collapse_small", "hc_collapse", _hc_collapse_case(4, 64)),
    _case("hc_collapse_odd", "hc_collapse", _hc_collapse_case(3, 67)),
    _case("hc_combine_mini", "hc_combine", _hc_combine_case(4, 128)),
    _case("hc_combine_small", "hc_combine", _hc_combine_case(4, 64)),
    _case("hc_combine_odd", "hc_combine", _hc_combine_case(3, 67)),
    _case("stream_mean_mini", "stream_mean", _stream_mean_case(4, 128)),
    _case("stream_mean_odd", "stream_mean", _stream_mean_case(3, 67)),
    _case("kda_gate_lb_mini", "kda_gate", _kda_gate_case(1, 128, -5.0)),
    _case("kda_gate_lb_small", "kda_gate", _kda_gate_case(2, 32, -5.0)),
    _case("kda_gate_softplus_small", "kda_gate", _kda_gate_case(2, 32, None)),
    _case("kda_gate_softplus_odd", "kda_gate", _kda_gate_case(3, 33, None)),
    _case("short_conv_mini", "short_conv", _short_conv_case(3 * 128, 4)),
    _case("short_conv_small", "short_conv", _short_conv_case(3 * 64, 4)),
    _case("short_conv_odd", "short_conv", _short_conv_case(101, 3)),
    _case("short_conv_k1", "short_conv", _short_conv_case(40, 1)),
    _case("kda_recurrence_mini", "kda_recurrence", _kda_recurrence_case(1, 128, 128)),
    _case("kda_recurrence_small", "kda_recurrence", _kda_recurrence_case(2, 32, 32)),
    _case("kda_recurrence_dk128_h2", "kda_recurrence", _kda_recurrence_case(2, 128, 128)),
    _case("kda_recurrence_odd", "kda_recurrence", _kda_recurrence_case(3, 40, 24)),
]
STATEFUL = {"short_conv", "kda_recurrence"}
_IDS = {"ids": lambda c: c.name}


def _dev(arrays: dict) -> dict:
    return {k: cp.asarray(v) for k, v in arrays.items()}


def _rows(rows: dict, r: int) -> dict:
    return {k: v[r:r + 1] for k, v in rows.items()}


def _host(outs) -> tuple:
    return tuple(cp.asnumpy(o) for o in outs)


# ---- 1. against the numpy reference -------------------------------------------------------------

@pytest.mark.parametrize("t", [1, 7, T_MAX])
@pytest.mark.parametrize("case", CASES, **_IDS)
def test_op_matches_numpy_reference_within_its_bound(case, t):
    rtol, atol = TOL[case.op]
    rows, shared, state = case.make(np.random.default_rng([2, t]), t)
    ref_state = None if state is None else state.copy()
    ref = case.call(NumpyBackend(), rows, shared, ref_state)
    gpu_state = None if state is None else cp.asarray(state)
    got = _host(case.call(RecurrentOps(), _dev(rows), _dev(shared), gpu_state))
    assert len(got) == len(ref)
    for g, e in zip(got, ref):
        assert g.shape == e.shape and g.dtype == F32, (g.shape, e.shape, g.dtype)
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
    if state is not None:
        np.testing.assert_allclose(cp.asnumpy(gpu_state), ref_state, rtol=rtol, atol=atol)


# ---- 2. row invariance, bit for bit ---------------------------------------------------------------



@pytest.mark.parametrize("t", range(1, T_MAX + 1))
@pytest.mark.parametrize("case", [c for c in CASES if c.op not in STATEFUL], **_IDS)
def test_row_of_t_row_call_is_bit_identical_to_row_alone(case, t):
    rows, shared, _ = case.make(np.random.default_rng([3, t]), t)
    ops, rows, shared = RecurrentOps(), _dev(rows), _dev(shared)
    full = _host(case.call(ops, rows, shared, None))
    alone = [_host(case.call(ops, _rows(rows, r), shared, None)) for r in range(t)]
    assert all(o.shape[0] == t for o in full)
    assert mismatched_rows(full, alone) == []


@pytest.mark.parametrize("t", range(1, T_MAX + 1))
@pytest.mark.parametrize("case", [c for c in CASES if c.op in STATEFUL], **_IDS)
def test_stateful_t_row_call_equals_t_successive_one_row_calls(case, t):
    rows, shared, state0 = case.make(np.random.default_rng([4, t]), t)
    ops, rows, shared = RecurrentOps(), _dev(rows), _dev(shared)
    state_full, state_step = cp.asarray(state0), cp.asarray(state0)
    full = _host(case.call(ops, rows, shared, state_full))
    steps = [_host(case.call(ops, _rows(rows, r), shared, state_step)) for r in range(t)]
    assert mismatched_rows(full, steps) == []
    assert np.array_equal(cp.asnumpy(state_full), cp.asnumpy(state_step))
    if state0.size:  # the K=1 conv has an empty ring
        assert not np.array_equal(cp.asnumpy(state_full), state0)  # the state really advanced


# ---- 3. red arms: the check can fail --------------------------------------------------------------

_SPLIT_DOT = r"""
extern "C" __global__ void split_dot(const float* x, const float* w, float* out, int len) {
    // row blockIdx.x: blockDim.x threads each sum a strided slice, thread 0 adds the partials
    extern __shared__ float part[];
    const float* xr = x + (long long)blockIdx.x * len;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) acc += xr[i] * w[i];
    part[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int p = 0; p < blockDim.x; ++p) s += part[p];
        out[blockIdx.x] = s;
    }
}
"""


@functools.cache
def _split_dot_kernel():
    return cp.RawKernel(_SPLIT_DOT, "split_dot", options=("--std=c++17", "--fmad=false"))


def _split_dot(x, w, threads: int):
    out = cp.empty((x.shape[0], 1), cp.float32)
    _split_dot_kernel()((x.shape[0],), (threads,), (x, w, out, np.int32(x.shape[1])),
                        shared_mem=4 * threads)
    return (cp.asnumpy(out),)


def _split_dot_failures(split_for_t: Callable[[int], int]) -> list[int]:
    """Row counts t for which the t-row launch differs bitwise from the rows launched alone."""
    rng = np.random.default_rng(5)
    x, w = cp.asarray(normal(rng, (T_MAX, 4096))), cp.asarray(normal(rng, (4096,)))
    failing = []
    for t in range(1, T_MAX + 1):
        full = _split_dot(x[:t], w, split_for_t(t))
        alone = [_split_dot(x[r:r + 1], w, split_for_t(1)) for r in range(t)]
        if mismatched_rows(full, alone):
            failing.append(t)
    return failing


def test_red_arm_split_count_growing_with_t_breaks_row_invariance():
    """The mutation the exact-class rule forbids: the reduction is split into 32 t slices."""
    failing = _split_dot_failures(lambda t: 32 * t)
    assert failing, "a split count of 32 t matched the t = 1 split bit for bit for every t"
    assert 1 not in failing
    assert _split_dot_failures(lambda t: 32) == []  # green arm: a fixed split size


def test_red_arm_one_ulp_change_in_one_kda_row_is_detected():
    case = next(c for c in CASES if c.name == "kda_recurrence_small")
    rows, shared, state0 = case.make(np.random.default_rng(6), T_MAX)
    ops, rows = RecurrentOps(), _dev(rows)
    full = _host(case.call(ops, rows, shared, cp.asarray(state0)))
    state = cp.asarray(state0)
    steps = [_host(case.call(ops, _rows(rows, r), shared, state)) for r in range(T_MAX)]
    assert mismatched_rows(full, steps) == []
    steps[9][0][0, 1, 7] = np.nextafter(steps[9][0][0, 1, 7], F32(np.inf))
    assert mismatched_rows(full, steps) == [(9, 0)]


# ---- the table covers the family; the wrappers guard their kernels --------------------------------

def test_every_op_of_the_family_is_in_the_table_with_the_reference_signature():
    ops = {n for n in dir(RecurrentOps) if not n.startswith("_")}
    assert ops == set(TOL) == {c.op for c in CASES}
    for op in ops:
        ours, ref = (list(inspect.signature(getattr(cls, op)).parameters) for cls in (RecurrentOps, NumpyBackend))
        assert ours == ref, op


def test_in_place_state_must_be_contiguous_float32():
    case = next(c for c in CASES if c.name == "kda_recurrence_small")
    rows, shared, state0 = case.make(np.random.default_rng(8), 2)
    ops, rows = RecurrentOps(), _dev(rows)
    with pytest.raises(AssertionError, match="state"):
        case.call(ops, rows, shared, cp.asarray(state0, dtype=cp.float64))
    strided = cp.asarray(np.ascontiguousarray(state0.transpose(0, 2, 1))).transpose(0, 2, 1)
    with pytest.raises(AssertionError, match="state"):
        case.call(ops, rows, shared, strided)
    with pytest.raises(AssertionError, match="x"):
        RecurrentOps().short_conv(np.zeros((1, 4), F32), cp.zeros((3, 4), cp.float32), cp.zeros((4, 4), cp.float32))


def test_strided_read_only_inputs_are_accepted():
    """v arrives as a view sliced out of the conv output; the wrapper copies it to C order."""
    case = next(c for c in CASES if c.name == "kda_recurrence_small")
    rows, _, state0 = case.make(np.random.default_rng(9), 3)
    ops, dev = RecurrentOps(), _dev(rows)
    wide = cp.concatenate([dev["v"], dev["v"]], axis=2)[:, :, :32]
    assert not wide.flags.c_contiguous
    a = ops.kda_recurrence(dev["q"], dev["k"], wide, dev["g"], dev["beta"], cp.asarray(state0))
    b = ops.kda_recurrence(dev["q"], dev["k"], dev["v"], dev["g"], dev["beta"], cp.asarray(state0))
    assert cp.array_equal(a, b)
