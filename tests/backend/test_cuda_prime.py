"""The prime class on the CUDA backend (backend/cuda/prime.py, kernels_cu/prime.cu), GPU host only.

A walk of more than VERIFY_CAP rows is a prompt: its projections, routed experts and attention
run as cuBLAS GEMMs, accurate rather than row invariant (DESIGN.md section 2). The gates:

* a bf16 projection through three bf16 pieces per activation is float32-accurate: its error
  against a float64 reference stays under PRIME_REL of the outputs' RMS, and the red arms (the
  lo piece dropped, mid and lo dropped) break that bound on the same inputs;
* the pieces add back to the activations bit for bit (identity weight);
* a per-head projection (the MLA's W_UK, W_UV) runs batched over the heads within PRIME_REL;
* the attention: test_cuda_prime_attention.py;
* a whole prompt primed in one prime-class walk ends in logits within PRIME_LOGITS of the same
  prompt primed through the exact class (walks of at most VERIFY_CAP rows), and a perturbed
  weight on the prime side alone is caught, and so is a broken chunked KDA scan (the prompt's
  KDA layers take it: test_cuda_kda_chunks.py).
The routed experts, router and attention of a prompt are checked against numpy in the family
tables (test_cuda_moe.py, test_cuda_mla.py: the `_prime` cases).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra import load_model  # noqa: E402
from memra.backend.cuda import prime  # noqa: E402
from memra.backend.cuda.dense import DenseOps  # noqa: E402
from memra.backend.cuda.fp8 import DeviceFp8  # noqa: E402
from memra.backend.cuda.moe import expert_tiles  # noqa: E402
from memra.limits import VERIFY_CAP  # noqa: E402
from memra.safetensors_io import bf16_to_f32, f32_to_bf16  # noqa: E402
from tests.backend.inputs import normal  # noqa: E402

PRIME_REL = 4e-6      # max |y - y64| / rms(y64): float32 products, float32 sums (~64 ulps)
PRIME_LOGITS = 2e-4   # max |prime - exact| / max |exact| over the last row's logits


def _inputs(t, n_in, n_out, seed=0):
    rng = np.random.default_rng(seed)
    x = normal(rng, (t, n_in))
    w = f32_to_bf16(normal(rng, (n_out, n_in), n_in ** -0.5))
    want = x.astype(np.float64) @ bf16_to_f32(w).astype(np.float64).T
    return cp.asarray(x), cp.asarray(w), want


def _rel_error(got, want) -> float:
    err = float(np.abs(cp.asnumpy(got) - want).max() / np.sqrt(np.mean(want ** 2)))
    print(f"error {err:.3e} of the outputs' rms")
    return err


@pytest.mark.parametrize("t, n_in, n_out", [(16, 300, 70), (40, 4100, 33), (300, 1029, 257)])
def test_prime_projection_is_float32_accurate(t, n_in, n_out):
    x, w, want = _inputs(t, n_in, n_out)
    got = DenseOps().linear(x, w)
    assert prime.is_prime(t) and got.shape == (t, n_out)
    assert _rel_error(got, want) <= PRIME_REL


@pytest.mark.parametrize("dropped", [(2,), (1, 2)])
def test_red_arm_a_dropped_piece_breaks_the_accuracy_bound(dropped):
    x, w, want = _inputs(300, 1029, 257)
    xp = prime.pieces(x)
    for piece in dropped:
        xp[:, piece] = 0
    assert _rel_error(prime.gemm_pieces(xp, w), want) > PRIME_REL
    assert _rel_error(DenseOps().linear(x, w), want) <= PRIME_REL  # the real op, same inputs


def test_pieces_add_back_to_the_activations_bit_for_bit():
    x = cp.asarray(normal(np.random.default_rng(5), (VERIFY_CAP + 5, 256)) * np.float32(1e3))
    eye = cp.asarray(f32_to_bf16(np.eye(256, dtype=np.float32)))
    assert cp.array_equal(prime.prime_linear(x, eye), x)


@pytest.mark.parametrize("d", [3, 8])  # a value a thread, four
def test_pieces_cover_rows_past_one_grid_of_row_blocks(d):
    """The elementwise kernels take rows over grid y (at most 65535) and loop past it: the last
    rows of a taller x get their pieces too, the same as the first rows' (hi + mid + lo == x)."""
    x = cp.asarray(normal(np.random.default_rng(7), (65535 + 300, d)))
    xp = prime.pieces(x).view(cp.uint16).astype(cp.uint32) << 16
    parts = xp.view(cp.float32)
    assert cp.array_equal((parts[:, 2] + parts[:, 1]) + parts[:, 0], x)


