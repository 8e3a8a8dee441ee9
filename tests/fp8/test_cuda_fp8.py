"""FP8 weights on the GPU (kernels_cu/exact_mma_fp8.cuh through dense.cu's linear_group_fp8_* and
moe.cu's moe_*_fp8_*), against the numpy twin (memra/backend/fp8.py), in the shared harness:

* numpy gate: linear and moe_experts with FP8 weights match NumpyBackend within the bf16 path's
  bounds (odd shapes, ragged 128-blocks, split-K, several blocks per warp, t > 16 prime class);
* row gate: t = 1..15, row r of a t-row call is bit-identical to the row alone, with a red arm
  (a split count tied to t) that the gate catches while the real op passes;
* identity gate (FP8 counterpart of the bf16 one): an e4m3 identity with power-of-two block
  scales returns x * scale bit for bit, so every exact bf16 piece, the widening and the block
  scale are all in place; red arms: a two-piece activation split, and block 0's scale applied to
  every block, each caught;
* the weight bytes are one per weight: DeviceFp8 keeps uint8 data on the device.
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/fp8/test_cuda_fp8.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from benchmarks.common import counted_launches  # noqa: E402
from memra.backend.cuda import dense, moe, prime  # noqa: E402
from memra.backend.cuda.backend import CudaBackend  # noqa: E402
from memra.backend.cuda.dense import DenseOps  # noqa: E402
from memra.backend.cuda.fp8 import DeviceFp8  # noqa: E402
from memra.backend.cuda.moe import MoeOps  # noqa: E402
from memra.backend.fp8 import E4M3_TO_F32, NAN_CODES, Fp8Block, dequantize, f32_to_e4m3, quantize  # noqa: E402
from memra.safetensors_io import f32_to_bf16  # noqa: E402
from tests.backend.harness import (  # noqa: E402
    NUMPY, ROWS, OpGates, RedArm, assert_matches_numpy, draw, mutated_launch, row_mismatches, split_dot, table)
from memra.limits import VERIFY_CAP  # noqa: E402
from tests.backend.inputs import normal, uniform  # noqa: E402
from tests.backend.test_cuda_prime import PRIME_REL, _rel_error  # noqa: E402

TOL = {"linear": (1e-4, 1e-5), "moe_experts": (1e-4, 1e-5)}  # the bf16 path's bounds


class Fp8Ops(DenseOps, MoeOps):
    """The ops an FP8 weight reaches, plus the backend's matrix() that uploads it."""

    matrix = CudaBackend.matrix
    weight = CudaBackend.weight


def _fp8(rng, shape, std, spread=5.0):
    # row magnitudes in [1/spread, spread] so the 128-row scale blocks differ
    return quantize(normal(rng, shape, std) * uniform(rng, (*shape[:-1], 1), 1 / spread, spread))


def _make_linear(d_in, d_out):
    def make(rng, t):
        return {"x": normal(rng, (t, d_in))}, {"w": _fp8(rng, (d_out, d_in), d_in ** -0.5)}
    return make


def _linear(be, r, s):
    return be.linear(r["x"], be.matrix(s["w"]))


def _experts(e, inter, d, k, limit=10.0):
    def make(rng, t):
        idx = np.sort(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), axis=1)
        rows = {"x": normal(rng, (t, d)), "idx": idx.astype(np.int64), "wts": uniform(rng, (t, k), 0.1, 2.5)}
        shapes = ((e, inter, d), (e, inter, d), (e, d, inter))
        # a milder spread than a projection's: gate, up and down multiply theirs into one output,
        # and a 0.2-5 spread cubed puts outputs near 0.03 in rows that reach 140
        mats = [_fp8(rng, shape, shape[-1] ** -0.5, spread=2.0) for shape in shapes]
        return rows, dict(zip(("gate_w", "up_w", "down_w"), mats))

    def call(be, r, s):
        return be.moe_experts(r["x"], r["idx"], r["wts"], *(be.matrix(s[n]) for n in ("gate_w", "up_w", "down_w")),
                              limit)
    return make, call


