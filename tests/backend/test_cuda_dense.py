"""The CUDA dense family (DenseOps: kernels_cu/dense.cu and norm.cu) against its numpy twin.

Three gates, ggml style (DESIGN.md section 2):
* accuracy: every op on random inputs matches NumpyBackend within its own (rtol, atol) from
  TOLERANCE; bf16 weights (the tensor-core path) are compared with the reference run on the
  widened weights, and an identity weight must return the activations bit for bit (the three
  bf16 pieces of a float32 add back up exactly);
* row exactness: for t = 1..15, row r of a GPU t-row call is bit-identical to the GPU call on
  that row alone (np.array_equal on host copies, never allclose);
* red arm: a linear kernel whose reduction splits into t parts (a split COUNT) fails the row
  check for some t while DenseOps passes it on the same inputs, and a one-ulp change of a single
  GPU output row is caught.
Run on the GPU host: python3 -m pytest -m gpu tests/backend/test_cuda_dense.py
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda_dense import DenseOps, split_k
from memra.backend.numpy_ref import NumpyBackend
from memra.errors import InputError
from memra.safetensors_io import bf16_to_f32, f32_to_bf16
from tests.backend.inputs import make_head_linear, make_linear, make_norm, normal

F32 = np.float32
T_MAX = 15  # the exact-class row cap (K <= 14)

# op -> (rtol, atol) against NumpyBackend. Gathers and argmax do no arithmetic: exact. Dot
# products and row sums differ from numpy's (pairwise / BLAS FMA) order; transcendentals from
# CUDA's expf differ by an ulp or two.
TOLERANCE = {
    "embed": (0.0, 0.0),
    "linear": (1e-4, 1e-5),
    "head_linear": (1e-4, 1e-5),
    "rmsnorm": (1e-5, 1e-6),
    "layernorm": (1e-5, 1e-5),
    "l2norm": (1e-5, 1e-6),
    "gated_rmsnorm": (1e-5, 1e-6),
    "silu": (1e-5, 1e-6),
    "sigmoid": (1e-5, 1e-6),
    "swiglu": (1e-5, 1e-5),
    "softmax": (1e-5, 1e-8),
    "log_softmax": (1e-5, 1e-5),
    "argmax": (0.0, 0.0),
}




def _bf16(rng, shape, std):
    return f32_to_bf16(normal(rng, shape, std))


@dataclass(frozen=True)
class Case:
    """`make(rng, t)` -> (row inputs with a leading t axis, shared inputs), all numpy;
    `call(be, rows, shared)` -> one output with a leading row axis."""

    name: str
    make: Callable
    call: Callable

    @property
    def op(self) -> str:
        return next(op for op in sorted(TOLERANCE, key=len, reverse=True)
                    if self.name == op or self.name.startswith(op + "_"))


def _rows(**shapes):
    """Row inputs of the given per-row shapes, N(0, std) with std as the last element."""
    def make(rng, t):
        return {k: normal(rng, (t, *s[:-1]), s[-1]) for k, s in shapes.items()}, {}
    return make


def _make_embed(weight):
    def make(rng, t):
        table = weight(rng, (97, 128), 1.0)
        return {"ids": rng.integers(0, 97, t)}, {"table": table}
    return make








def _make_gated(shape):
    def make(rng, t):
        rows = {"o": normal(rng, (t, *shape)), "gate": normal(rng, (t, *shape), 2.0)}
        return rows, {"w": (1 + 0.3 * normal(rng, shape[-1:])).astype(F32)}
    return make


def _make_swiglu(rng, t):
    # std 8 so that both clamps at limit 10 engage in most rows
    return {"gate": normal(rng, (t, 96), 8.0), "up": normal(rng, (t, 96), 8.0)}, {}


def _make_argmax_ties(rng, t):
    # small integers: many exact ties, which argmax must break to the lowest index in every row
    return {"x": rng.integers(0, 5, (t, 300)).astype(F32)}, {}


def _device_ids(be, ids):
    return cp.asarray(ids) if isinstance(be, DenseOps) else ids


CASES = [
    Case("embed", _make_embed(normal), lambda be, r, s: be.embed(s["table"], r["ids"])),
    Case("embed_bf16_device_ids", _make_embed(_bf16),
         lambda be, r, s: be.embed(s["table"], _device_ids(be, r["ids"]))),
    Case("linear", make_linear(128, 64), lambda be, r, s: be.linear(r["x"], s["w"])),
    Case("linear_odd", make_linear(67, 129), lambda be, r, s: be.linear(r["x"], s["w"])),
    Case("linear_long_in", make_linear(515, 70), lambda be, r, s: be.linear(r["x"], s["w"])),
    Case("linear_bf16", make_linear(128, 64, _bf16), lambda be, r, s: be.linear(r["x"], s["w"])),
    Case("linear_bf16_odd", make_linear(300, 45, _bf16), lambda be, r, s: be.linear(r["x"], s["w"])),
    # several in-feature blocks per warp, a full last chunk (1032 = 4 * 256 + 8) / a ragged one
    Case("linear_bf16_wide", make_linear(1032, 70, _bf16), lambda be, r, s: be.linear(r["x"], s["w"])),
    Case("linear_bf16_wide_odd", make_linear(1029, 33, _bf16), lambda be, r, s: be.linear(r["x"], s["w"])),
    # split-K: 4608 in-features are three 2048-wide slices (the last ragged), 70 outputs one block
    Case("linear_bf16_split_k", make_linear(4608, 70, _bf16), lambda be, r, s: be.linear(r["x"], s["w"])),
    Case("head_linear", make_head_linear(4, 16, 32), lambda be, r, s: be.head_linear(r["x"], s["w"])),
    Case("head_linear_odd", make_head_linear(3, 17, 13), lambda be, r, s: be.head_linear(r["x"], s["w"])),
    Case("head_linear_bf16", make_head_linear(2, 64, 40, _bf16),
         lambda be, r, s: be.head_linear(r["x"], s["w"])),
    Case("head_linear_bf16_odd", make_head_linear(3, 17, 13, _bf16),
         lambda be, r, s: be.head_linear(r["x"], s["w"])),
    Case("rmsnorm", make_norm((128,)), lambda be, r, s: be.rmsnorm(r["x"], s["w"], 1e-5)),
    Case("rmsnorm_per_head", make_norm((2, 33)), lambda be, r, s: be.rmsnorm(r["x"], s["w"], 1e-5)),
    Case("rmsnorm_unweighted", make_norm((256,), weighted=False),
         lambda be, r, s: be.rmsnorm(r["x"], None, 1e-5)),
    Case("rmsnorm_long", make_norm((1000,)), lambda be, r, s: be.rmsnorm(r["x"], s["w"], 1e-6)),
    Case("layernorm", make_norm((16,), bias=True), lambda be, r, s: be.layernorm(r["x"], s["w"], s["b"], 1e-6)),
    Case("layernorm_odd", make_norm((301,), bias=True),
         lambda be, r, s: be.layernorm(r["x"], s["w"], s["b"], 1e-5)),
    Case("l2norm", _rows(x=(2, 32, 1.0)), lambda be, r, s: be.l2norm(r["x"], 1e-6)),
    Case("l2norm_odd", _rows(x=(1, 129, 1.0)), lambda be, r, s: be.l2norm(r["x"], 1e-6)),
    Case("gated_rmsnorm", _make_gated((2, 64)), lambda be, r, s: be.gated_rmsnorm(r["o"], r["gate"], s["w"], 1e-5)),
    Case("gated_rmsnorm_odd", _make_gated((3, 65)),
         lambda be, r, s: be.gated_rmsnorm(r["o"], r["gate"], s["w"], 1e-5)),
    Case("silu", _rows(x=(129, 3.0)), lambda be, r, s: be.silu(r["x"])),
    Case("sigmoid", _rows(x=(2, 129, 3.0)), lambda be, r, s: be.sigmoid(r["x"])),
    Case("swiglu", _make_swiglu, lambda be, r, s: be.swiglu(r["gate"], r["up"], 10.0)),
    Case("softmax", _rows(x=(256, 3.0)), lambda be, r, s: be.softmax(r["x"])),
    Case("log_softmax", _rows(x=(256, 3.0)), lambda be, r, s: be.log_softmax(r["x"])),
    Case("softmax_odd", _rows(x=(3, 67, 3.0)), lambda be, r, s: be.softmax(r["x"])),
    Case("argmax", _rows(x=(1001, 1.0)), lambda be, r, s: be.argmax(r["x"])),
    Case("argmax_ties", _make_argmax_ties, lambda be, r, s: be.argmax(r["x"])),
]


# ---- running a case on either backend ----------------------------------------------------------

def _to_device(v):
    """Float and bf16 arrays go to the device; integer ids stay on the host (embed uploads them)."""
    if isinstance(v, np.ndarray) and v.dtype in (np.float32, np.uint16):
        return cp.asarray(v)
    return v


def _to_reference(v):
    """The reference computes in float32 on the bf16-widened weights."""
    return bf16_to_f32(v) if isinstance(v, np.ndarray) and v.dtype == np.uint16 else v


def _run(be, case: Case, rows: dict, shared: dict) -> np.ndarray:
    conv = _to_device if isinstance(be, DenseOps) else _to_reference
    out = case.call(be, {k: conv(v) for k, v in rows.items()}, {k: conv(v) for k, v in shared.items()})
    return cp.asnumpy(out) if isinstance(out, cp.ndarray) else np.asarray(out)


def _mismatched_rows(be, case: Case, rows: dict, shared: dict) -> list[int]:
    """Rows r where the t-row call differs in any bit from the call on row r alone."""
    full = _run(be, case, rows, shared)
    t = next(iter(rows.values())).shape[0]
    assert full.shape[0] == t
    bad = []
    for r in range(t):
        alone = _run(be, case, {k: v[r:r + 1] for k, v in rows.items()}, shared)
        assert alone.shape == (1, *full.shape[1:]) and alone.dtype == full.dtype
        if not np.array_equal(full[r], alone[0]):
            bad.append(r)
    return bad


# ---- gate 1: accuracy against the numpy reference -------------------------------------------------

@pytest.mark.parametrize("t", [1, 7, 15])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_op_matches_numpy_reference_within_its_tolerance(case, t):
    rows, shared = case.make(np.random.default_rng([2, t]), t)
    got = _run(DenseOps(), case, rows, shared)
    want = _run(NumpyBackend(), case, rows, shared)
    assert got.shape == want.shape
    rtol, atol = TOLERANCE[case.op]
    if rtol == atol == 0:
        assert np.array_equal(got, want)
    else:
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def test_table_covers_every_dense_op():
    ops = {n for n in dir(DenseOps) if not n.startswith("_")}
    assert ops == set(TOLERANCE)
    assert {c.op for c in CASES} == ops


# ---- gate 2: row exactness on the GPU ------------------------------------------------------------

@pytest.mark.parametrize("t", range(1, T_MAX + 1))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_row_of_t_row_call_is_bit_identical_to_row_alone(case, t):
    rows, shared = case.make(np.random.default_rng([0, t]), t)
    assert _mismatched_rows(DenseOps(), case, rows, shared) == []


@pytest.mark.parametrize("name", ["linear_long_in", "linear_bf16_odd", "linear_bf16_wide_odd", "head_linear_bf16"])
def test_projection_beyond_one_row_tile_stays_accurate_and_row_exact(name):
    """t > 16 (prime class) takes several weight passes; each row's order is still its own."""
    case = next(c for c in CASES if c.name == name)
    rows, shared = case.make(np.random.default_rng(3), 37)
    got = _run(DenseOps(), case, rows, shared)
    np.testing.assert_allclose(got, _run(NumpyBackend(), case, rows, shared),
                               rtol=TOLERANCE[case.op][0], atol=TOLERANCE[case.op][1])
    assert _mismatched_rows(DenseOps(), case, rows, shared) == []


