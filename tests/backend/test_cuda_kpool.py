"""The kpool indexer's two decode kernels at a long context's sizes (GPU host only).

Past index_topk positions a decode row scores every complete pool and keeps the budget best;
tests/backend/test_cuda_mla.py checks the whole selection against numpy on small planes, these
gates check each kernel on its own at bench's sizes (32 indexer heads of 128 channels, budget 128
of up to 700 pools):

* kpool_scores writes the bytes of a thread-a-pool serial loop (heads in order, each dot over the
  channels in order), the arithmetic its comment defines, at full and partial pool blocks; red
  arm: the heads' terms added in reverse order;
* kpool_select, given the scores, keeps exactly numpy's `_top` set (the budget largest, ties to
  the lower pool) in ascending pool order, on scores full of exact ties, signed zeros and
  negatives; red arm: ties to the higher pool.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda import runtime  # noqa: E402
from memra.backend.cuda.mla import MlaOps  # noqa: E402
from memra.backend.cuda.runtime import blocks_of, position  # noqa: E402
from memra.backend.numpy_ref import _top  # noqa: E402
from memra.kernels_cu.constants import KPOOL_POOLS  # noqa: E402
from tests.backend.inputs import normal  # noqa: E402

F32 = np.float32
POOL, BUDGET = 16, 128

# The arithmetic kpool_scores defines, a thread a pool: the oracle its blocks must match bit for bit.
SERIAL_SCORES = r"""
#include "common.cuh"
extern "C" __global__ void serial_scores(const float* q, const float* w, const float* pool_keys,
                                         float* scores, int n, int Hi, int Di, int nmax, float scale) {
    const int r = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    const float* qr = q + (long long)r * Hi * Di;
    const float* pk = pool_keys + (long long)j * Di;
    float acc = 0.0f;
    for (int h = 0; h < Hi; ++h) {
        float dot = 0.0f;
        for (int d = 0; d < Di; ++d) dot += qr[h * Di + d] * pk[d];
        acc += w[r * Hi + h] * fmaxf(dot * scale, 0.0f);
    }
    scores[(long long)r * nmax + j] = acc;
}
"""


def _scores(mod, q, w, pool_keys, pos0, nmax, scale):
    """mod's kpool_scores for rows at pos0.. -> [t, nmax] (pools it does not score stay NaN)."""
    t, hi, di = q.shape
    out = cp.full((t, nmax), np.nan, cp.float32)
    mod.get_function("kpool_scores")(
        (blocks_of(nmax, KPOOL_POOLS), t), (runtime.BLOCK,),
        (q, w, pool_keys, out, position(pos0), np.int32(POOL), np.int32(BUDGET), np.int32(hi),
         np.int32(di), np.int32(nmax), F32(scale)),
        shared_mem=4 * (hi * (di + 1) + KPOOL_POOLS * hi))
    return cp.asnumpy(out)


def _serial(q, w, pool_keys, pos0, nmax, scale):
    t, hi, di = q.shape
    out = cp.full((t, nmax), np.nan, cp.float32)
    kernel = runtime.source_module(SERIAL_SCORES).get_function("serial_scores")
    for r in range(t):  # row r scores its own complete pools only
        n = (pos0 + r + 1) // POOL
        kernel((blocks_of(n), 1), (runtime.BLOCK,),
               (q[r:r + 1], w[r:r + 1], pool_keys, out[r:r + 1], np.int32(n), np.int32(hi), np.int32(di),
                np.int32(nmax), F32(scale)))
    return cp.asnumpy(out)


def _score_inputs(hi, di, nmax, t, seed=0):
    rng = np.random.default_rng([hi, di, nmax, seed])
    return (cp.asarray(normal(rng, (t, hi, di))), cp.asarray(normal(rng, (t, hi))),
            cp.asarray(normal(rng, (nmax, di))), di ** -0.5)


@pytest.mark.parametrize("hi, di, pos0, t", [(32, 128, 3000, 4), (32, 128, 11203, 2), (3, 13, 2100, 3),
                                             (40, 64, 2999, 1)])
def test_kpool_scores_writes_the_serial_loops_bytes(hi, di, pos0, t):
    """Rows past index_topk (n > budget): every complete pool's score is the serial loop's, at
    full and partial blocks of KPOOL_POOLS; pools past a row's n stay unwritten."""
    nmax = (pos0 + t) // POOL + 9
    q, w, pool_keys, scale = _score_inputs(hi, di, nmax, t)
    got = _scores(runtime.module("kpool"), q, w, pool_keys, pos0, nmax, scale)
    want = _serial(q, w, pool_keys, pos0, nmax, scale)
    for r in range(t):
        n = (pos0 + r + 1) // POOL
        assert n > BUDGET and np.isfinite(got[r, :n]).all() and np.isnan(got[r, n:]).all()
    assert got.tobytes() == want.tobytes()