case = table(TOL)
CASES = [
    case("linear_fp8", _make_linear(128, 64), _linear),
    case("linear_fp8_ragged", _make_linear(300, 45), _linear),            # ragged last block, odd outputs
    case("linear_fp8_blocks", _make_linear(1290, 300), _linear),          # 11 blocks: several per warp, 3 row blocks
    case("linear_fp8_split_k", _make_linear(4608, 70), _linear),          # split-K: three 2048-wide slices
    case("moe_experts_fp8", *_experts(4, 64, 128, 2)),
    case("moe_experts_fp8_odd", *_experts(5, 33, 200, 3, limit=0.75), ts=(1, 7, 11, 15)),
    case("moe_experts_fp8_wide", *_experts(8, 256, 384, 2)),
    case("linear_fp8_prime", _make_linear(515, 70), _linear, gates=frozenset({NUMPY}), ts=(37,)),
    case("moe_experts_fp8_prime", *_experts(5, 64, 200, 2), gates=frozenset({NUMPY}), ts=(37,)),
]


class _SplitByRowCount(Fp8Ops):
    """The mutation: the dequantized product with its in-axis cut into t interleaved partial sums."""

    def linear(self, x, w):
        return split_dot(x, cp.asarray(dequantize(Fp8Block(cp.asnumpy(w.data), cp.asnumpy(w.scale_inv)))),
                         splits=x.shape[0])


class TestFp8Ops(OpGates):
    ops, tol, cases = Fp8Ops, TOL, CASES
    red_arms = (RedArm("fp8_linear_split_count_tied_to_t", CASES[2], _SplitByRowCount),)
    ulp_cases = ("linear_fp8", "moe_experts_fp8")

    def test_table_covers_every_op_with_the_numpy_twin_signature(self):
        assert {c.op for c in self.cases} == set(self.tol) == {"linear", "moe_experts"}


def test_device_matrix_reads_one_byte_per_weight():
    block = quantize(normal(np.random.default_rng(0), (300, 1000)))
    w = CudaBackend().matrix(block)
    assert isinstance(w, DeviceFp8) and w.data.dtype == cp.uint8 and w.shape == (300, 1000)
    assert w.nbytes == 300 * 1000 + 3 * 8 * 4


@pytest.mark.parametrize("t", [1, 8, 15])
def test_fp8_projection_group_gives_each_member_its_own_bits(t):
    """The FP8 weights that share x (a split-K member among them) in one launch equal each
    weight's own launch bit for bit; bf16 and FP8 members of one call go as two groups."""
    rng, ops = np.random.default_rng(t), Fp8Ops()
    x = cp.asarray(normal(rng, (t, 4608)))
    ws = [ops.matrix(_fp8(rng, (n, 4608), 4608 ** -0.5)) for n in (70, 45)]
    ws.insert(1, cp.asarray(f32_to_bf16(normal(rng, (33, 4608), 4608 ** -0.5))))
    for y, w in zip(ops.linears(x, ws), ws):
        assert cp.array_equal(y.view(cp.uint32), ops.linear(x, w).view(cp.uint32))
    assert not dense._counters().any()


# ---- whole tiles load without checks --------------------------------------------------------------

def _misaligned(x):
    """x's values one float off 16-byte alignment: the tiles that read x take their checked loads."""
    out = cp.empty(x.size + 1, cp.float32)[1:].reshape(x.shape)
    out[...] = x
    return out


def _unchecked_equals_checked(t: int, launch=None) -> bool:
    """A projection (45 outputs: a ragged tile) and the experts' gate|up (in-features a multiple of
    128), with x aligned (unchecked loads, t < 8: missing rows read the tile's first) and one float
    off (checked loads, missing rows zeros): the same bits?"""
    rng, ops = np.random.default_rng(t), Fp8Ops()
    x = cp.asarray(normal(rng, (t, 384)))
    w = ops.matrix(_fp8(rng, (45, 384), 384 ** -0.5))
    make, _ = _experts(6, 40, 384, 2)
    rows, mats = make(rng, t)
    idx, wts = cp.asarray(rows["idx"]), cp.asarray(rows["wts"])
    experts = [ops.matrix(mats[n]) for n in ("gate_w", "up_w", "down_w")]
    runs = {"dense": lambda x: ops.linear(x, w), "moe": lambda x: ops.moe_experts(x, idx, wts, *experts, 10.0)}
    same = True
    for fam, run in runs.items():
        with pytest.MonkeyPatch.context() as m:
            if launch is not None:
                m.setattr(dense if fam == "dense" else moe, "launch", launch(fam))
            whole, checked = run(x), run(_misaligned(x))
        same &= bool(cp.array_equal(whole.view(cp.uint32), checked.view(cp.uint32)))
    return same