def test_split_k_follows_the_shape_never_the_exact_class_row_count():
    assert {split_k(t, 4608, 70) for t in range(1, 16)} == {3}  # the split-K table case
    assert split_k(1, 8192, 4096) == 4 and split_k(1, 16384, 4096) == 8  # o_proj: 128 output blocks
    assert split_k(1, 4096, 8192) == 1 and split_k(1, 4096, 154880) == 1  # outputs fill the GPU
    assert split_k(1, 2048, 4096) == 1  # short in-features
    assert split_k(16, 8192, 4096) == 1  # prime class: accuracy only, no partial buffers


@pytest.mark.parametrize("n_in", [256, 1029, 4100])  # 4100: split-K into three slices
def test_bf16_identity_weight_returns_the_activations_bit_for_bit(n_in):
    """Tensor cores see bf16 pieces hi + mid + lo of each float32 activation; with an identity
    weight every output is exactly that sum, so any lost piece or inexact split shows here."""
    rng = np.random.default_rng(5)
    x = normal(rng, (15, n_in)) * np.float32(1e3)
    eye = f32_to_bf16(np.eye(n_in, dtype=np.float32))
    got = cp.asnumpy(DenseOps().linear(cp.asarray(x), cp.asarray(eye)))
    assert np.array_equal(got, x)


