"""The FP8 format and the numpy twin of the FP8 exact class (memra/backend/fp8.py), on the CPU.

* e4m3fn decodes exactly (all 254 finite codes against the bit formula in float64; 0x7F/0xFF NaN)
  and encodes nearest-even, saturating at 448;
* block quantization gives the release's grid, scale_inv = amax / 448, and |error| within half an
  e4m3 step of each block;
* the twin (NumpyFp8Matrix, through NumpyBackend.linear and moe_experts) matches a float64
  dequantize-and-multiply reference within a stated bound, and its red arms (a whole-row scale,
  a block edge off by one) miss that bound;
* row invariance: row r of a t-row call equals the row alone, bit for bit, for t = 1..15.
"""

from __future__ import annotations

import numpy as np
import pytest

from memra.backend.fp8 import (BLOCK, E4M3_MAX, Fp8Block, NumpyFp8Matrix, dequantize, e4m3_to_f32,
                               expand_scales, f32_to_e4m3, quantize, scale_grid)
from memra.backend.numpy_ref import NumpyBackend
from memra.limits import VERIFY_CAP

# Twin vs float64: float32 block partials and float32 scaled adds, relative to sum |w x|.
REL_BOUND = 1e-5


def _formula(code: int) -> float:
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
    mag = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def test_every_finite_e4m3_code_widens_exactly_and_nan_codes_are_nan():
    codes = np.arange(256, dtype=np.uint8)
    got = e4m3_to_f32(codes).astype(np.float64)
    for c in range(256):
        if c in (0x7F, 0xFF):
            assert np.isnan(got[c])
        else:
            assert got[c] == _formula(c), hex(c)
    assert got[0x7E] == E4M3_MAX and got[1] == 2.0 ** -9


def test_encoding_rounds_to_nearest_even_and_saturates():
    finite = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)
    assert np.array_equal(f32_to_e4m3(e4m3_to_f32(finite)), finite)  # -0 keeps its sign code
    # 1 + 1/16 is halfway between 1 (0x38) and 1.125 (0x39): the even code wins; just above goes up
    assert f32_to_e4m3(np.array([1.0625, 1.0625 + 1e-6, 1.1875, 1e6, -1e6])).tolist() == [0x38, 0x39, 0x3A, 0x7E, 0xFE]


