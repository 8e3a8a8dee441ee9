"""The whole glm5_next model on the CUDA backend (GPU host only).

* CUDA logits stay within tolerance of the numpy reference for a prime past the kpool dense
  threshold and 32 decode steps, on `mini` and `small` (f32 and bf16 checkpoints).
* The exact class end to end: a t-row walk's row r is bit-identical to the plain decode step
  that consumes the same token, for t = 1..15 — the property the verify walk will stand on.
"""

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra import load_model  # noqa: E402

REL_TOL = 2e-3  # max |cuda - numpy| / max |numpy logit| per row (different reduction orders)


def _prompt(model, n, seed=5):
    return np.random.default_rng(seed).integers(0, model.cfg.vocab_size, n)


@pytest.fixture(scope="module", params=[("mini", 0, "float32"), ("small", 13, "float32"), ("small", 13, "bfloat16")])
def pair(request, fixture_dir):
    name, seed, dtype = request.param
    path = fixture_dir(name, seed=seed, dtype=dtype)
    return load_model(path, backend="cuda"), load_model(path, backend="numpy")


def test_cuda_prime_and_32_decode_steps_track_numpy(pair):
    gpu, ref = pair
    assert gpu.be.name == "cuda"
    p = _prompt(ref, 48)
    cg, cr = gpu.new_cache(96), ref.new_cache(96)
    lg, lr = gpu.prime(p, cg), ref.prime(p, cr)
    worst = float(np.abs(lg - lr).max() / np.abs(lr).max())
    for _ in range(32):
        tok = int(np.argmax(lr))
        lg, lr = gpu.decode_step(tok, cg), ref.decode_step(tok, cr)
        worst = max(worst, float(np.abs(lg - lr).max() / np.abs(lr).max()))
    print(f"max rel diff cuda vs numpy: {worst:.3e}")
    assert worst <= REL_TOL


@pytest.mark.parametrize("t", range(1, 16))
def test_cuda_t_row_walk_rows_equal_plain_decode_steps(pair, t):
    gpu, _ = pair
    p = _prompt(gpu, 30 + t, seed=t)
    walk = gpu.new_cache(64)
    gpu.prime(p[:30], walk)
    rows, _ = gpu.forward_rows(p[30:30 + t], walk)
    rows = gpu.be.to_host(rows)
    plain = gpu.new_cache(64)
    gpu.prime(p[:30], plain)
    for r in range(t):
        assert np.array_equal(rows[r], gpu.decode_step(int(p[30 + r]), plain)), f"row {r} of t={t}"


def test_cuda_decode_is_deterministic_run_to_run(pair):
    gpu, _ = pair
    p = _prompt(gpu, 40, seed=11)
    runs = []
    for _ in range(2):
        cache = gpu.new_cache(64)
        logits = [gpu.prime(p, cache)]
        for tok in (3, 1, 4, 1, 5):
            logits.append(gpu.decode_step(tok, cache))
        runs.append(np.stack(logits))
    assert np.array_equal(runs[0], runs[1])


def test_auto_backend_picks_cuda_on_a_gpu_host(fixture_dir):
    assert load_model(fixture_dir("mini"), backend="auto").be.name == "cuda"
