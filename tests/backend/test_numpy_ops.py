"""Row exactness of the numpy reference backend (DESIGN.md section 2, the exact class).

For every op with a row axis and every t in 1..15: row r of one t-row call is bit-identical
(np.array_equal, never allclose) to the same row computed alone (t = 1). The stateful ops
(short_conv, kda_recurrence) advance their state over the rows in order, so for them a t-row
call equals t successive 1-row calls, outputs and final state bit for bit.

The red arm shows the check can fail: a backend whose `linear` batches all rows into one gemm
(`x @ w.T`) is caught, and a one-ulp change of a single row is caught too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from memra.backend.numpy_ref import NumpyBackend
from tests.backend.inputs import linears, make_head_linear, make_linear, make_linears, make_norm, mismatched_rows, normal, uniform

F32 = np.float32
T_MAX = 15  # the exact-class row cap (K <= 14)
ROW_COUNTS = range(1, T_MAX + 1)






@dataclass(frozen=True)
class RowCase:
    """One op of the table: `make(rng, t)` -> (row inputs with a leading t axis, shared inputs);
    `call(be, rows, shared, r0)` -> tuple of outputs with a leading row axis. r0 is the position
    offset of the block's first row (only kpool_select uses it)."""

    name: str
    make: Callable
    call: Callable


def _case(name, make, call):
    return RowCase(name, make, lambda be, rows, shared, r0: _as_tuple(call(be, rows, shared, r0)))


def _as_tuple(out):
    return tuple(out) if isinstance(out, tuple) else (out,)


# ---- input builders for the table -------------------------------------------------------------

def _make_rows_only(**shapes):
    """Row inputs of the given per-row shapes, N(0, std) with std given as the last element."""
    def make(rng, t):
        return {k: normal(rng, (t, *s[:-1]), s[-1]) for k, s in shapes.items()}, {}
    return make


def _make_embed(rng, t):
    return {"ids": rng.integers(0, 97, t)}, {"table": normal(rng, (97, 128))}








def _make_gated_rmsnorm(rng, t):
    rows = {"o": normal(rng, (t, 2, 32)), "gate": normal(rng, (t, 2, 32), 2.0)}
    return rows, {"w": (1 + 0.3 * normal(rng, (32,))).astype(F32)}


def _make_swiglu(rng, t):
    # std 8 so that both clamps at limit 10 engage in most rows
    return {"gate": normal(rng, (t, 96), 8.0), "up": normal(rng, (t, 96), 8.0)}, {}


def _make_argmax(rng, t):
    # small integers: many exact ties, which argmax must break identically per row
    return {"x": rng.integers(0, 5, (t, 64)).astype(F32)}, {}


def _make_pick(rng, t):
    return {"x": normal(rng, (t, 3, 129)), "idx": rng.integers(0, 129, (t, 3))}, {}


def _make_kda_gate(rng, t):
    rows = {"f": normal(rng, (t, 2, 32), 2.0)}
    return rows, {"a_log": uniform(rng, (2,), 0.0, np.log(16.0)), "dt_bias": normal(rng, (2, 32), 0.5)}


def _make_hc_weights(rng, t):
    n, d = 4, 64
    shared = {"fn": normal(rng, ((2 + n) * n, n * d), 2.0 / np.sqrt(n * d)),
              "base": normal(rng, ((2 + n) * n,), 0.5), "scale": uniform(rng, (3,), 0.5, 1.5)}
    return {"streams": normal(rng, (t, n, d))}, shared


def _make_hc_collapse(rng, t):
    return {"streams": normal(rng, (t, 4, 64)), "pre": uniform(rng, (t, 4), 0.0, 1.0)}, {}


def _make_hc_combine(rng, t):
    rows = {"streams": normal(rng, (t, 4, 64)), "f": normal(rng, (t, 64)),
            "post": uniform(rng, (t, 4), 0.0, 2.0), "comb": uniform(rng, (t, 4, 4), 0.0, 0.5)}
    return rows, {}


def _make_kpool_compress(rng, t):
    rows = {"keys": normal(rng, (t, 4, 16)), "gates": normal(rng, (t, 4, 16))}
    return rows, {"ape": normal(rng, (4, 16), 0.5)}


