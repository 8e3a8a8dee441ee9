"""FP8 weights as the GLM-5-Next release stores them, and the numpy twin of their exact class.

The release keeps most projection and expert matrices as e4m3 (torch float8_e4m3fn: bias 7, no
inf, NaN only at 0x7F/0xFF, max 448) with one float32 `scale_inv` per 128 x 128 block, so
W ~= e4m3(W) * scale_inv (research/fp8_multigpu.md section 1). The loader hands such a tensor over
as an `Fp8Block`; `be.matrix(block)` turns it into the backend's own matrix, and `be.linear` /
`be.moe_experts` take that wherever they take a bf16 matrix.

The exact class of an FP8 projection (docs/fp8.md, DESIGN.md section 2): every e4m3 value widens
exactly to float32; output o of row r sums, per 128-wide block b of in-features, the products
w[o, k] x[r, k] in a fixed order; that block partial is multiplied by scale_inv[o // 128, b];
the scaled partials are added in a fixed order. Nothing depends on the row count t. Here the
block partial is a float32 BLAS dot and the blocks add in ascending b; the CUDA kernels keep the
same structure with their own fixed orders (GPU vs numpy: a tolerance; GPU across t: bit-exact).

    block = quantize(w)                     # Fp8Block of a float32 [out, in] matrix
    m = NumpyFp8Matrix.from_block(block)    # what NumpyBackend.matrix(block) returns
    y = m @ x                               # the exact-class product for one row x [in]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from memra.kernels_cu.constants import FP8_BLOCK as BLOCK  # the release's weight_block_size, both axes

F32 = np.float32
E4M3_MAX = 448.0     # the largest finite e4m3fn value (0x7E)
NAN_CODES = (0x7F, 0xFF)


def _e4m3_table() -> np.ndarray:
    """Code -> float32 value of every e4m3fn byte (NaN at 0x7F / 0xFF); each value is exact."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(exp == 0, man * 2.0 ** -9, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    table = (sign * mag).astype(F32)
    table[list(NAN_CODES)] = np.nan
    return table


E4M3_TO_F32 = _e4m3_table()
_POSITIVE = E4M3_TO_F32[:0x7F].astype(np.float64)  # codes 0x00..0x7E: ascending, finite


def e4m3_to_f32(codes) -> np.ndarray:
    """Widen e4m3fn bytes (uint8) to float32, exactly (NaN codes give NaN)."""
    return E4M3_TO_F32[np.asarray(codes, dtype=np.uint8)]


