"""The bf16 pieces of float32 values and the six-product scheme of the prime class's float32 GEMMs
(no cupy: the CPU tests pin the scheme the CUDA backend runs, backend/cuda/prime.py).

A float32 x splits exactly into three bf16 pieces, x = hi + mid + lo, each the truncation of
what the ones before left (kernels_cu/prime.cu's split_pieces), so |mid| <= 2^-8 |x| and
|lo| <= 2^-16 |x|. A product a b of two float32 operands is the sum of the nine piece products;
the prime attention keeps the six of size at least 2^-16 |a b| (i + j <= 2 for pieces i, j:
0 hi, 1 mid, 2 lo), which drops under 2^-23 |a b| per product: a float32 rounding's size.

The six run as three bf16 GEMMs accumulated into one float32 C, smallest first. The left
operand is laid out with its pieces reversed (LEFT_ORDER: lo, mid, hi side by side), the right
one as six copies (RIGHT_COPIES), so each GEMM is one contiguous K range of each (SEGMENTS):

    hi * lo                    left[2]      right[0]
    mid * mid + hi * mid       left[1:3]    right[1:3]
    lo * hi + mid * hi + hi * hi   left[0:3]    right[3:6]

    y = emulate(a, b)   # float64 of the six piece products, float32 sums per GEMM: the CPU twin
"""

from __future__ import annotations

import numpy as np

PIECES = 3                              # hi, mid, lo
LEFT_ORDER = (2, 1, 0)                  # the left operand's pieces in K order: lo, mid, hi
RIGHT_COPIES = (2, 1, 1, 0, 0, 0)       # the right operand's six piece copies in K order
SEGMENTS = ((2, 0, 1), (1, 1, 2), (0, 3, 3))  # (left start, right start, length), in pieces; run in order


def piece_map(order) -> int:
    """The pieces of `order` as the int a piece_copies kernel takes: 2 bits per copy, first lowest."""
    return sum(piece << (2 * s) for s, piece in enumerate(order))


def products(segments=SEGMENTS) -> list[list[tuple[int, int]]]:
    """Each GEMM's (left piece, right piece) products in K order."""
    return [[(LEFT_ORDER[a + i], RIGHT_COPIES[b + i]) for i in range(k)] for a, b, k in segments]


def split(x: np.ndarray) -> list[np.ndarray]:
    """[hi, mid, lo] float32 arrays (each a bf16 value) with x == hi + mid + lo exactly."""
    x = np.ascontiguousarray(x, np.float32)
    hi = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    rest = x - hi
    mid = (rest.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    return [hi, mid, rest - mid]


def emulate(a: np.ndarray, b: np.ndarray, segments=SEGMENTS, k_tile: int = 16) -> np.ndarray:
    """a [m, k] @ b [k, n] as the GPU sums it: per GEMM, exact bf16 products summed in float64
    over k_tile in-features, each tile's sum added to the float32 C and rounded (an MMA step)."""
    left, right = split(a), split(b)
    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for gemm in products(segments):
        lhs = np.concatenate([left[i] for i, _ in gemm], axis=1).astype(np.float64)
        rhs = np.concatenate([right[j] for _, j in gemm], axis=0).astype(np.float64)
        for k0 in range(0, lhs.shape[1], k_tile):
            out = (out + lhs[:, k0:k0 + k_tile] @ rhs[k0:k0 + k_tile]).astype(np.float32)
    return out