def _make_moe_route(d, e, n_group):
    def make(rng, t):
        shared = {"w_gate": normal(rng, (e, d), d ** -0.5), "bias": uniform(rng, (e,), -0.1, 0.1),
                  "n_group": n_group}
        return {"x": normal(rng, (t, d))}, shared
    return make


def _make_moe_experts(rng, t):
    e, i, d = 8, 32, 64
    idx = np.sort(np.stack([rng.choice(e, 2, replace=False) for _ in range(t)]), axis=1)
    rows = {"x": normal(rng, (t, d)), "idx": idx, "wts": uniform(rng, (t, 2), 0.1, 2.5)}
    shared = {"gate_w": normal(rng, (e, i, d), d ** -0.5), "up_w": normal(rng, (e, i, d), d ** -0.5),
              "down_w": normal(rng, (e, d, i), i ** -0.5)}
    return rows, shared


MLA_LEN, MLA_WIDTH = 40, 11


def _make_mla_attend(rng, t):
    # each row owns its position list: row r sits at position 25 + r and attends a random
    # ascending subset of 0..25+r, -1 padded to the width
    positions = np.full((t, MLA_WIDTH), -1, np.int32)
    for r in range(t):
        p = 25 + r
        n = rng.integers(1, MLA_WIDTH + 1)
        positions[r, :n] = np.sort(rng.choice(p + 1, n, replace=False))
    rows = {"q_lat": normal(rng, (t, 4, 32)), "positions": positions}
    return rows, {"latent": normal(rng, (MLA_LEN, 32))}


def _make_mla_attention(rng, t):
    rows, shared = _make_mla_attend(rng, t)
    shared.update(w_uk_t=normal(rng, (4, 32, 8), 8 ** -0.5), w_uv=normal(rng, (4, 16, 32), 32 ** -0.5))
    return {"q": normal(rng, (t, 4, 8)), "positions": rows["positions"]}, shared


KPOOL_POS0 = 5  # rows 5..19: n = (p+1)//4 runs 1..5 pools, so dense and sparse rows mix (G=2)


def _make_kpool_select(rng, t):
    rows = {"q": normal(rng, (t, 4, 16)), "w": normal(rng, (t, 4), 0.5)}
    return rows, {"pool_keys": normal(rng, (6, 16))}


