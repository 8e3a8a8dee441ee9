"""The six-product bf16 scheme of the prime attention (memra/backend/pieces.py), on the CPU.

backend/cuda/prime.py runs a prompt's attention scores (q_lat . latent) and mixes (probs @
latent) as bf16 GEMMs over exact pieces of both float32 operands, keeping the six piece products
of size at least 2^-16. This pins the scheme by emulation (exact piece products, float32 sums per
MMA step): the whole attention stays within ATTEND_REL of a float64 reference at bench-like
widths (rank 512, a ~1200-position context, skipped positions), and dropping any one 2^-16
product breaks that bound. The GPU side holds the real kernels to the same bound
(tests/backend/test_cuda_prime.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from memra.backend import pieces
from tests.backend.inputs import attend_case, attend_reference

ATTEND_REL = 2e-5  # max |o - o64| / rms(o64) of the attention output; a float32 SGEMM's level
SCALE = 256 ** -0.5


def _attend(q, latent, positions, scores_gemms, mix_gemms=None):
    """The GPU path's arithmetic in numpy: emulated scores, float32 masked softmax, emulated mix
    (each GEMMs' products in K order; the mix's those of the scores unless given)."""
    t, h, rank = q.shape
    ctx = latent.shape[0]
    keep = np.zeros((t, ctx), bool)
    for r in range(t):
        keep[r, positions[r][positions[r] >= 0]] = True
    scores = pieces.emulate(q.reshape(t * h, rank), latent.T.copy(), scores_gemms).reshape(t, h, ctx)
    z = np.where(keep[:, None, :], scores * np.float32(SCALE), np.float32(-np.inf))
    top = z.max(axis=2, keepdims=True)
    e = np.where(keep[:, None, :], np.exp(z - np.where(np.isfinite(top), top, 0)), 0).astype(np.float32)
    total = e.sum(axis=2, keepdims=True)
    probs = np.where(total > 0, e / np.where(total > 0, total, 1), 0).astype(np.float32)
    return pieces.emulate(probs.reshape(t * h, ctx), latent, mix_gemms or scores_gemms).reshape(t, h, rank)


@pytest.fixture(scope="module")
def case():
    q, latent, positions = attend_case(np.random.default_rng(3), 20, 3, 512, 1200)
    return q, latent, positions, attend_reference(q, latent, positions, SCALE)


def _rel_error(got, want) -> float:
    err = float(np.abs(got - want).max() / np.sqrt(np.mean(want ** 2)))
    print(f"attention error {err:.3e} of the outputs' rms")
    return err


def test_the_scheme_is_the_six_products_of_size_at_least_2_to_the_minus_16():
    kept = [pair for gemm in pieces.products() for pair in gemm]
    assert sorted(kept) == sorted((i, j) for i in range(3) for j in range(3) if i + j <= 2)
    assert [max(i + j for i, j in gemm) for gemm in pieces.products()] == [2, 2, 2]
    assert pieces.products()[-1][-1] == (0, 0)  # hi * hi last in K: the small ones go first


def test_pieces_add_back_exactly_and_are_bf16():
    x = (np.random.default_rng(4).standard_normal(4096) * 1e3).astype(np.float32)
    split = pieces.split(x)
    assert np.array_equal((split[0] + split[1]) + split[2], x)
    assert all(not (p.view(np.uint32) & 0xFFFF).any() for p in split)


def test_emulated_attention_is_float32_accurate(case):
    q, latent, positions, want = case
    assert _rel_error(_attend(q, latent, positions, pieces.products()), want) <= ATTEND_REL


def without(product, segments=pieces.SEGMENTS):
    """The segments less one (left piece, right piece) product, which must open its segment (a
    one-product segment goes entirely): the red arms' mutation, here and on the GPU."""
    out = []
    for (a, b, k), gemm in zip(segments, pieces.products(segments)):
        if product not in gemm:
            out.append((a, b, k))
        else:
            assert gemm[0] == product, f"{product} is inside its segment {gemm}"
            if k > 1:
                out.append((a + 1, b + 1, k - 1))
    return tuple(out)


@pytest.mark.parametrize("product", [(2, 0), (1, 1), (0, 2)], ids=["lo_hi", "mid_mid", "hi_lo"])
def test_red_arm_a_dropped_2_to_the_minus_16_product_breaks_the_bound(case, product):
    q, latent, positions, want = case
    assert sum(map(len, pieces.products(without(product)))) == 5
    assert _rel_error(_attend(q, latent, positions, pieces.products(without(product))), want) > ATTEND_REL


def _head_gemms(products=pieces.HEAD_PRODUCTS):
    """The per-head form's GEMMs: the scores' one over every product, the mix's one a product."""
    return [list(products)], [[pair] for pair in products]


def test_the_per_head_form_keeps_the_same_six_products_smallest_first():
    assert sorted(pieces.HEAD_PRODUCTS) == sorted(pair for gemm in pieces.products() for pair in gemm)
    sizes = [i + j for i, j in pieces.HEAD_PRODUCTS]  # a product's size: 2^-8 per piece step
    assert sizes == sorted(sizes, reverse=True)


def test_emulated_per_head_attention_is_float32_accurate(case):
    q, latent, positions, want = case
    assert _rel_error(_attend(q, latent, positions, *_head_gemms()), want) <= ATTEND_REL


@pytest.mark.parametrize("product", [(2, 0), (1, 1), (0, 2)], ids=["lo_hi", "mid_mid", "hi_lo"])
def test_red_arm_the_per_head_form_less_a_2_to_the_minus_16_product_breaks_the_bound(case, product):
    q, latent, positions, want = case
    kept = tuple(pair for pair in pieces.HEAD_PRODUCTS if pair != product)
    assert _rel_error(_attend(q, latent, positions, *_head_gemms(kept)), want) > ATTEND_REL


@pytest.mark.parametrize("span, group", [(4096, 64), (8192, 32), (100_000, 3), (400_000, 0)])
def test_the_per_head_form_takes_equal_passes_of_heads_within_the_budget(span, group):
    """bench's widths (64 heads, dn = dv = 256): keys' six copies, values' three pieces and a float32
    plane, 5632 bytes a head a position, within 2 GiB; passes of equal size; none past one head."""
    budget = 2 << 30
    assert pieces.head_group(span, 64, 256, 256, budget) == group
    if group:
        most = budget // (span * 5632)  # heads that fit: the fewest passes, each no larger than needed
        assert group <= most and -(-64 // group) == -(-64 // most) and group * (-(-64 // group) - 1) < 64
