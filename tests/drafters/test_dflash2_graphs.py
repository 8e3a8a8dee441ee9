"""A DFlash2 round as CUDA graphs: the block attention kernel and the captured rounds.

* block_attention: the numpy twin against a per-query float64 loop (CPU), and the CUDA kernel
  against the twin over GQA, causal, window and head dims up to DRAFT_MAX_HD, with the context
  buffer's unused rows poisoned with NaN (a read past the context length would show).
* Captured rounds are the eager rounds, bit for bit: the same rounds (context appends of 1..5
  rows, then draft_rows) on a graph runner and without one, eager -> capture -> replays, while
  the context grows; the graphs are really replayed.
* Red arm: a replay that keeps the context length it was captured at breaks the identity.
"""

import numpy as np
import pytest

from memra import load_model
from memra.backend.numpy_ref import NumpyBackend
from memra.drafters.dflash2 import DflashDraft

from tests.gpu import cupy_or_skip, stale_position_walks

from .dflash2_helpers import F32, ctx_rows, drafter

CASES = [  # (b, nh, nkv, hd, n_ctx, causal, window)
    (8, 4, 2, 16, 9, False, None), (16, 8, 2, 64, 40, True, None), (4, 4, 4, 128, 0, False, None),
    (8, 4, 1, 256, 30, False, 6), (3, 6, 3, 32, 17, True, 5), (1, 2, 1, 48, 100, False, None),
]


def _inputs(b, nh, nkv, hd, n_ctx, seed=0, room=8):
    rng = np.random.default_rng(seed)
    q = rng.normal(0, 1, (b, nh, hd)).astype(F32)
    k_ctx, v_ctx = (np.full((n_ctx + room, nkv, hd), np.nan, F32) for _ in range(2))
    k_ctx[:n_ctx], v_ctx[:n_ctx] = (rng.normal(0, 1, (n_ctx, nkv, hd)).astype(F32) for _ in range(2))
    k_blk, v_blk = (rng.normal(0, 1, (b, nkv, hd)).astype(F32) for _ in range(2))
    return q, k_ctx, v_ctx, k_blk, v_blk


def _loop(q, k_ctx, v_ctx, k_blk, v_blk, n, causal, window, scale):
    b, nh, hd = q.shape
    rep = nh // k_blk.shape[1]
    keys, values = np.concatenate([k_ctx[:n], k_blk]), np.concatenate([v_ctx[:n], v_blk])
    out = np.zeros((b, nh, hd))
    for i in range(b):
        for h in range(nh):
            seen = [j for j in range(n + b) if not (causal and j > n + i)
                    and not (window is not None and abs(n + i - j) >= window)]
            s = np.array([q[i, h].astype(np.float64) @ keys[j, h // rep] for j in seen]) * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ values[seen, h // rep].astype(np.float64)
    return out


@pytest.mark.parametrize("case", CASES)
def test_numpy_block_attention_is_the_per_query_definition(case):
    b, nh, nkv, hd, n_ctx, causal, window = case
    args = _inputs(b, nh, nkv, hd, n_ctx)
    got = NumpyBackend().block_attention(*args, n_ctx, causal, window, hd ** -0.5)
    assert got.shape == (b, nh, hd) and got.dtype == F32
    assert np.allclose(got, _loop(*args, n_ctx, causal, window, hd ** -0.5), atol=1e-5)


# ---- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_cuda_block_attention_is_the_numpy_twin(case):
    cp = cupy_or_skip()
    from memra.backend.cuda.backend import CudaBackend

    b, nh, nkv, hd, n_ctx, causal, window = case
    args = _inputs(b, nh, nkv, hd, n_ctx, seed=1)
    want = NumpyBackend().block_attention(*args, n_ctx, causal, window, hd ** -0.5)
    dev = [cp.asarray(a) for a in args]
    for n in (n_ctx, cp.asarray(np.array([n_ctx], np.int32))):  # a host int or the device position
        got = cp.asnumpy(CudaBackend().block_attention(*dev, n, causal, window, hd ** -0.5))
        assert np.isfinite(got).all() and np.allclose(got, want, atol=2e-5)


def _rounds(draft, walks, appends=(5, 2, 1, 3, 1, 2)):
    """Context appends of the given sizes, each followed by a round's draft_rows -> host arrays."""
    from memra.backend.cuda.graphs import WalkGraphs

    cp = cupy_or_skip()
    kv = draft.new_kv(64)
    kv.walks = walks if walks is not None else WalkGraphs(enabled=False)
    out = []
    for r, n in enumerate(appends):
        taps = [cp.asarray(ctx_rows(draft, n, seed=10 * r + i)) for i in range(len(draft.cfg.target_layer_ids))]
        draft.ingest_taps(kv, taps)
        rows, logits, (values, ids) = draft.draft_rows(kv, [7 + r] + [255] * 7, kv.len, 1, 5, 4)
        out.append([cp.asnumpy(a) for a in (rows, logits, values, ids)])
    return kv, out


@pytest.fixture(scope="module")
def cuda_draft(tmp_path_factory, fixture_dir):
    cupy_or_skip()
    model = load_model(fixture_dir("small"), backend="cuda")
    d = drafter(tmp_path_factory.mktemp("graphs"), sliding_window=6, layer_types=["sliding_attention", "full_attention"])
    return DflashDraft.load(d, model)


@pytest.mark.gpu
def test_captured_rounds_are_the_eager_rounds(cuda_draft):
    _, eager = _rounds(cuda_draft, None)
    kv, graphed = _rounds(cuda_draft, cuda_draft.be.walks())
    assert kv.walks.graphs, "no round was captured"
    assert any(key[1] == "ingest" for key in kv.walks.graphs) and any(key[1] == "block" for key in kv.walks.graphs)
    for a, b in zip(eager, graphed):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.gpu
def test_red_arm_a_replay_at_a_stale_context_length_breaks_the_identity(cuda_draft):
    appends = (5, 2, 2, 2, 2)  # the block walk: eager, capture, replays; the 2-row append one round later
    _, fresh = _rounds(cuda_draft, None, appends)
    _, stale = _rounds(cuda_draft, stale_position_walks(), appends)
    for r in (0, 1):  # before any replay the runners agree
        assert all(np.array_equal(x, y) for x, y in zip(fresh[r], stale[r]))
    assert not all(np.array_equal(x, y) for a, b in zip(fresh, stale) for x, y in zip(a, b))