ROW_CASES = [
    _case("embed", _make_embed, lambda be, r, s, _: be.embed(s["table"], r["ids"])),
    _case("linear", make_linear(128, 64), lambda be, r, s, _: be.linear(r["x"], s["w"])),
    _case("linear_odd", make_linear(67, 129), lambda be, r, s, _: be.linear(r["x"], s["w"])),
    _case("linears", make_linears(67, (129, 5, 64)), lambda be, r, s, _: linears(be, r, s)),
    _case("head_linear", make_head_linear(4, 16, 32), lambda be, r, s, _: be.head_linear(r["x"], s["w"])),
    _case("head_linear_odd", make_head_linear(3, 17, 13), lambda be, r, s, _: be.head_linear(r["x"], s["w"])),
    _case("rmsnorm", make_norm((128,)), lambda be, r, s, _: be.rmsnorm(r["x"], s["w"], 1e-5)),
    _case("rmsnorm_per_head", make_norm((2, 33)), lambda be, r, s, _: be.rmsnorm(r["x"], s["w"], 1e-5)),
    _case("rmsnorm_unweighted", make_norm((256,), weighted=False),
          lambda be, r, s, _: be.rmsnorm(r["x"], None, 1e-5)),
    _case("layernorm", make_norm((16,), bias=True), lambda be, r, s, _: be.layernorm(r["x"], s["w"], s["b"], 1e-6)),
    _case("l2norm", _make_rows_only(x=(2, 32, 1.0)), lambda be, r, s, _: be.l2norm(r["x"], 1e-6)),
    _case("l2norm_odd", _make_rows_only(x=(1, 129, 1.0)), lambda be, r, s, _: be.l2norm(r["x"], 1e-6)),
    _case("l2norm_scaled", _make_rows_only(x=(4, 128, 1.0)),
          lambda be, r, s, _: be.l2norm(r["x"], 1e-6, scale=128 ** -0.5)),
    _case("gated_rmsnorm", _make_gated_rmsnorm, lambda be, r, s, _: be.gated_rmsnorm(r["o"], r["gate"], s["w"], 1e-5)),
    _case("silu", _make_rows_only(x=(129, 3.0)), lambda be, r, s, _: be.silu(r["x"])),
    _case("sigmoid", _make_rows_only(x=(129, 3.0)), lambda be, r, s, _: be.sigmoid(r["x"])),
    _case("swiglu", _make_swiglu, lambda be, r, s, _: be.swiglu(r["gate"], r["up"], 10.0)),
    _case("scale", _make_rows_only(x=(2, 129, 2.0)), lambda be, r, s, _: be.scale(r["x"], 128 ** -0.5)),
    _case("add", _make_rows_only(a=(129, 1.0), b=(129, 1.0)), lambda be, r, s, _: be.add(r["a"], r["b"])),
    _case("softmax", _make_rows_only(x=(256, 3.0)), lambda be, r, s, _: be.softmax(r["x"])),
    _case("log_softmax", _make_rows_only(x=(256, 3.0)), lambda be, r, s, _: be.log_softmax(r["x"])),
    _case("argmax", _make_argmax, lambda be, r, s, _: be.argmax(r["x"])),
    _case("top_k", _make_argmax, lambda be, r, s, _: be.top_k(r["x"], 9)),
    _case("argmax_prob", _make_argmax, lambda be, r, s, _: be.argmax_prob(r["x"])),
    _case("pick", _make_pick, lambda be, r, s, _: be.pick(r["x"], r["idx"])),
    _case("filtered_rows", _make_rows_only(x=(256, 3.0)), lambda be, r, s, _: be.filtered_rows(r["x"], 0.8, 20, 0.9, 0.01)),
    _case("kda_gate_lower_bound", _make_kda_gate,
          lambda be, r, s, _: be.kda_gate(r["f"], s["a_log"], s["dt_bias"], -5.0)),
    _case("kda_gate_softplus", _make_kda_gate,
          lambda be, r, s, _: be.kda_gate(r["f"], s["a_log"], s["dt_bias"], None)),
    _case("hc_weights", _make_hc_weights,
          lambda be, r, s, _: be.hc_weights(r["streams"], s["fn"], s["base"], s["scale"], 1e-5, 1e-6, 20)),
    _case("hc_site", _make_hc_weights,  # the block: any per-row function of the collapsed rows
          lambda be, r, s, _: be.hc_site(r["streams"], s["fn"], s["base"], s["scale"], 1e-5, 1e-6, 20,
                                         lambda x: x * np.float32(0.5) + np.float32(1.0))),
    _case("hc_collapse", _make_hc_collapse, lambda be, r, s, _: be.hc_collapse(r["streams"], r["pre"])),
    _case("hc_combine", _make_hc_combine,
          lambda be, r, s, _: be.hc_combine(r["streams"], r["f"], r["post"], r["comb"])),
    _case("stream_mean", _make_rows_only(streams=(4, 64, 1.0)), lambda be, r, s, _: be.stream_mean(r["streams"])),
    _case("kpool_compress", _make_kpool_compress,
          lambda be, r, s, _: be.kpool_compress(r["keys"], r["gates"], s["ape"])),
    _case("moe_route_grouped", _make_moe_route(64, 8, 2),
          lambda be, r, s, _: be.moe_route(r["x"], s["w_gate"], s["bias"], s["n_group"], 1, 2, True, 2.5)),
    _case("moe_route_flat", _make_moe_route(128, 4, 1),
          lambda be, r, s, _: be.moe_route(r["x"], s["w_gate"], s["bias"], s["n_group"], 1, 2, True, 2.5)),
    _case("moe_experts", _make_moe_experts,
          lambda be, r, s, _: be.moe_experts(r["x"], r["idx"], r["wts"], s["gate_w"], s["up_w"], s["down_w"], 10.0)),
    _case("mla_attend", _make_mla_attend,
          lambda be, r, s, _: be.mla_attend(r["q_lat"], s["latent"], r["positions"], 32 ** -0.5)),
    _case("mla_attention", _make_mla_attention,
          lambda be, r, s, _: be.mla_attention(r["q"], s["latent"], r["positions"], s["w_uk_t"], s["w_uv"],
                                               8 ** -0.5)),
    _case("kpool_select", _make_kpool_select,
          lambda be, r, s, r0: be.kpool_select(r["q"], r["w"], s["pool_keys"], KPOOL_POS0 + r0, 4, 2, 11, 16 ** -0.5)),
]


