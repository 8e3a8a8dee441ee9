"""The Philox family on the GPU (PhiloxOps, backend/cuda/philox.py -> kernels_cu/philox.cu) against
its host twin (memra/backend/philox.py) and NumpyBackend.race_draw.

Streams, not rows, so no row table: this file pins the twins one by one.
* known answers: the Random123 `philox4x32 10` kat vectors through the device bijection;
* streams: device uniforms == host uniforms bit for bit (the map (w + 0.5) / 2^32 is exact in
  float64), for n below, at and past a block, and not a multiple of 4;
* draws: device race_draw == host race_draw on a few thousand (probs, seed, counter) cases.
  Both compute p_i / -log(u_i) in float64; the logs may differ by an ulp, which could only flip
  a comparison whose two ratios agree to ~1e-16. The u_i of one stream are distinct 32-bit words
  (so -log(u) values differ by >= 2^-33 relative) and the probs here are drawn from continuous
  Dirichlets, so such near-ties have probability ~1e-13 over the whole table; exact ties in p
  (uniform rows) are still decided by the distinct u_i, and zero entries never win. Zero
  mismatches are allowed.
* a sampled spec run on CUDA (device draws through the whole engine) is reproducible (same seed
  twice -> same tokens). Token equality with the numpy backend is not asked: the logits differ
  within tolerance.
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_philox.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra import load_model  # noqa: E402
from memra.backend.cuda.philox import PhiloxOps  # noqa: E402
from memra.backend.numpy_ref import NumpyBackend  # noqa: E402
from memra.backend.philox import TAG_ACCEPT, TAG_DRAW, philox4x32_10, uniforms  # noqa: E402
from memra.generate import generate  # noqa: E402
from memra.speculative.sampling import SamplingParams  # noqa: E402
from tests.backend.harness import assert_same_signature  # noqa: E402

KAT = [  # Random123 kat_vectors, philox4x32 10: (ctr, key) -> out
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.fixture(scope="module")
def be():
    return PhiloxOps()


def test_every_device_op_has_its_host_twin_signature(be):
    """race_draw is NumpyBackend's; philox_block and philox_uniforms mirror backend/philox.py."""
    assert {n for n in dir(PhiloxOps) if not n.startswith("_")} == {"philox_block", "philox_uniforms", "race_draw"}
    assert_same_signature(PhiloxOps.race_draw, NumpyBackend.race_draw)
    assert_same_signature(be.philox_block, philox4x32_10)
    assert_same_signature(be.philox_uniforms, uniforms)


@pytest.mark.parametrize("ctr, key, want", KAT, ids=["zeros", "ones", "pi"])
def test_device_philox_matches_the_random123_known_answers(be, ctr, key, want):
    assert be.philox_block(ctr, key).tolist() == list(want)


def test_device_philox_equals_host_on_random_blocks(be):
    rng = np.random.default_rng(0)
    for _ in range(64):
        ctr, key = rng.integers(0, 2**32, 4), rng.integers(0, 2**32, 2)
        host = [int(w) for w in philox4x32_10(tuple(ctr.tolist()), tuple(key.tolist()))]
        assert be.philox_block(ctr, key).tolist() == host


STREAMS = [(0, 0, TAG_DRAW, 1), (7, 3, TAG_DRAW, 3), (7, 3, TAG_ACCEPT, 5), (2**64 - 1, 2**32 - 1, TAG_DRAW, 129),
           (2**40 + 11, 17, TAG_ACCEPT, 1023), (123456789, 0, 1, 4097), (99, 5, TAG_DRAW, 155_001)]


@pytest.mark.parametrize("seed, counter, tag, n", STREAMS)
def test_device_uniforms_equal_host_uniforms_bit_for_bit(be, seed, counter, tag, n):
    dev = be.philox_uniforms(seed, counter, tag, n)
    host = uniforms(seed, counter, tag, n)
    assert dev.dtype == np.float64 and dev.shape == (n,)
    assert np.array_equal(dev.view(np.uint64), host.view(np.uint64))


def _probs(rng, case: int) -> np.ndarray:
    vocab = int(rng.choice([2, 3, 7, 32, 255, 256, 257, 1000, 4099, 12289]))  # 4099, 12289: 2 and 4 race spans
    kind = case % 4
    if kind == 0:                                   # dense, continuous
        return rng.dirichlet(np.full(vocab, 0.5))
    if kind == 1:                                   # a filtered row: most entries exactly zero
        p = np.zeros(vocab)
        keep = rng.choice(vocab, size=min(vocab, int(rng.integers(1, 9))), replace=False)
        p[keep] = rng.dirichlet(np.ones(keep.size))
        return p
    if kind == 2:                                   # exact ties: a uniform row over a subset
        p = np.zeros(vocab)
        p[rng.choice(vocab, size=max(1, vocab // 3), replace=False)] = 1.0
        return p / p.sum()
    return rng.dirichlet(np.full(vocab, 0.05))      # peaked: tiny probabilities everywhere else


def test_device_race_draw_equals_host_race_draw(be):
    rng = np.random.default_rng(1)
    host_be = NumpyBackend()
    mismatches = []
    for case in range(3000):
        p = _probs(rng, case)
        seed, counter = int(rng.integers(0, 2**63)) * 2 + case % 2, int(rng.integers(0, 2**32))
        tag = TAG_DRAW if case % 5 else int(rng.integers(0, 2**32))
        dev, host = be.race_draw(p, seed, counter, tag), host_be.race_draw(p, seed, counter, tag)
        if dev != host:
            mismatches.append((case, p.size, seed, counter, tag, dev, host))
        assert p[dev] > 0
    assert not mismatches, mismatches[:5]


def test_device_race_draw_never_picks_a_zero_and_ties_go_low(be):
    one_hot = np.zeros(1000)
    one_hot[777] = 1.0
    assert {be.race_draw(one_hot, s, c) for s in range(4) for c in range(8)} == {777}
    assert be.race_draw(np.zeros(300), 5, 6) == 0                      # nothing to draw: index 0
    assert be.race_draw(np.zeros(9000), 5, 6) == 0                     # ... over three race spans too


@pytest.mark.parametrize("draft, k", [("native-mtp", 3), (None, 0)])
def test_sampled_runs_on_cuda_are_reproducible(fixture_dir, draft, k):
    model = load_model(fixture_dir("mini"), backend="cuda")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    def run(seed):
        sp = SamplingParams(temperature=1.1, top_p=0.95, seed=seed)
        return generate(model, prompt, 20, draft=draft, num_draft_tokens=max(k, 1), sampling=sp).tokens

    first = run(31)
    assert len(first) == 20 and run(31) == first
    assert any(run(s) != first for s in (32, 33, 34))
