"""The bf16 pieces of float32 values and the six-product scheme of the prime class's float32 GEMMs
(no cupy: the CPU tests pin the scheme the CUDA backend runs, backend/cuda/prime_attention.py).

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

The per-head form of a prompt's MLA attention (keys and values expanded per head) keeps the same
six products, HEAD_PRODUCTS in K order, smallest first: its scores are ONE GEMM over six copies
of each operand (one pass over the float32 scores where three GEMMs would make three), its mixes
six GEMMs of one product each (the probabilities keep three pieces; the values are not copied).

    y = emulate(a, b, products())   # float64 of the piece products, float32 sums per GEMM: the CPU twin
"""

from __future__ import annotations

import numpy as np

PIECES = 3                              # hi, mid, lo
LEFT_ORDER = (2, 1, 0)                  # the left operand's pieces in K order: lo, mid, hi
RIGHT_COPIES = (2, 1, 1, 0, 0, 0)       # the right operand's six piece copies in K order
SEGMENTS = ((2, 0, 1), (1, 1, 2), (0, 3, 3))  # (left start, right start, length), in pieces; run in order
HEAD_PRODUCTS = ((0, 2), (2, 0), (1, 1), (0, 1), (1, 0), (0, 0))  # (left piece, right piece), K order


def piece_map(order) -> int:
    """The pieces of `order` as the int a piece_copies kernel takes: 2 bits per copy, first lowest."""
    return sum(piece << (2 * s) for s, piece in enumerate(order))


def head_bytes(dn: int, dv: int) -> int:
    """Bytes a head of the per-head attention holds per position: its keys' six bf16 copies, its
    values' three pieces and one float32 plane (the expanded keys or values before their pieces)."""
    return 2 * len(HEAD_PRODUCTS) * dn + 2 * PIECES * dv + 4 * max(dn, dv)


def head_group(span: int, heads: int, dn: int, dv: int, budget: int) -> int:
    """Heads per pass of the per-head attention (backend/cuda/prime_attention.py): as many as
    hold head_bytes over `span` positions within `budget` bytes, in passes of equal size; 0 where
    one head does not fit (the absorbed form runs then)."""
    most = budget // (max(span, 1) * head_bytes(dn, dv))
    return -(-heads // -(-heads // most)) if most else 0


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


def emulate(a: np.ndarray, b: np.ndarray, gemms: list[list[tuple[int, int]]], k_tile: int = 16) -> np.ndarray:
    """a [m, k] @ b [k, n] as the GPU sums it: per GEMM (its (left piece, right piece) products
    in K order), exact bf16 products summed in float64 over k_tile in-features, each tile's sum
    added to the float32 C and rounded (an MMA step)."""
    left, right = split(a), split(b)
    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for gemm in gemms:
        lhs = np.concatenate([left[i] for i, _ in gemm], axis=1).astype(np.float64)
        rhs = np.concatenate([right[j] for _, j in gemm], axis=0).astype(np.float64)
        for k0 in range(0, lhs.shape[1], k_tile):
            out = (out + lhs[:, k0:k0 + k_tile] @ rhs[k0:k0 + k_tile]).astype(np.float32)
    return out