# ---- the check ------------------------------------------------------------------------------



def _row_invariance_failures(be, case: RowCase, t: int, seed: int = 0):
    rows, shared = case.make(np.random.default_rng([seed, t]), t)
    full = case.call(be, rows, shared, 0)
    alone = [case.call(be, {k: v[r:r + 1] for k, v in rows.items()}, shared, r) for r in range(t)]
    for out in full:
        assert out.shape[0] == t
    return mismatched_rows(full, alone)


@pytest.mark.parametrize("t", ROW_COUNTS)
@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: c.name)
def test_row_of_t_row_call_is_bit_identical_to_row_alone(case, t):
    assert _row_invariance_failures(NumpyBackend(), case, t) == []


def test_row_table_covers_every_row_op_of_the_backend():
    """A new backend op must join the table (or be listed here as having no row axis)."""
    no_row_axis = {"asarray", "weight", "matrix", "zeros", "to_host", "to_host_async", "concat", "contiguous", "copy",
                   "assign", "race_draw", "name", "position", "walks",
                   "xp", "compiles_on_first_use", "device_name", "synchronize",  # capabilities
                   "beside",  # runs a caller's ops (their own rows): tests/backend/test_cuda_beside.py
                   "write_rows", "kpool_finalize",  # plane writes: tests/model/test_plane_writes.py
                   "short_conv", "kda_recurrence",  # the stateful table below
                   "kda_replay",  # a rollback's state walk: tests/backend/test_kda_snapshots.py
                   "kda_chunks",  # prime class, not row invariant: tests/backend/test_kda_chunks.py
                   "block_attention"}  # a block's rows attend to each other: tests/drafters/test_dflash2_graphs.py
    ops = {n for n in dir(NumpyBackend) if not n.startswith("_")}
    covered = {c.name for c in ROW_CASES}
    missing = [op for op in ops - no_row_axis if not any(c == op or c.startswith(op + "_") for c in covered)]
    assert missing == []


# ---- stateful ops: one t-row call == t successive 1-row calls ---------------------------------

def _short_conv_case(rng, t):
    c, k = 3 * 64, 4
    inputs = {"x": normal(rng, (t, c))}
    return inputs, {"w": normal(rng, (c, k), 0.5)}, normal(rng, (k - 1, c))  # ring with history


def _kda_recurrence_case(rng, t):
    hk, dk = 2, 32

    def unit(a):
        return (a / np.sqrt((a * a).sum(-1, keepdims=True) + F32(1e-6))).astype(F32)

    inputs = {"q": (unit(normal(rng, (t, hk, dk))) * F32(dk ** -0.5)).astype(F32),
              "k": unit(normal(rng, (t, hk, dk))), "v": normal(rng, (t, hk, dk)),
              "g": uniform(rng, (t, hk, dk), -5.0, -0.01), "beta": uniform(rng, (t, hk), 0.05, 0.95)}
    return inputs, {}, normal(rng, (hk, dk, dk), 0.3)


STATEFUL = {
    "short_conv": (_short_conv_case, lambda be, i, s, st: be.short_conv(i["x"], st, s["w"])),
    "kda_recurrence": (_kda_recurrence_case,
                       lambda be, i, s, st: be.kda_recurrence(i["q"], i["k"], i["v"], i["g"], i["beta"], st)),
}


@pytest.mark.parametrize("t", ROW_COUNTS)
@pytest.mark.parametrize("op", sorted(STATEFUL))
def test_stateful_t_row_call_equals_t_successive_single_row_calls(op, t):
    make, call = STATEFUL[op]
    be = NumpyBackend()
    inputs, shared, state0 = make(np.random.default_rng([1, t]), t)
    state_full, state_step = state0.copy(), state0.copy()
    full = call(be, inputs, shared, state_full)
    steps = [call(be, {k: v[r:r + 1] for k, v in inputs.items()}, shared, state_step) for r in range(t)]
    assert mismatched_rows((full,), [(s,) for s in steps]) == []
    assert np.array_equal(state_full, state_step)
    assert not np.array_equal(state_full, state0)  # the state really advanced