@pytest.mark.parametrize("t", [1, 3, 8, 15])
def test_unchecked_fp8_tiles_give_the_checked_tiles_bits(t):
    assert _unchecked_equals_checked(t)


def test_a_whole_fp8_row_runs_the_one_row_kernel():
    """The gate above compares linear_group_fp8_one (x aligned, t = 1) with linear_group_fp8_n1's
    checked tile (x one float off): both kernels must really run, or it would compare n1 with itself."""
    rng, ops = np.random.default_rng(0), Fp8Ops()
    w = ops.matrix(_fp8(rng, (45, 384), 384 ** -0.5))
    x = cp.asarray(normal(rng, (1, 384)))

    def launched(rows):
        with counted_launches() as launches:
            ops.linear(rows, w)
        return dict(launches)
    assert launched(x) == {"dense.linear_group_fp8_one": 1}
    assert launched(_misaligned(x)) == {"dense.linear_group_fp8_n1": 1}
    assert launched(cp.asarray(normal(rng, (2, 384)))) == {"dense.linear_group_fp8_n1": 1}


def _tile_mutants(monkeypatch, tmp_path, exact: str, broken: str) -> dict:
    """exact_mma_fp8.cuh with `exact` replaced by `broken`, as a launch per family (dense, moe)."""
    mutants = {}
    for fam in ("dense", "moe"):
        (tmp_path / fam).mkdir()
        mutants[fam] = mutated_launch(monkeypatch, tmp_path / fam, "exact_mma_fp8.cuh", exact, broken, fam)
    return mutants


def test_red_arm_every_row_read_as_the_first_breaks_the_unchecked_tiles(monkeypatch, tmp_path):
    """present_rows standing every row in for the first (not only the missing ones) is caught."""
    mutants = _tile_mutants(monkeypatch, tmp_path, "out[i] = in[i] != nullptr ? in[i] : first;", "out[i] = first;")
    assert not _unchecked_equals_checked(8, launch=mutants.get)
    assert _unchecked_equals_checked(8)  # green


def test_red_arm_a_staged_row_in_the_wrong_k_order_breaks_the_one_row_tiles(monkeypatch, tmp_path):
    """A one-row tile (t = 1, or an expert with one pair) stages the row's words once per warp;
    staging them in plain order instead of the widened weights' k-order is caught (the checked
    tile, x misaligned, splits per lane and stays right)."""
    mutants = _tile_mutants(monkeypatch, tmp_path, "const float v[4] = {a.x, a.z, a.y, a.w};",
                            "const float v[4] = {a.x, a.y, a.z, a.w};")
    assert not _unchecked_equals_checked(1, launch=mutants.get)
    assert _unchecked_equals_checked(1)  # green


@pytest.mark.parametrize("exact, broken", [
    ("(part[0][i] + part[0][i + 1]) + lo;", "part[0][i] + (part[0][i + 1] + lo);"),  # another order
    ("[g < 3 ? g : 0]", "[g < 3 ? 2 - g : 0]"),                                       # hi and lo swapped
], ids=["partial_order", "piece_columns"])
def test_red_arm_a_one_row_tile_off_the_pieces_order_is_caught(monkeypatch, tmp_path, exact, broken):
    """A one-row tile runs its row's three pieces as B columns of one MMA and adds the columns'
    sums as (hi + mid) + lo; adding them in another order, or feeding the columns other pieces,
    leaves the bits of a tile of more rows (which runs an MMA per piece) and is caught."""
    mutants = _tile_mutants(monkeypatch, tmp_path, exact, broken)
    assert not _unchecked_equals_checked(1, launch=mutants.get)


# ---- the identity gate and its red arms -------------------------------------------------------------

