"""The dense family on the GPU (DenseOps, backend/cuda/dense.py -> kernels_cu/dense.cu): embedding,
projections (float32 CUDA cores, bf16 tensor cores, split-K), activations, elementwise arithmetic
(scale, add) and plane row writes.

The table below runs through the shared gates of tests/backend/harness.py (numpy twin within
each op's bound, t = 1..15 row invariance, red arms); the rest pins what a table can't: the
identity-weight gate of the exact bf16 pieces (and its red arm, a dropped lo piece), split-K's
choice by shape, prime-class accuracy (a prompt's rows), the embed refusals, write_rows at a device position,
and scale / add bit for bit against numpy and against the CuPy arithmetic they replace.
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_dense.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda import dense, runtime  # noqa: E402
from memra.backend.cuda.dense import DenseOps, split_k  # noqa: E402
from memra.backend.numpy_ref import NumpyBackend  # noqa: E402
from memra.errors import InputError  # noqa: E402
from memra.safetensors_io import bf16_to_f32, f32_to_bf16  # noqa: E402
from tests.backend.harness import (  # noqa: E402
    OpGates, RedArm, assert_matches_numpy, split_dot, table)
from tests.backend.inputs import linears, make_head_linear, make_linear, make_linears, make_rows, normal  # noqa: E402

F32 = np.float32

# op -> (rtol, atol) against NumpyBackend. Gathers do no arithmetic: exact. Dot products differ
# from numpy's (pairwise / BLAS FMA) order; transcendentals from CUDA's expf by an ulp or two.
TOL = {
    "embed": (0.0, 0.0),
    "linear": (1e-4, 1e-5),
    "linears": (1e-4, 1e-5),
    "head_linear": (1e-4, 1e-5),
    "silu": (1e-5, 1e-6),
    "sigmoid": (1e-5, 1e-6),
    "swiglu": (1e-5, 1e-5),
    # one IEEE float32 multiply / add an element, as numpy does it: bit-equal (no subnormal inputs)
    "scale": (0.0, 0.0),
    "add": (0.0, 0.0),
}


def _bf16(rng, shape, std):
    return f32_to_bf16(normal(rng, shape, std))


def _make_embed(weight):
    def make(rng, t):
        return {"ids": rng.integers(0, 97, t)}, {"table": weight(rng, (97, 128), 1.0)}
    return make


def _make_swiglu(rng, t):
    # std 8 so that both clamps at limit 10 engage in most rows
    return {"gate": normal(rng, (t, 96), 8.0), "up": normal(rng, (t, 96), 8.0)}, {}


def _linear(be, r, s):
    return be.linear(r["x"], s["w"])


def _head_linear(be, r, s):
    return be.head_linear(r["x"], s["w"])


case = table(TOL)
CASES = [
    case("embed", _make_embed(normal), lambda be, r, s: be.embed(s["table"], r["ids"]), host=frozenset({"ids"})),
    case("embed_bf16_device_ids", _make_embed(_bf16), lambda be, r, s: be.embed(s["table"], r["ids"])),
    case("linear", make_linear(128, 64), _linear),
    case("linear_odd", make_linear(67, 129), _linear),
    case("linear_long_in", make_linear(515, 70), _linear),
    case("linear_bf16", make_linear(128, 64, _bf16), _linear),
    case("linear_bf16_odd", make_linear(300, 45, _bf16), _linear),
    # several in-feature blocks per warp, a full last chunk (1032 = 4 * 256 + 8) / a ragged one
    case("linear_bf16_wide", make_linear(1032, 70, _bf16), _linear),
    case("linear_bf16_wide_odd", make_linear(1029, 33, _bf16), _linear),
    # split-K: 4608 in-features are three 2048-wide slices (the last ragged), 70 outputs one block
    case("linear_bf16_split_k", make_linear(4608, 70, _bf16), _linear),
    # one input, several weights: a prompt's rows (37 > VERIFY_CAP) share the input's bf16 pieces
    case("linears_bf16", make_linears(300, (45, 70, 8), _bf16), linears, ts=(1, 7, 15, 37)),
    # one launch: a split-K member (three slices added by the launch itself) beside unsplit ones
    case("linears_bf16_group", make_linears(4608, (70, 45, 300), _bf16), linears),
    case("linears_mixed", make_linears(128, (64, 33, 20), lambda rng, shape, std: (
        normal(rng, shape, std) if shape[0] == 33 else _bf16(rng, shape, std))), linears, ts=(1, 37)),
    case("head_linear", make_head_linear(4, 16, 32), _head_linear),
    case("head_linear_odd", make_head_linear(3, 17, 13), _head_linear),
    case("head_linear_bf16", make_head_linear(2, 64, 40, _bf16), _head_linear),
    case("head_linear_bf16_odd", make_head_linear(3, 17, 13, _bf16), _head_linear),
    case("silu", make_rows(x=(129, 3.0)), lambda be, r, s: be.silu(r["x"])),
    case("sigmoid", make_rows(x=(2, 129, 3.0)), lambda be, r, s: be.sigmoid(r["x"])),
    case("swiglu", _make_swiglu, lambda be, r, s: be.swiglu(r["gate"], r["up"], 10.0)),
    # the KDA q scale (dk^-0.5 on [t, Hk, dk]) and the indexer weight scale (Hi^-0.5 on [t, Hi])
    case("scale_kda_q", make_rows(x=(2, 128, 1.0)), lambda be, r, s: be.scale(r["x"], 128 ** -0.5)),
    case("scale_indexer_weights", make_rows(x=(33, 4.0)), lambda be, r, s: be.scale(r["x"], 33 ** -0.5)),
    case("add", make_rows(a=(129, 1.0), b=(129, 3.0)), lambda be, r, s: be.add(r["a"], r["b"])),
]


class _SplitByRowCount(DenseOps):
    """The mutation: `linear` with its in-axis cut into t interleaved partial sums."""

    def linear(self, x, w):
        return split_dot(x, w, splits=x.shape[0])


class TestDenseOps(OpGates):
    ops, tol, cases = DenseOps, TOL, CASES
    untabled = ("write_rows",)  # a plane write: test_write_rows_* below
    red_arms = (RedArm("linear_split_count_tied_to_t", CASES[2], _SplitByRowCount),)
    ulp_cases = ("linear",)


def _case(name):
    return next(c for c in CASES if c.name == name)


# ---- projections beyond the table ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["linear_long_in", "linear_bf16_odd", "linear_bf16_wide_odd", "head_linear_bf16"])
def test_prime_class_projection_stays_accurate(name):
    """t > VERIFY_CAP (a prompt): cuBLAS for `linear` and, batched over the heads, `head_linear`
    (test_cuda_prime.py); accuracy is the contract, not row invariance."""
    assert_matches_numpy(DenseOps(), _case(name), 37)


def _group_inputs(rng, t):
    """An input and a projection group: a split-K member (4608 in-features: three slices, 3 tiles),
    a tile-and-a-half member and a lone-tile one (the KDA mixer's shape of group, small)."""
    x = cp.asarray(normal(rng, (t, 4608)))
    ws = [cp.asarray(_bf16(rng, (n, 4608), 4608 ** -0.5)) for n in (70, 45, 8)]
    return x, ws


@pytest.mark.parametrize("t", [1, 8, 15])
def test_projection_group_gives_each_member_its_own_bits(t):
    """One launch for the weights that share x equals each weight's own launch bit for bit, and
    every split-K counter is back to 0 after it (the next launch on the stream counts from 0)."""
    ops = DenseOps()
    x, ws = _group_inputs(np.random.default_rng(t), t)
    grouped = ops.linears(x, ws)
    for y, w in zip(grouped, ws):
        alone = ops.linear(x, w)
        assert y.shape == alone.shape and y.flags.c_contiguous
        assert cp.array_equal(y.view(cp.uint32), alone.view(cp.uint32))
    assert not dense._counters().any()


def test_projection_group_red_arm_a_dirty_counter_adds_the_slices_early():
    """The counters carry the split-K protocol: a tile whose counter is not 0 at launch has its
    slices added before they are all written, and the outputs change (here the first tile's)."""
    ops = DenseOps()
    x, ws = _group_inputs(np.random.default_rng(0), 4)
    clean = ops.linears(x, ws)[0].copy()
    ops.linears(x * 3, ws)  # leaves other slices in the freed partial buffer
    dense._counters()[0] = 2  # the first slice to arrive believes it is the third of three
    dirty = ops.linears(x, ws)[0]
    assert not cp.array_equal(dirty[:, :32], clean[:, :32])
    assert cp.array_equal(dirty[:, 32:], clean[:, 32:])  # the other tiles counted from 0
    counters = dense._counters()
    assert int(counters[0]) == 2 and not counters[1:].any()  # reset early, then counted twice more
    counters[0] = 0


def test_split_k_follows_the_shape_never_the_exact_class_row_count():
    assert {split_k(t, 4608, 70) for t in range(1, 16)} == {3}  # the split-K table case
    assert split_k(1, 8192, 4096) == 4 and split_k(1, 16384, 4096) == 8  # o_proj: 128 output blocks
    assert split_k(1, 4096, 8192) == 1 and split_k(1, 4096, 154880) == 1  # outputs fill the GPU
    assert split_k(1, 2048, 4096) == 1  # short in-features
    assert split_k(16, 8192, 4096) == 1  # prime class: accuracy only, no partial buffers


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
    cp.testing.assert_allclose(got, want, rtol=TOL[op][0], atol=TOL[op][1])


# ---- the identity-weight gate of the exact bf16 pieces, and its red arm ---------------------------

def _identity_inputs(n_in, rows):
    x = normal(np.random.default_rng(5), (rows, n_in)) * np.float32(1e3)
    return x, cp.asarray(f32_to_bf16(np.eye(n_in, dtype=np.float32)))


@pytest.mark.parametrize("n_in", [256, 1029, 4100])  # 4100: split-K into three slices
def test_bf16_identity_weight_returns_the_activations_bit_for_bit(n_in):
    """Tensor cores see bf16 pieces hi + mid + lo of each float32 activation; with an identity
    weight every output is exactly that sum, so any lost piece or inexact split shows here."""
    x, eye = _identity_inputs(n_in, 15)
    assert np.array_equal(cp.asnumpy(DenseOps().linear(cp.asarray(x), eye)), x)


@pytest.fixture
def two_piece_launch(monkeypatch, tmp_path):
    """A `launch` for DenseOps into dense.cu built (by runtime's own compile: flags, defines and
    all) against an exact_mma.cuh that drops the lo bf16 piece of each activation: two pieces
    keep 16 of float32's 24 significand bits."""
    exact = "bits[2][e] = __float_as_uint(rest - __uint_as_float(mid));"
    for src in runtime.kernel_dir().iterdir():
        if src.name.endswith((".cu", ".cuh")):
            (tmp_path / src.name).write_text(src.read_text())
    header = (tmp_path / "exact_mma.cuh").read_text()
    assert exact in header, "exact_mma.cuh changed: update the mutation"
    (tmp_path / "exact_mma.cuh").write_text(header.replace(exact, "bits[2][e] = 0u;"))
    with monkeypatch.context() as m:
        m.setattr(runtime, "kernel_dir", lambda: tmp_path)
        mutated = getattr(runtime.module, "__wrapped__", runtime.module)("dense")  # past the cache

    def launch(family, name, grid, block, args, shared_mem=0):
        assert family == "dense", family
        mutated.get_function(name)(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)
    return launch


def test_red_arm_a_two_piece_split_fails_the_identity_gate(monkeypatch, two_piece_launch):
    x, eye = _identity_inputs(256, 8)
    green = cp.asnumpy(DenseOps().linear(cp.asarray(x), eye))
    with monkeypatch.context() as m:
        m.setattr(dense, "launch", two_piece_launch)
        mutated = cp.asnumpy(DenseOps().linear(cp.asarray(x), eye))
    assert not np.array_equal(mutated, x), "dropping the lo piece still returned x bit for bit"
    assert np.array_equal(green, x)  # green arm, same inputs


# ---- embed refusals, plane row writes ---------------------------------------------------------------

def test_embed_refuses_host_ids_outside_the_vocab():
    table = cp.asarray(normal(np.random.default_rng(5), (10, 8)))
    with pytest.raises(InputError, match=r"outside the vocab \[0, 10\)"):
        DenseOps().embed(table, np.array([3, 10]))


def test_embed_gives_nan_rows_for_device_ids_outside_the_vocab():
    table = cp.asarray(normal(np.random.default_rng(5), (10, 8)))
    out = cp.asnumpy(DenseOps().embed(table, cp.asarray([3, 10, -1])))
    assert np.array_equal(out[0], cp.asnumpy(table)[3]) and np.isnan(out[1:]).all()


@pytest.mark.parametrize("at, t", [(0, 1), (5, 4), (2, 15), (49, 15)])
def test_write_rows_at_a_host_or_device_position_writes_exactly_those_rows(at, t):
    """What a captured walk replays: the position read from a device buffer lands where the
    host int does, and where the numpy twin writes; every other row keeps its sentinel."""
    src = normal(np.random.default_rng([at, t]), (t, 11))
    want = np.full((64, 11), 7.0, F32)
    NumpyBackend().write_rows(want, src, at)
    for pos in (at, runtime.position(at)):
        dst = cp.full((64, 11), 7.0, cp.float32)
        DenseOps().write_rows(dst, cp.asarray(src), pos)
        assert cp.asnumpy(dst).tobytes() == want.tobytes()


# ---- elementwise arithmetic: the bits of numpy and of the CuPy expressions the model used -------

def _wide(rng, shape):
    """Normal draws over 2^-60 .. 2^60 (products and sums stay far from subnormals) with zeros of
    both signs and infinities planted."""
    x = normal(rng, shape) * np.exp2(rng.integers(-60, 61, shape)).astype(F32)
    x.reshape(-1)[:4] = [0.0, -0.0, np.inf, -np.inf]
    return x.astype(F32)


@pytest.mark.parametrize("factor", [128 ** -0.5, 32 ** -0.5, 3 ** -0.5, 0.5, 1.0, 7.25])
def test_scale_is_numpys_multiply_and_cupys_bit_for_bit(factor):
    x = _wide(np.random.default_rng(8), (15, 257))
    got = cp.asnumpy(DenseOps().scale(cp.asarray(x), factor))
    assert got.tobytes() == (x * np.float32(factor)).tobytes()
    assert got.tobytes() == cp.asnumpy(cp.asarray(x) * np.float32(factor)).tobytes()


def test_add_is_numpys_add_and_cupys_bit_for_bit():
    rng = np.random.default_rng(9)
    a, b = _wide(rng, (15, 257)), normal(rng, (15, 257), 3.0)
    got = cp.asnumpy(DenseOps().add(cp.asarray(a), cp.asarray(b)))
    assert got.tobytes() == (a + b).tobytes()
    assert got.tobytes() == cp.asnumpy(cp.asarray(a) + cp.asarray(b)).tobytes()


def test_add_refuses_to_broadcast():
    with pytest.raises(AssertionError, match="b: expected"):
        DenseOps().add(cp.zeros((3, 8), cp.float32), cp.zeros((1, 8), cp.float32))