# ---- red arm: the check can fail ---------------------------------------------------------------

class _BatchedGemmBackend(NumpyBackend):
    """The mutation: `linear` as one gemm over all rows, as a prime-class kernel would do."""

    def linear(self, x, w):
        return (x @ w.T).astype(F32)


@pytest.mark.parametrize("case", [c for c in ROW_CASES if c.name.startswith("linear")], ids=lambda c: c.name)
def test_red_arm_batched_gemm_linear_breaks_row_invariance(case):
    failing_t = [t for t in range(2, T_MAX + 1) if _row_invariance_failures(_BatchedGemmBackend(), case, t)]
    assert failing_t, "one gemm over t rows matched per-row gemv bit for bit for every t in 2..15"
    assert _row_invariance_failures(NumpyBackend(), case, max(failing_t)) == []  # green arm beside it


def test_red_arm_one_ulp_change_in_one_row_is_detected():
    rng = np.random.default_rng(7)
    full = (normal(rng, (15, 64)),)
    alone = [(full[0][r:r + 1].copy(),) for r in range(15)]
    assert mismatched_rows(full, alone) == []
    alone[9][0][0, 31] = np.nextafter(alone[9][0][0, 31], F32(np.inf))
    assert mismatched_rows(full, alone) == [(9, 0)]


# ---- saturation ---------------------------------------------------------------------------------

def test_sigmoid_saturates_without_overflow_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = NumpyBackend().sigmoid(np.array([[-100.0, 100.0]], F32))
    assert 0 <= out[0, 0] < 1e-30 and out[0, 1] == 1


def test_log_softmax_is_the_log_of_softmax():
    x = np.random.default_rng(4).standard_normal((3, 257)).astype(F32) * 8
    be = NumpyBackend()
    ls = be.log_softmax(x)
    assert np.allclose(np.exp(ls).sum(-1), 1.0, rtol=1e-5)
    assert np.allclose(ls, np.log(be.softmax(x)), rtol=1e-5, atol=1e-5)


def test_short_conv_in_groups_lays_each_groups_rows_side_by_side():
    """groups=3 (KDA's q, k, v): [3, t, C / 3], each group's rows of the [t, C] result."""
    rng = np.random.default_rng(4)
    x, w, ring = normal(rng, (5, 12)), normal(rng, (12, 4), 0.5), normal(rng, (3, 12))
    flat = NumpyBackend().short_conv(x, ring.copy(), w)
    grouped = NumpyBackend().short_conv(x, ring.copy(), w, groups=3)
    assert grouped.shape == (3, 5, 4) and grouped.flags.c_contiguous
    assert np.array_equal(grouped, flat.reshape(5, 3, 4).transpose(1, 0, 2))
    assert not np.array_equal(grouped, flat.reshape(3, 5, 4))  # red arm: the layout is told apart


def test_a_scaled_l2norm_is_the_scale_of_the_l2norm():
    """l2norm(x, eps, scale) (KDA's q) has the bits of scale(l2norm(x, eps)); scale 1 is l2norm."""
    x, be = normal(np.random.default_rng(5), (6, 128)), NumpyBackend()
    assert np.array_equal(be.l2norm(x, 1e-6, scale=128 ** -0.5), be.scale(be.l2norm(x, 1e-6), 128 ** -0.5))
    assert np.array_equal(be.l2norm(x, 1e-6, scale=1.0), be.l2norm(x, 1e-6))
    # red arm: the scale taken before the division moves some bits, so the equality above is the order's
    den = np.stack([np.sqrt(np.sum(r * r, dtype=np.float32) + np.float32(1e-6)) for r in x])[:, None]
    assert np.array_equal(be.l2norm(x, 1e-6), x / den)  # the same denominator as the op's
    assert not np.array_equal(be.l2norm(x, 1e-6, scale=128 ** -0.5), (x * np.float32(128 ** -0.5)) / den)