@pytest.mark.parametrize("shape", [(128, 256), (300, 129), (3, 70, 200)])
def test_quantize_gives_the_release_grid_and_half_step_error(shape):
    w = np.random.default_rng(1).normal(0, 0.05, shape).astype(np.float32)
    block = quantize(w)
    assert block.scale_inv.shape == scale_grid(shape) == (*shape[:-2], -(-shape[-2] // BLOCK), -(-shape[-1] // BLOCK))
    amax = np.abs(w[..., :BLOCK, :BLOCK]).max(axis=(-2, -1))
    np.testing.assert_array_equal(block.scale_inv[..., 0, 0], (amax / np.float32(448)).astype(np.float32))
    # e4m3 keeps 4 significant bits: half a step is at most 2^-4 of the value, or of the subnormal step
    scale = expand_scales(block.scale_inv, shape).astype(np.float64)
    err = np.abs(dequantize(block).astype(np.float64) - w)
    assert (err <= np.maximum(np.abs(w) * 2.0 ** -4, scale * 2.0 ** -10) * 1.0001 + 1e-12).all()


def _reference(x: np.ndarray, block: Fp8Block) -> np.ndarray:
    """float64: dequantize exactly, then one matrix product."""
    w = e4m3_to_f32(block.data).astype(np.float64) * expand_scales(block.scale_inv, block.shape).astype(np.float64)
    return x.astype(np.float64) @ w.T


def _inputs(n_out, n_in, t, seed=0):
    rng = np.random.default_rng([seed, n_out, n_in, t])
    block = quantize(rng.normal(0, n_in ** -0.5, (n_out, n_in)) * rng.uniform(0.1, 10, (n_out, 1)))
    return rng.normal(0, 1, (t, n_in)).astype(np.float32), block


def _assert_close(got, x, block):
    want = _reference(x, block)
    bound = REL_BOUND * (np.abs(x.astype(np.float64)) @ np.abs(dequantize(block).astype(np.float64)).T) + 1e-30
    assert (np.abs(got - want) <= bound).all(), np.max(np.abs(got - want) / bound)


@pytest.mark.parametrize("n_out, n_in", [(64, 128), (200, 384), (129, 300), (7, 1000)])
def test_linear_twin_matches_the_float64_dequantized_product(n_out, n_in):
    x, block = _inputs(n_out, n_in, 5)
    be = NumpyBackend()
    _assert_close(be.linear(x, be.matrix(block)), x, block)


class _WholeRowScale(NumpyFp8Matrix):
    """Red arm: one scale (block 0's) for the whole row, as a per-channel reader would apply."""

    def __matmul__(self, x):
        return (self.values @ x) * np.repeat(self.scale_inv[:, 0], BLOCK)[:self.shape[0]]


class _BlockEdgeOffByOne(NumpyFp8Matrix):
    """Red arm: the scale columns applied one in-feature late (blocks of 128 starting at 1)."""

    def __matmul__(self, x):
        scales = np.repeat(np.repeat(self.scale_inv, BLOCK, axis=0)[:self.shape[0]], BLOCK, axis=1)
        scales = np.concatenate([scales[:, :1], scales], axis=1)[:, :self.shape[1]]
        return (self.values * scales) @ x


@pytest.mark.parametrize("mutant", [_WholeRowScale, _BlockEdgeOffByOne])
def test_red_arm_a_wrong_block_scale_misses_the_reference_bound(mutant):
    x, block = _inputs(200, 384, 3)
    m = mutant.from_block(block)
    got = np.stack([m @ x[r] for r in range(3)])
    with pytest.raises(AssertionError):
        _assert_close(got, x, block)
    _assert_close(np.stack([NumpyFp8Matrix.from_block(block) @ x[r] for r in range(3)]), x, block)  # green


def test_linear_twin_rows_are_bit_identical_to_the_row_alone():
    be = NumpyBackend()
    x, block = _inputs(150, 300, VERIFY_CAP)
    m = be.matrix(block)
    full = be.linear(x, m)
    for t in range(1, VERIFY_CAP + 1):
        part = be.linear(x[:t], m)
        for r in range(t):
            assert part[r].tobytes() == be.linear(x[r:r + 1], m)[0].tobytes() == full[r].tobytes()


def test_moe_experts_twin_takes_fp8_stacks_and_matches_dequantized_float64():
    rng = np.random.default_rng(3)
    e, inter, d, t, k = 4, 96, 160, 6, 2
    stacks = [quantize(rng.normal(0, 0.1, shape)) for shape in ((e, inter, d), (e, inter, d), (e, d, inter))]
    x = rng.normal(0, 1, (t, d)).astype(np.float32)
    idx = np.sort(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), axis=1)
    wts = rng.uniform(0.2, 1.0, (t, k)).astype(np.float32)
    be = NumpyBackend()
    got = be.moe_experts(x, idx, wts, *(be.matrix(s) for s in stacks), 10.0)
    g, u, dn = (dequantize(s).astype(np.float64) for s in stacks)
    want = np.zeros((t, d))
    for r in range(t):
        for e_, wt in zip(idx[r], wts[r]):
            gate, up = np.minimum(g[e_] @ x[r], 10.0), np.clip(u[e_] @ x[r], -10, 10)
            want[r] += wt * (dn[e_] @ (gate / (1 + np.exp(-gate)) * up))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    alone = np.concatenate([be.moe_experts(x[r:r + 1], idx[r:r + 1], wts[r:r + 1], *(be.matrix(s) for s in stacks),
                                           10.0) for r in range(t)])
    assert alone.tobytes() == got.tobytes()