def test_red_arm_kpool_scores_adding_the_heads_backwards_is_caught():
    src = runtime.kernel_dir().joinpath("kpool.cu").read_text()
    backwards = src.replace("for (int h = 0; h < Hi; ++h) acc += terms[threadIdx.x * Hi + h];",
                            "for (int h = Hi - 1; h >= 0; --h) acc += terms[threadIdx.x * Hi + h];")
    assert backwards != src
    q, w, pool_keys, scale = _score_inputs(32, 128, 200, 1)
    got = _scores(runtime.source_module(backwards), q, w, pool_keys, 3000, 200, scale)
    assert got.tobytes() != _serial(q, w, pool_keys, 3000, 200, scale).tobytes()


def _tied_scores(rng, t, nmax):
    """Scores from a few values (exact ties everywhere), signed zeros among them, some negative."""
    values = np.array([-1.5, -0.0, 0.0, 0.25, 0.25, 1.0, 3.0, -7.0], F32)
    return values[rng.integers(0, values.size, (t, nmax))].astype(F32)


def _select(mod, scores, pos0, width):
    t, nmax = scores.shape
    out = cp.full((t, width), -7, cp.int32)
    mod.get_function("kpool_select")((t,), (runtime.BLOCK,),
                                     (cp.asarray(scores), out, position(pos0), np.int32(POOL),
                                      np.int32(BUDGET), np.int32(width), np.int32(nmax)))
    return cp.asnumpy(out)


def _want(scores, pos0, width):
    out = np.full((scores.shape[0], width), -1, np.int32)
    for r in range(scores.shape[0]):
        p = pos0 + r
        n = (p + 1) // POOL
        chosen = _top(scores[r, :n], BUDGET)
        cols = (chosen[:, None] * POOL + np.arange(POOL)).reshape(-1)
        tail = np.arange(n * POOL, p + 1)
        out[r, :cols.size + tail.size] = np.concatenate([cols, tail])
    return out


@pytest.mark.parametrize("pos0, t", [(2063, 3), (3000, 4), (11203, 2), (2055, 15)])
@pytest.mark.parametrize("draw", ["ties", "normal"])
def test_kpool_select_keeps_numpys_top_set_in_pool_order(pos0, t, draw):
    """Rows on both sides of index_topk (2055 + 15 rows crosses it): dense rows attend 0..p,
    sparse rows numpy's _top(scores[:n], budget) pools, ascending, then the tail and -1."""
    rng = np.random.default_rng([pos0, t])
    nmax = (pos0 + t) // POOL + 5
    scores = _tied_scores(rng, t, nmax) if draw == "ties" else normal(rng, (t, nmax))
    width = (BUDGET + 1) * POOL - 1
    assert np.array_equal(_select(runtime.module("kpool"), scores, pos0, width), _want(scores, pos0, width))


def test_red_arm_kpool_select_breaking_ties_to_the_higher_pool_is_caught():
    src = runtime.kernel_dir().joinpath("kpool.cu").read_text()
    higher = src.replace("(0xFFFFFFFFu - (unsigned int)j)", "((unsigned int)j)")
    assert higher != src
    scores = _tied_scores(np.random.default_rng(1), 2, 300)
    width = (BUDGET + 1) * POOL - 1
    assert not np.array_equal(_select(runtime.source_module(higher), scores, 3000, width),
                              _want(scores, 3000, width))


@pytest.mark.parametrize("hi, di", [(32, 128), (128, 128)])
def test_the_backend_selects_what_the_kernels_do_on_a_long_plane(hi, di):
    """MlaOps.kpool_select (kpool_scores then kpool_select) against the two gates' oracles chained;
    128 heads of 128 stage 70 KB of q, past what a launch gets without opting in."""
    q, w, pool_keys, scale = _score_inputs(hi, di, 400, 3, seed=1)
    width = (BUDGET + 1) * POOL - 1
    got = cp.asnumpy(MlaOps().kpool_select(q, w, pool_keys, 3000, POOL, BUDGET, width, scale))
    serial = _serial(q, w, pool_keys, 3000, 400, scale)
    assert np.array_equal(got, _want(serial, 3000, width))