@pytest.mark.parametrize("op", ["linear", "head_linear"])
def test_bf16_tensor_core_path_agrees_with_the_float32_path(op):
    """bf16 weights take the tensor-core kernels, float32 weights the CUDA-core ones: different
    orders, the same products; both within the accuracy table of the widened reference."""
    rng = np.random.default_rng(4)
    shape = (70, 300) if op == "linear" else (3, 40, 300)
    x = cp.asarray(normal(rng, (9, *shape[:-2], shape[-1])))
    w16 = _bf16(rng, shape, 300 ** -0.5)
    ops = DenseOps()
    got = getattr(ops, op)(x, cp.asarray(w16))
    want = getattr(ops, op)(x, cp.asarray(bf16_to_f32(w16)))
    cp.testing.assert_allclose(got, want, rtol=TOLERANCE[op][0], atol=TOLERANCE[op][1])


# ---- edges and refusals --------------------------------------------------------------------------

def test_argmax_follows_numpy_on_nan_inf_and_ties():
    x = np.array([[1.0, np.nan, 3.0, np.nan], [-np.inf] * 4, [2.0, 5.0, 5.0, -1.0],
                  [-0.0, 0.0, -1.0, -0.0]], F32)
    assert np.array_equal(cp.asnumpy(DenseOps().argmax(cp.asarray(x))), np.argmax(x, axis=-1))


