"""The prime class's attention on the CUDA backend (backend/cuda/prime_attention.py,
kernels_cu/prime.cu), GPU host only.

A prompt's MLA attention (scores, masked softmax, mix as six-product bf16 GEMMs,
backend/pieces.py) at bench widths stays within ATTEND_VS_SGEMM times the float32-GEMM
attention's error against a float64 reference, and dropping any one 2^-16 product breaks that
bound (the CPU twin of the gate: test_prime_pieces.py); so does the per-head form (keys and
values expanded from the latent) that a prompt's MLA layers run, in one pass of heads or
several, and the absorbed form it falls back to. The softmax's pieces add back to float64's
masked softmax, cached in shared memory or not, one column a thread or four.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda import prime_attention as attention  # noqa: E402
from memra.safetensors_io import bf16_to_f32, f32_to_bf16  # noqa: E402
from tests.backend.inputs import attend_case, attend_reference, normal  # noqa: E402
from tests.backend.test_cuda_prime import _rel_error  # noqa: E402
from tests.backend.test_prime_pieces import SCALE, without  # noqa: E402

# The prime attention's error against float64, as a multiple of the error of the float32-GEMM
# attention it replaces (on the same inputs, this GPU): tensor cores add their products with
# less care than a float32 FMA chain, but must stay at a float32 GEMM's level
ATTEND_VS_SGEMM = 2.0


def _sgemm_attend(q, latent, positions, scale):
    """The absorbed attention as float32 GEMMs (cupy.matmul) around a masked softmax: the
    accuracy the tensor-core form is held to."""
    t, h, rank = q.shape
    ctx = int(positions.max()) + 1
    keep = np.zeros((t, ctx), bool)
    for i, row in enumerate(positions):
        keep[i, row[row >= 0]] = True
    lat, kept = cp.asarray(latent[:ctx]), cp.asarray(keep)[:, None, :]
    s = cp.matmul(cp.asarray(q).reshape(t * h, rank), lat.T).reshape(t, h, ctx) * cp.float32(scale)
    s = cp.where(kept, s, -cp.inf)
    top = cp.max(s, axis=2, keepdims=True)
    e = cp.where(kept, cp.exp(s - cp.where(cp.isfinite(top), top, 0)), 0).astype(cp.float32)
    total = e.sum(axis=2, keepdims=True)
    p = cp.where(total > 0, e / cp.where(total > 0, total, 1), 0).astype(cp.float32)
    return cp.matmul(p.reshape(t * h, ctx), lat).reshape(t, h, rank)


@pytest.fixture(scope="module")
def bench_attention():
    """40 rows ending a 2000-position context, 64 heads, rank 512, 30% of positions skipped;
    with the bound: ATTEND_VS_SGEMM times the float32-GEMM attention's error."""
    q, latent, positions = attend_case(np.random.default_rng(11), 40, 64, 512, 2000)
    want = attend_reference(q, latent, positions, SCALE)
    return q, latent, positions, want, ATTEND_VS_SGEMM * _rel_error(_sgemm_attend(q, latent, positions, SCALE), want)


def _attend(q, latent, positions):
    from memra.backend.cuda.mla import MlaOps

    got = MlaOps().mla_attend(cp.asarray(q), cp.asarray(latent), cp.asarray(positions), SCALE)
    return cp.asnumpy(got)


def test_prime_attention_is_float32_accurate(bench_attention, monkeypatch):
    q, latent, positions, want, bound = bench_attention
    monkeypatch.setattr(attention, "ATTEND_ROWS", 16)  # three chunks, each its own padded context
    got = _attend(q, latent, positions)
    assert not got[-1].any()  # the row listing nothing attends nothing
    assert _rel_error(got, want) <= bound


def test_prime_softmax_gives_the_same_bits_from_shared_memory_or_in_place(bench_attention, monkeypatch):
    """A chunk's rows of scores up to SHARED_BYTES are read once into shared memory; past it the
    kernel keeps its exponentials in place and reads the row three times: the same bits."""
    q, latent, positions, _, _ = bench_attention
    cached = _attend(q, latent, positions)
    monkeypatch.setattr(attention, "SHARED_BYTES", 0)
    assert np.array_equal(_attend(q, latent, positions), cached)


@pytest.mark.parametrize("ctx", [13, 16, 1000], ids=["one_a_thread", "four_a_thread", "four_a_thread_long"])
@pytest.mark.parametrize("cached", [True, False])
def test_prompt_softmax_pieces_are_the_masked_softmax(monkeypatch, ctx, cached):
    """_softmax_pieces of scores [3, 2, ctx] under a keep mask (row 2 keeps nothing): the pieces,
    in the order asked, add back to float64's masked softmax at float32 accuracy, one column
    a thread where ctx is not a multiple of 4, four where it is, with scores in shared memory or
    in place; unkept columns and a row keeping nothing weigh exactly 0."""
    rng = np.random.default_rng(13)
    scores = rng.standard_normal((3, 2, ctx)).astype(np.float32) * np.float32(4)
    keep = (rng.random((3, ctx)) < 0.7).astype(np.uint8)
    keep[2] = 0
    z = np.where(keep[:, None, :] > 0, scores.astype(np.float64) * 0.5, -np.inf)
    e = np.exp(z - np.max(np.where(keep[:, None, :] > 0, z, -1e300), axis=2, keepdims=True))
    total = e.sum(axis=2, keepdims=True)
    want = np.where(total > 0, e / np.where(total > 0, total, 1), 0).reshape(6, ctx)
    if not cached:
        monkeypatch.setattr(attention, "SHARED_BYTES", 0)
    order = (2, 0, 1)
    probs = attention._softmax_pieces(cp.asarray(scores), cp.asarray(keep), 2, ctx, 0.5, order)
    parts = (cp.asnumpy(probs).astype(np.uint32) << 16).view(np.float32).reshape(6, 3, ctx)
    got = (parts[:, order.index(2)] + parts[:, order.index(1)]) + parts[:, order.index(0)]
    assert not got[4:].any() and not got[:4][np.repeat(keep[:2], 2, axis=0) == 0].any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)  # float32 expf and sums of <= 1000 terms