def f32_to_e4m3(x) -> np.ndarray:
    """Round float values to e4m3fn bytes, nearest with ties to an even code, saturating at
    +-448 (what a quantizer does after dividing by the block scale). NaN is refused."""
    x = np.asarray(x, dtype=np.float64)
    if np.isnan(x).any():
        raise ValueError("f32_to_e4m3: NaN has no finite e4m3 code")
    a = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(_POSITIVE, a), 1, 0x7E)
    lo = hi - 1
    d_lo, d_hi = a - _POSITIVE[lo], _POSITIVE[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (pick | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def scale_grid(shape) -> tuple[int, ...]:
    """The scale_inv shape of an FP8 matrix (or a stack of them): one per 128 x 128 block."""
    *lead, n_out, n_in = shape
    return (*lead, math.ceil(n_out / BLOCK), math.ceil(n_in / BLOCK))


class Fp8Shaped:
    """What an FP8 matrix answers like an array, wherever its `data` and `scale_inv` live: the
    weights' shape, and nbytes counting the scales too (the benchmarks' byte counts)."""

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scale_inv.nbytes)


@dataclass(frozen=True, eq=False)
class Fp8Block(Fp8Shaped):
    """An FP8 matrix as stored: `data` e4m3 bytes (uint8) [..., out, in] and `scale_inv` float32
    [..., ceil(out/128), ceil(in/128)], W ~= e4m3(data) * scale_inv blockwise. A leading axis
    stacks experts (`stack`). The loader checks the grid, finiteness and positivity."""

    data: np.ndarray
    scale_inv: np.ndarray

    def __post_init__(self):
        assert self.data.dtype == np.uint8 and self.scale_inv.dtype == F32, (self.data.dtype, self.scale_inv.dtype)
        assert self.scale_inv.shape == scale_grid(self.data.shape), (self.data.shape, self.scale_inv.shape)


def stack(blocks) -> Fp8Block:
    """Experts' FP8 matrices [out, in] -> one Fp8Block [E, out, in] (the MoE stacks)."""
    blocks = list(blocks)
    return Fp8Block(np.stack([b.data for b in blocks]), np.stack([b.scale_inv for b in blocks]))


def stack_weights(arrays):
    """np.stack for the MoE expert stacks, FP8 blocks included (all one kind, as the loader gives)."""
    arrays = list(arrays)
    if arrays and isinstance(arrays[0], Fp8Block):
        return stack(arrays)
    return np.stack(arrays)


def expand_scales(scale_inv: np.ndarray, shape) -> np.ndarray:
    """scale_inv repeated over each block's rows and columns, cut to `shape` [..., out, in]."""
    *_, n_out, n_in = shape
    return np.repeat(np.repeat(scale_inv, BLOCK, axis=-2), BLOCK, axis=-1)[..., :n_out, :n_in]


def dequantize(block: Fp8Block) -> np.ndarray:
    """float32 W = e4m3 * scale_inv per element (one rounding of the exact product)."""
    return e4m3_to_f32(block.data) * expand_scales(block.scale_inv, block.shape)


def quantize(w, pow2_scales: bool = False) -> Fp8Block:
    """Block-quantize float weights [..., out, in] as the release does: per 128 x 128 block,
    scale_inv = amax / 448 (1 for an all-zero block) and data = e4m3(w / scale_inv). With
    pow2_scales each scale is rounded up to a power of two, so e4m3 * scale is exact in float32."""
    w = np.asarray(w, dtype=np.float32)
    grid = scale_grid(w.shape)
    *lead, n_out, n_in = w.shape
    pad = np.zeros((*lead, grid[-2] * BLOCK, grid[-1] * BLOCK), np.float32)
    pad[..., :n_out, :n_in] = np.abs(w)
    amax = pad.reshape(*lead, grid[-2], BLOCK, grid[-1], BLOCK).max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / F32(E4M3_MAX), F32(1)).astype(F32)
    if pow2_scales:
        scale = np.exp2(np.ceil(np.log2(scale))).astype(F32)
    data = f32_to_e4m3(w.astype(np.float64) / expand_scales(scale, w.shape).astype(np.float64))
    return Fp8Block(data, scale)


class NumpyFp8Matrix:
    """NumpyBackend's FP8 matrix: the e4m3 values widened once to float32, the scales kept.
    `m @ x` (x one row [in]) is the exact-class product; `m[e]` is expert e of a stack, so the
    reference's `w @ x[r]` and `gate_w[e] @ x[r]` read it as they read a float32 matrix."""

    def __init__(self, values: np.ndarray, scale_inv: np.ndarray):
        self.values, self.scale_inv, self.shape = values, scale_inv, values.shape
        self.dtype, self.nbytes = values.dtype, int(values.nbytes + scale_inv.nbytes)  # as arrays answer
        self._experts: dict[int, NumpyFp8Matrix] = {}
        if len(self.shape) == 2:
            n_out, n_in = self.shape
            row_scales = np.repeat(scale_inv, BLOCK, axis=0)[:n_out]  # [out, blocks]
            self._blocks = [(np.ascontiguousarray(values[:, k:k + BLOCK]), slice(k, k + BLOCK),
                             np.ascontiguousarray(row_scales[:, k // BLOCK])) for k in range(0, n_in, BLOCK)]

    @classmethod
    def from_block(cls, block: Fp8Block) -> "NumpyFp8Matrix":
        return cls(e4m3_to_f32(block.data), block.scale_inv)

    def __getitem__(self, e) -> "NumpyFp8Matrix":
        e = int(e)
        if e not in self._experts:
            self._experts[e] = NumpyFp8Matrix(self.values[e], self.scale_inv[e])
        return self._experts[e]

    def __matmul__(self, x: np.ndarray) -> np.ndarray:
        assert len(self.shape) == 2 and x.ndim == 1, "one FP8 matrix times one row"
        acc = np.zeros(self.shape[0], F32)
        for values, cols, scales in self._blocks:  # ascending blocks
            acc = acc + (values @ x[cols]) * scales
        return acc