def _identity(n, scales):
    """e4m3 identity [n, n] with the given power-of-two scale per 128-block -> (block, x, want)."""
    grid = -(-n // 128)
    scale = np.array([[scales[(i + j) % len(scales)] for j in range(grid)] for i in range(grid)], np.float32)
    x = normal(np.random.default_rng(5), (15, n)) * np.float32(1e3)
    want = x * np.repeat(np.diag(scale), 128)[:n]  # output o sees only block (o // 128, o // 128)
    return Fp8Block(f32_to_e4m3(np.eye(n)), scale), x, want.astype(np.float32)


@pytest.mark.parametrize("n", [256, 1029, 4100])  # 4100: split-K into three slices
def test_fp8_identity_returns_the_scaled_activations_bit_for_bit(n):
    block, x, want = _identity(n, [1.0, 0.5, 4.0, 0.125])
    got = cp.asnumpy(Fp8Ops().linear(cp.asarray(x), Fp8Ops().matrix(block)))
    assert np.array_equal(got, want)


def _every_code():
    """A [1, 254] row holding every finite e4m3 code once, unit scales, and the 254 one-hot rows
    that read each code alone."""
    codes = np.array([c for c in range(256) if c not in NAN_CODES], np.uint8)
    block = Fp8Block(codes[None, :], np.ones((1, 2), np.float32))
    return block, np.eye(codes.size, dtype=np.float32), E4M3_TO_F32[codes]


def _read_codes(x, block, rows: int) -> np.ndarray:
    """Each one-hot row's output, in calls of `rows` rows: the exact tiles up to VERIFY_CAP, the
    prime class's dequantized pieces past it."""
    w = Fp8Ops().matrix(block)
    return np.concatenate([cp.asnumpy(Fp8Ops().linear(cp.asarray(x[r:r + rows]), w))[:, 0]
                           for r in range(0, x.shape[0], rows)])


@pytest.mark.parametrize("rows", [VERIFY_CAP, 254], ids=["exact_tiles", "prime"])
def test_every_e4m3_code_widens_to_its_value(rows):
    """All 254 finite codes, subnormals and both signs included, in every byte lane of a word:
    through the exact tiles and through a prompt's dequantization."""
    block, x, want = _every_code()
    got = _read_codes(x, block, rows)
    assert np.array_equal(got, want), np.flatnonzero(got != want)


@pytest.mark.parametrize("rows, family, header, exact, broken", [
    (VERIFY_CAP, "dense", "exact_mma_fp8.cuh", "0x87f087f0u);   // bytes 1, 3", "0x87f007f0u);   // bytes 1, 3"),
    (254, "prime", "prime.cu", "return (b & 0x80) ? -mag : mag;", "return mag;"),
])
def test_red_arm_a_lost_sign_bit_fails_the_code_table(monkeypatch, tmp_path, rows, family, header, exact, broken):
    block, x, want = _every_code()
    launch = mutated_launch(monkeypatch, tmp_path, header, exact, broken, family)
    with monkeypatch.context() as m:
        m.setattr(dense if family == "dense" else prime, "launch", launch)
        got = _read_codes(x, block, rows)
    assert not np.array_equal(got, want)


def test_a_prompts_fp8_projection_is_float32_accurate(monkeypatch):
    """Past VERIFY_CAP rows an FP8 weight is dequantized into bf16 pieces and meets the
    activation's in six GEMMs: within PRIME_REL of the outputs' RMS against float64 of the
    dequantized product; dropping the weight's mid piece against the activation's hi breaks it."""
    rng = np.random.default_rng(12)
    block, x = _fp8(rng, (300, 1290), 1290 ** -0.5), normal(rng, (40, 1290))
    want = x.astype(np.float64) @ dequantize(block).astype(np.float64).T
    w = Fp8Ops().matrix(block)
    error = lambda: _rel_error(Fp8Ops().linear(cp.asarray(x), w), want)
    assert error() <= PRIME_REL
    monkeypatch.setattr(prime, "WEIGHT_PRODUCTS", tuple(p for p in prime.WEIGHT_PRODUCTS if p != (0, 1)))
    assert error() > PRIME_REL


def test_a_prompts_fp8_expert_products_are_float32_accurate(monkeypatch):
    """A prompt's FP8 expert GEMMs (prime._expert_gemm) on 40 slots' piece rows: each weight
    piece meets only the activation pieces it is kept with (six products of the nine), and each
    slot's three output rows add back to within PRIME_REL of float64 of the dequantized product;
    with the weight's mid plane zeroed the bound breaks."""
    rng = np.random.default_rng(14)
    block, x = _fp8(rng, (300, 1290), 1290 ** -0.5), normal(rng, (40, 1290))
    want = x.astype(np.float64) @ dequantize(block).astype(np.float64).T
    stack = DeviceFp8(cp.asarray(block.data)[None], cp.asarray(block.scale_inv)[None])
    xp = prime.pieces(cp.asarray(x))  # [40, 3, 1290]: each slot's hi, mid and lo rows

    def error():
        rows = cp.zeros((40, 3, 300), cp.float32)
        prime._expert_gemm(prime.cublas_handle(), xp.data.ptr, 1290, 40, stack, 0, rows.data.ptr)
        return _rel_error((rows[:, 2] + rows[:, 1]) + rows[:, 0], want)

    assert error() <= PRIME_REL
    pieces, keep = prime.fp8_pieces, cp.asarray([1, 0, 1], cp.uint16)[:, None, None]
    monkeypatch.setattr(prime, "fp8_pieces", lambda data, scale: pieces(data, scale) * keep)
    assert error() > PRIME_REL


@pytest.mark.parametrize("shape", [(130, 300), (130, 264), (3, 130, 264)])
def test_fp8_pieces_add_back_to_the_dequantized_weight(shape):
    """A weight a thread (300 in-features), eight a thread (264), and eight a thread in the middle
    matrix of a stack (an expert's view, as a prompt's experts pass it)."""
    block = _fp8(np.random.default_rng(13), shape, 0.05)
    data, scale, want = cp.asarray(block.data), cp.asarray(block.scale_inv), dequantize(block)
    if len(shape) == 3:
        data, scale, want = data[1], scale[1], want[1]
    planes = cp.asnumpy(prime.fp8_pieces(data, scale))
    widened = [(p.astype(np.uint32) << 16).view(np.float32) for p in planes]
    assert np.array_equal((widened[2] + widened[1]) + widened[0], want)
    assert np.array_equal(planes[0], (want.view(np.uint32) >> 16).astype(np.uint16))  # hi: the truncation


MUTATIONS = {
    "two_piece_split": ("exact_mma.cuh", "bits[2][e] = __float_as_uint(rest - __uint_as_float(mid));",
                        "bits[2][e] = 0u;"),
    "one_scale_per_row": ("exact_mma_fp8.cuh", "srow[j] != nullptr ? srow[j][b] : 0.0f",
                          "srow[j] != nullptr ? srow[j][0] : 0.0f"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_red_arm_the_identity_gate_catches_a_broken_fp8_kernel(monkeypatch, tmp_path, mutation):
    block, x, want = _identity(1029, [1.0, 0.5, 4.0, 0.125])
    launch = mutated_launch(monkeypatch, tmp_path, *MUTATIONS[mutation], "dense")
    with monkeypatch.context() as m:
        m.setattr(dense, "launch", launch)
        got = cp.asnumpy(Fp8Ops().linear(cp.asarray(x), Fp8Ops().matrix(block)))
    assert not np.array_equal(got, want), f"{mutation}: the mutant still returned x * scale bit for bit"
    assert np.array_equal(cp.asnumpy(Fp8Ops().linear(cp.asarray(x), Fp8Ops().matrix(block))), want)  # green


def test_red_arm_one_scale_per_row_fails_the_expert_numpy_gate(monkeypatch, tmp_path):
    """The experts share the tile: block 0's scale everywhere misses the twin's bound."""
    c = next(c for c in CASES if c.name == "moe_experts_fp8_wide")
    launch = mutated_launch(monkeypatch, tmp_path, *MUTATIONS["one_scale_per_row"], "moe")
    with monkeypatch.context() as m:
        m.setattr(moe, "launch", launch)
        with pytest.raises(AssertionError):
            assert_matches_numpy(Fp8Ops(), c, 7)
    assert_matches_numpy(Fp8Ops(), c, 7)  # green
    assert row_mismatches(Fp8Ops(), c, *draw(c, ROWS, 15)) == []