@pytest.mark.parametrize("product", [(2, 0), (1, 1), (0, 2)], ids=["lo_hi", "mid_mid", "hi_lo"])
def test_red_arm_a_dropped_attention_product_breaks_the_bound(bench_attention, monkeypatch, product):
    q, latent, positions, want, bound = bench_attention
    monkeypatch.setattr(attention, "SEGMENTS", without(product))
    assert _rel_error(_attend(q, latent, positions), want) > bound


@pytest.fixture(scope="module")
def bench_heads(bench_attention):
    """bench_attention's lists and latent with per-head queries [40, 64, 256] and bf16 W_UK^T,
    W_UV (bench's dn = dv = 256, R = 512), the float64 reference, and the bound: ATTEND_VS_SGEMM
    times the error of the same attention as float32 GEMMs."""
    _, latent, positions, _, _ = bench_attention
    rng = np.random.default_rng(12)
    q = normal(rng, (40, 64, 256)) * np.float32(1.5)
    w_uk_t = f32_to_bf16(normal(rng, (64, 512, 256), 256 ** -0.5))
    w_uv = f32_to_bf16(normal(rng, (64, 256, 512), 512 ** -0.5))
    uk, uv = (bf16_to_f32(w).astype(np.float64) for w in (w_uk_t, w_uv))
    q_lat = np.einsum("thd,hrd->thr", q.astype(np.float64), uk)
    want = np.einsum("thr,hvr->thv", attend_reference(q_lat, latent, positions, SCALE), uv)
    def per_head(x, w):  # x [t, H, in] @ w[h].T, float32 GEMMs
        return cp.matmul(x.transpose(1, 0, 2), cp.asarray(bf16_to_f32(w)).transpose(0, 2, 1)).transpose(1, 0, 2)
    o_lat32 = _sgemm_attend(cp.asnumpy(per_head(cp.asarray(q), w_uk_t)), latent, positions, SCALE)
    sgemm = per_head(o_lat32, w_uv)
    args = tuple(cp.asarray(a) for a in (q, latent, positions, w_uk_t, w_uv))
    return args, want, ATTEND_VS_SGEMM * _rel_error(sgemm, want)


def _attention(args, monkeypatch, rows: int, attend_bytes: int):
    """MlaOps.mla_attention of a prompt with `rows` a chunk (either form) and ATTEND_BYTES set,
    and the head passes it ran (prime_attend_heads's head_group; 0: the absorbed form)."""
    from memra.backend.cuda.mla import MlaOps

    monkeypatch.setattr(attention, "ATTEND_ROWS", rows)
    monkeypatch.setattr(attention, "HEAD_ROWS", rows)
    monkeypatch.setattr(attention, "ATTEND_BYTES", attend_bytes)
    groups, group = [], attention.head_group
    monkeypatch.setattr(attention, "head_group", lambda *a: groups.append(group(*a)) or groups[-1])
    got = cp.asnumpy(MlaOps().mla_attention(*args, SCALE))
    return got, groups


@pytest.mark.parametrize("attend_bytes, group", [(1 << 30, 64), (300 << 20, 22), (1 << 20, 0)],
                         ids=["one_pass", "three_passes", "absorbed"])
def test_prime_attention_per_head_is_float32_accurate(bench_heads, monkeypatch, attend_bytes, group):
    """A prompt's MLA attention from per-head queries: one pass of 64 heads, three of 22 (the
    expanded keys and values budgeted by ATTEND_BYTES), or the absorbed form where one head's do
    not fit; rows in chunks of 16 (three), all within the float32-GEMM attention's bound."""
    args, want, bound = bench_heads
    got, groups = _attention(args, monkeypatch, 16, attend_bytes)
    assert groups == [group]
    assert not got[-1].any()  # the row listing nothing attends nothing
    assert _rel_error(got, want) <= bound


@pytest.mark.parametrize("product", [(2, 0), (1, 1), (0, 2)], ids=["lo_hi", "mid_mid", "hi_lo"])
def test_red_arm_the_per_head_attention_less_a_product_breaks_the_bound(bench_heads, monkeypatch, product):
    args, want, bound = bench_heads
    monkeypatch.setattr(attention, "HEAD_PRODUCTS", tuple(p for p in attention.HEAD_PRODUCTS if p != product))
    got, groups = _attention(args, monkeypatch, 16, 1 << 30)
    assert groups == [64] and _rel_error(got, want) > bound