def test_pieces_are_the_same_bits_one_or_four_values_a_thread():
    """Rows of 264 values split four a thread; the same values one float past an aligned start
    split one a thread (a 16-byte load would fault there): the same pieces, gathered or not."""
    x = cp.asarray(normal(np.random.default_rng(4), (37, 264)))
    shifted = cp.empty(x.size + 1, cp.float32)[1:].reshape(x.shape)
    shifted[...] = x
    assert prime.vector_width(264, 4, x) == 4 and prime.vector_width(264, 4, shifted) == 1
    rows = cp.asarray(np.array([36, 0, 5, 5], np.int64))
    assert cp.array_equal(prime.pieces(x), prime.pieces(shifted))
    assert cp.array_equal(prime.pieces(x, rows), prime.pieces(shifted, rows))


def test_gathered_pieces_read_the_named_rows():
    x = cp.asarray(normal(np.random.default_rng(6), (20, 64)))
    rows = cp.asarray(np.array([19, 0, 7, 7], np.int64))
    assert cp.array_equal(prime.pieces(x, rows), prime.pieces(x)[rows])


def test_prime_head_projection_is_float32_accurate():
    """Bench's W_UK shape, 64 heads of 256 -> 512, on 40 rows: cuBLAS batched over the heads."""
    rng = np.random.default_rng(10)
    x = normal(rng, (40, 64, 256))
    w = f32_to_bf16(normal(rng, (64, 512, 256), 256 ** -0.5))
    want = np.einsum("thi,hoi->tho", x.astype(np.float64), bf16_to_f32(w).astype(np.float64))
    got = DenseOps().head_linear(cp.asarray(x), cp.asarray(w))
    assert got.shape == (40, 64, 512) and _rel_error(got, want) <= PRIME_REL


def test_a_long_prompts_experts_go_in_row_chunks(monkeypatch):
    """MOE_ROWS rows at a time: a 40-row prompt in chunks of 7 stays within the experts' tolerance."""
    from memra.backend.numpy_ref import NumpyBackend

    rng = np.random.default_rng(8)
    x = normal(rng, (40, 64))
    idx = np.sort(np.stack([rng.choice(6, 2, replace=False) for _ in range(40)]), axis=1).astype(np.int64)
    wts = rng.uniform(0.2, 1.0, (40, 2)).astype(np.float32)
    gate, up = (f32_to_bf16(normal(rng, (6, 24, 64), 0.125)) for _ in range(2))
    down = f32_to_bf16(normal(rng, (6, 64, 24), 0.2))
    want = NumpyBackend().moe_experts(x, idx, wts, *(bf16_to_f32(a) for a in (gate, up, down)), 10.0)
    monkeypatch.setattr(prime, "MOE_ROWS", 7)
    got = prime.prime_experts(*(cp.asarray(a) for a in (x, idx, wts, gate, up, down)), 10.0, expert_tiles)
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-4, atol=1e-5)