def test_embed_refuses_host_ids_outside_the_vocab():
    table = cp.asarray(normal(np.random.default_rng(5), (10, 8)))
    with pytest.raises(InputError, match=r"outside the vocab \[0, 10\)"):
        DenseOps().embed(table, np.array([3, 10]))


def test_embed_gives_nan_rows_for_device_ids_outside_the_vocab():
    table = cp.asarray(normal(np.random.default_rng(5), (10, 8)))
    out = cp.asnumpy(DenseOps().embed(table, cp.asarray([3, 10, -1])))
    assert np.array_equal(out[0], cp.asnumpy(table)[3]) and np.isnan(out[1:]).all()


def test_wrapper_refuses_non_contiguous_or_wrongly_typed_inputs():
    ops = DenseOps()
    x = cp.asarray(normal(np.random.default_rng(6), (8, 64)))
    with pytest.raises(AssertionError, match="C-contiguous"):
        ops.rmsnorm(x.T, None, 1e-5)
    with pytest.raises(AssertionError, match="float32"):
        ops.softmax(x.astype(cp.float64))


# ---- gate 3: red arms -------------------------------------------------------------------------------

# One thread per (row, out); the in-axis is cut into t interleaved partial sums: a split COUNT
# tied to the row count, exactly what the exact class forbids.
_SPLIT_BY_T_SRC = r"""
extern "C" __global__ void linear_split_by_t(const float* x, const float* w, float* y, int t,
                                             int n_in, int n_out) {
    const int r = blockIdx.y, o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= n_out) return;
    float total = 0.0f;
    for (int s = 0; s < t; ++s) {
        float part = 0.0f;
        for (int k = s; k < n_in; k += t) part = part + w[o * n_in + k] * x[r * n_in + k];
        total = total + part;
    }
    y[r * n_out + o] = total;
}
"""


class _SplitByRowCount(DenseOps):
    """The mutation: `linear` through the t-dependent kernel above."""

    def linear(self, x, w):
        t, n_in = x.shape
        n_out = w.shape[0]
        y = cp.empty((t, n_out), cp.float32)
        kern = cp.RawKernel(_SPLIT_BY_T_SRC, "linear_split_by_t", options=("--fmad=false",))
        kern(((n_out + 127) // 128, t), (128,), (x, w, y, np.int32(t), np.int32(n_in), np.int32(n_out)))
        return y


def test_red_arm_split_count_tied_to_t_breaks_row_exactness():
    case = next(c for c in CASES if c.name == "linear")
    inputs = {t: case.make(np.random.default_rng([0, t]), t) for t in range(2, T_MAX + 1)}
    failing = [t for t, (rows, shared) in inputs.items() if _mismatched_rows(_SplitByRowCount(), case, rows, shared)]
    assert failing, "a split count tied to t matched the row-alone result bit for bit for every t"
    for t in failing:  # green arm beside it: the real kernel on the very same inputs
        assert _mismatched_rows(DenseOps(), case, *inputs[t]) == []


def test_red_arm_one_ulp_change_in_one_gpu_row_is_detected():
    ops = DenseOps()
    x = cp.asarray(normal(np.random.default_rng(7), (T_MAX, 64)))
    full = cp.asnumpy(ops.rmsnorm(x, None, 1e-5))
    alone = [cp.asnumpy(ops.rmsnorm(x[r:r + 1], None, 1e-5)) for r in range(T_MAX)]
    assert all(np.array_equal(full[r], alone[r][0]) for r in range(T_MAX))
    alone[9][0, 31] = np.nextafter(alone[9][0, 31], F32(np.inf))
    assert [r for r in range(T_MAX) if not np.array_equal(full[r], alone[r][0])] == [9]


def _two_piece_linear(x, w16):
    """The mutation: the tensor-core projection with the lo bf16 piece of each activation dropped
    (two pieces keep 16 of float32's 24 significand bits)."""
    from memra.backend.cuda_runtime import OPTIONS, kernel_dir

    header = kernel_dir().joinpath("exact_mma.cuh").read_text()
    exact = "bits[2][e] = __float_as_uint(rest - __uint_as_float(mid));"
    assert exact in header, "exact_mma.cuh changed: update the mutation"
    src = kernel_dir().joinpath("dense.cu").read_text().replace(
        '#include "exact_mma.cuh"', header.replace(exact, "bits[2][e] = 0u;"))
    kern = cp.RawModule(code=src, options=(*OPTIONS, "-I" + str(kernel_dir()))).get_function("linear_bf16_n1")
    t, n_in = x.shape
    n_out = w16.shape[0]
    y = cp.empty((t, n_out), cp.float32)
    kern(((n_out + 31) // 32,), (256,), (x, w16, y, np.int32(t), np.int32(n_in), np.int32(n_out)))
    return y


def test_red_arm_a_two_piece_split_fails_the_identity_gate():
    rng = np.random.default_rng(5)
    x = normal(rng, (8, 256)) * np.float32(1e3)
    eye = cp.asarray(f32_to_bf16(np.eye(256, dtype=np.float32)))
    mutated = cp.asnumpy(_two_piece_linear(cp.asarray(x), eye))
    assert not np.array_equal(mutated, x), "dropping the lo piece still returned x bit for bit"
    assert np.array_equal(cp.asnumpy(DenseOps().linear(cp.asarray(x), eye)), x)  # green arm, same inputs