def _skewed_experts(kind: str, shared: bool = False, idx=None):
    """A 40-row prompt whose experts 0 and 1 serve 24 slots each and experts 2..5 about 8 each
    (shared: and every row's last slot expert 6), weights bf16 bits or FP8 blocks -> (device
    args, numpy reference); idx: other slots, the same weights."""
    from memra.backend.fp8 import dequantize, quantize
    from memra.backend.numpy_ref import NumpyBackend

    rng = np.random.default_rng(9)
    x = normal(rng, (40, 64))
    routed = np.array([[0, 1]] * 24 + [sorted(rng.choice(range(2, 6), 2, replace=False)) for _ in range(16)], np.int64)
    wts = rng.uniform(0.2, 1.0, (40, 2 + shared)).astype(np.float32)
    e = 6 + shared
    shapes, scales = ((e, 24, 64), (e, 24, 64), (e, 64, 24)), (0.125, 0.125, 0.2)
    mats = [normal(rng, shape, scale) for shape, scale in zip(shapes, scales)]
    if idx is None:
        idx = np.concatenate([routed, np.full((40, 1), 6)], axis=1) if shared else routed
    if kind == "fp8":
        blocks = [quantize(m) for m in mats]
        weights, widened = [DeviceFp8.upload(b) for b in blocks], [dequantize(b) for b in blocks]
    else:
        bits = [f32_to_bf16(m) for m in mats]
        weights, widened = [cp.asarray(b) for b in bits], [bf16_to_f32(b) for b in bits]
    want = NumpyBackend().moe_experts(x, idx, wts, *widened, 10.0)
    return (cp.asarray(x), cp.asarray(idx), cp.asarray(wts), *weights, 10.0), want


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("tile_rows, tiled_slots", [(0, 0), (12, 32), (10 ** 9, 80)])
def test_a_prompts_experts_on_gemms_tiles_or_both_match_numpy(monkeypatch, kind, tile_rows, tiled_slots):
    """Experts of fewer than TILE_ROWS slots run on the exact tiles, the others on GEMMs: all on
    GEMMs, a mix (experts 2..5 tiled) and all tiled give the experts' numpy tolerance; the red
    arm feeds the combine the tiled slots' outputs one slot off."""
    args, want = _skewed_experts(kind)
    monkeypatch.setitem(prime.TILE_ROWS, kind, tile_rows)
    tiled = []

    def counted(x, *rest):
        tiled.append(x.shape[0])
        return expert_tiles(x, *rest)

    np.testing.assert_allclose(cp.asnumpy(prime.prime_experts(*args, counted)), want, rtol=1e-4, atol=1e-5)
    assert sum(tiled) == tiled_slots
    if tiled_slots:
        one_off = lambda *a: cp.roll(expert_tiles(*a), 1, axis=0)
        assert not np.allclose(cp.asnumpy(prime.prime_experts(*args, one_off)), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_a_prompts_shared_expert_runs_before_the_count_read_and_matches_numpy(monkeypatch, kind):
    """shared: every row's last slot is the last expert (moe_route's shared slot), run over all
    rows while the host reads the routed counts: the experts' numpy tolerance, tiled experts
    among them. Red arm: the same call on slots whose last is another expert computes the last
    expert there anyway (the promise is what the shared run reads), so it misses numpy's sum."""
    args, want = _skewed_experts(kind, shared=True)
    monkeypatch.setitem(prime.TILE_ROWS, kind, 12)
    plans, run = [], prime._gemm_experts

    def recorded(handle, xp, plan, *rest):
        plans.append(plan)
        run(handle, xp, plan, *rest)

    monkeypatch.setattr(prime, "_gemm_experts", recorded)
    got = prime.prime_experts(*args, expert_tiles, shared=True)
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-4, atol=1e-5)
    assert plans[0] == [(6, 40, 0)]  # the shared expert first, every row
    broken = args[1].copy()
    broken[:, -1] = 5
    _, broken_want = _skewed_experts(kind, shared=True, idx=cp.asnumpy(broken))
    assert not np.allclose(cp.asnumpy(prime.prime_experts(args[0], broken, *args[2:], expert_tiles, shared=True)),
                           broken_want, rtol=1e-4, atol=1e-5)


def test_fp8_gemm_experts_start_their_down_rows_from_zero_on_dirty_memory(monkeypatch):
    """An FP8 expert's down products accumulate into its output rows, which each GEMM pass zeroes
    (only its own: the tiled slots' rows are never written): allocations carved from memory that
    held NaN still give numpy's sum."""
    args, want = _skewed_experts("fp8", shared=True)
    monkeypatch.setitem(prime.TILE_ROWS, "fp8", 12)
    cp.get_default_memory_pool().free_all_blocks()
    dirty = cp.full(1 << 22, cp.nan, cp.float32)
    del dirty  # back to the pool, NaN inside
    np.testing.assert_allclose(cp.asnumpy(prime.prime_experts(*args, expert_tiles, shared=True)), want,
                               rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def small_bf16(fixture_dir):
    return load_model(fixture_dir("small", seed=13, dtype="bfloat16"), backend="cuda")


def _exact_prime(model, prompt, cache):
    """The prompt through exact-class walks of at most VERIFY_CAP rows."""
    for start in range(0, len(prompt), VERIFY_CAP):
        logits = model.prime(prompt[start:start + VERIFY_CAP], cache)
    return logits


def _prime_vs_exact(model, prompt) -> float:
    want = _exact_prime(model, prompt, model.new_cache(len(prompt)))
    got = model.prime(prompt, model.new_cache(len(prompt)))
    worst = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"prime vs exact-class logits: {worst:.3e} of the largest logit")
    return worst


def test_a_prime_class_prompt_ends_in_the_exact_class_logits_within_tolerance(small_bf16):
    prompt = np.random.default_rng(9).integers(0, small_bf16.cfg.vocab_size, 70)
    assert _prime_vs_exact(small_bf16, prompt) <= PRIME_LOGITS


def test_a_prompt_primed_in_chunks_ends_within_the_same_tolerance(small_bf16, monkeypatch):
    """PRIME_CHUNK rows at a time (here 32: two prime-class walks and an exact-class one)."""
    from memra.model import trunk

    monkeypatch.setattr(trunk, "PRIME_CHUNK", 32)
    prompt = np.random.default_rng(9).integers(0, small_bf16.cfg.vocab_size, 70)
    assert _prime_vs_exact(small_bf16, prompt) <= PRIME_LOGITS


def test_red_arm_a_perturbed_prime_projection_is_caught(small_bf16, monkeypatch):
    """A 0.2% error on the prime-class projections' outputs (alternating sign by output, so no
    norm cancels it) moves the logits past the bound; the exact-class side is untouched."""
    prompt = np.random.default_rng(9).integers(0, small_bf16.cfg.vocab_size, 70)
    real = prime.prime_linear

    def perturbed(x, w, xp=None):
        y = real(x, w, xp)
        return y * cp.where(cp.arange(y.shape[1]) % 2 == 0, cp.float32(1.002), cp.float32(0.998))

    monkeypatch.setattr("memra.backend.cuda.dense.prime_linear", perturbed)
    assert _prime_vs_exact(small_bf16, prompt) > PRIME_LOGITS


def test_red_arm_a_broken_chunked_kda_scan_is_caught(small_bf16, monkeypatch):
    """The prompt's KDA layers run the chunked scan (kda_chunks.py): with each chunk's decay
    taken as 1 on the prime side alone, the logits leave the bound."""
    from memra.backend.cuda import kda_chunks
    from tests.backend.test_cuda_kda_chunks import _mutated

    prompt = np.random.default_rng(9).integers(0, small_bf16.cfg.vocab_size, 70)
    monkeypatch.setattr(kda_chunks, "launch", _mutated("decay_ignored"))
    assert _prime_vs_exact(small_bf16, prompt) > PRIME_LOGITS
