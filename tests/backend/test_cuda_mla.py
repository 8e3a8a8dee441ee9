"""The MLA family on the GPU (MlaOps, backend/cuda/mla.py -> kernels_cu/kpool.cu and mla.cu): the DSA kpool
indexer (pool-key compression, finalize, pool selection) and absorbed latent attention.

The table runs through the shared gates of tests/backend/harness.py on a 64-position plane with
P = 4 and index_topk 8 (2 pools). Selections (positions) are compared exactly, on inputs redrawn
until every deciding score gap clears a margin, so no near-tie can flip a choice; exact ties get
their own test (the lower pool wins). Red arms: every row selecting as if it sat at the walk's
last position (no causal step) fails the row gate, and a one-ulp change of one row is caught.
Attention also runs on drawn lists (`_mla_lists`) past the kernels' tile edges: heads past one
pass of 64, channels past one mix tile of 128, widths off every tile, -1 padding, rows with
their own lists; the bench shape at t = 1, 8, 15; a mix split that follows t is caught. Every
register tile of mla_scores writes the same bytes (red arm: a tile adding two channels swapped).
The rest pins the positions read from a device buffer (what a captured walk replays).
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_mla.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda import runtime  # noqa: E402
from memra.backend.cuda.mla import MlaOps, score_tile  # noqa: E402
from memra.backend.cuda.runtime import BLOCK, blocks_of  # noqa: E402
from memra.kernels_cu.constants import MIX_SPLIT, MIX_STEP  # noqa: E402
from memra.backend.cuda.runtime import position  # noqa: E402
from memra.backend.numpy_ref import NumpyBackend  # noqa: E402
from tests.backend.harness import NUMPY, T_MAX, OpGates, RedArm, table  # noqa: E402
from tests.backend.inputs import normal, uniform  # noqa: E402

F32 = np.float32
REF = NumpyBackend()
PLANE, POOL, BUDGET, WIDTH = 64, 4, 2, 11  # a 64-position plane, P 4, index_topk 8 -> 2 pools
MARGIN = 1e-3  # relative float64 gap required at every selection boundary

# op -> (rtol, atol) against NumpyBackend; positions are always compared exactly.
TOL = {
    "kpool_compress": (2e-5, 2e-6),  # softmax over P slots: expf ulps, P products
    "kpool_select": (0.0, 0.0),  # positions: exact
    "mla_attend": (1e-4, 1e-5),  # dots over R, softmax over <= W positions, sum of p_j c_j
    "mla_attention": (1e-4, 1e-5),  # mla_attend between two per-head projections
}


def _compress(di):
    def make(rng, npool):  # the row axis is the pools
        rows = {"keys": normal(rng, (npool, POOL, di)), "gates": normal(rng, (npool, POOL, di))}
        return rows, {"ape": normal(rng, (POOL, di), 0.5)}
    return make, lambda be, r, s: be.kpool_compress(r["keys"], r["gates"], s["ape"])


def _select_gap(q, w, pool_keys, pos0, scale) -> float:
    """Smallest relative float64 gap, over the sparse rows, between the last chosen pool's
    score and the best rejected one."""
    gaps = [np.inf]
    for r in range(q.shape[0]):
        n = (pos0 + r + 1) // POOL
        if n <= BUDGET:
            continue
        s = np.maximum(q[r].astype(np.float64) @ pool_keys[:n].astype(np.float64).T * scale, 0.0)
        top = np.sort(w[r].astype(np.float64) @ s)[::-1]
        gaps.append((top[BUDGET - 1] - top[BUDGET]) / (1.0 + abs(top[BUDGET - 1])))
    return min(gaps)


def _select_inputs(rng, t, hi, di, pos0):
    """kpool_select inputs on the plane, redrawn until every boundary is clear. Mostly positive
    dots (uniform, shifted) so relu rarely ties pools at exactly zero. Row r sits at pos0 + r."""
    for _ in range(1000):
        q = uniform(rng, (t, hi, di), -0.25, 1.0)
        w = (uniform(rng, (t, hi), 0.2, 1.0) * F32(hi ** -0.5)).astype(F32)
        pool_keys = uniform(rng, (PLANE // POOL + 1, di), -0.25, 1.0)
        if _select_gap(q, w, pool_keys, pos0, di ** -0.5) > MARGIN:
            return {"q": q, "w": w, "pos0": np.arange(pos0, pos0 + t)}, {"pool_keys": pool_keys}
    raise AssertionError("no kpool_select input with a clear selection margin")


def _select_call(be, r, s):
    return be.kpool_select(r["q"], r["w"], s["pool_keys"], int(r["pos0"][0]), POOL, BUDGET, WIDTH,
                           r["q"].shape[-1] ** -0.5)


def _select(hi, di, pos0):
    return (lambda rng, t: _select_inputs(rng, t, hi, di, pos0)), _select_call


def _mla(h, rank, pos0):
    def make(rng, t):
        sel, shared = _select_inputs(rng, t, 2, 8, pos0)
        rows = {"q_lat": normal(rng, (t, h, rank)), "positions": _select_call(REF, sel, shared)}
        return rows, {"latent": normal(rng, (PLANE, rank))}  # realistic lists: pools, tail, -1 padding
    return make, lambda be, r, s: be.mla_attend(r["q_lat"], s["latent"], r["positions"], F32(rank ** -0.5))


def _mla_lists(h, rank, width, plane):
    """Attention on drawn lists: each row its own ascending positions, the first row full, the
    others -1 padded after at least one valid entry (the indexer's layout)."""
    def make(rng, t):
        pos = np.full((t, width), -1, np.int32)
        for r in range(t):
            n = width if r == 0 else int(rng.integers(1, width + 1))
            pos[r, :n] = np.sort(rng.choice(plane, n, replace=False))
        rows = {"q_lat": normal(rng, (t, h, rank)), "positions": pos}
        return rows, {"latent": normal(rng, (plane, rank))}
    return make, lambda be, r, s: be.mla_attend(r["q_lat"], s["latent"], r["positions"], F32(rank ** -0.5))


def _mla_heads(h, rank, dn, dv, pos0):
    """mla_attention of per-head queries on _mla's lists: dn + dv < 2 rank, so a prompt attends
    per head (float32 weights: cupy.matmul expands the keys and values)."""
    make_lists, _ = _mla(h, rank, pos0)

    def make(rng, t):
        rows, shared = make_lists(rng, t)
        shared.update(w_uk_t=normal(rng, (h, rank, dn), dn ** -0.5), w_uv=normal(rng, (h, dv, rank), rank ** -0.5))
        return {"q": normal(rng, (t, h, dn)), "positions": rows["positions"]}, shared
    return make, lambda be, r, s: be.mla_attention(r["q"], s["latent"], r["positions"], s["w_uk_t"], s["w_uv"],
                                                   F32(dn ** -0.5))


case = table(TOL)
CASES = [
    case("kpool_compress_mini", *_compress(8), ts=(1, 7, 15, 16)),
    case("kpool_compress_small", *_compress(16)),
    case("kpool_compress_odd", *_compress(13), ts=(1, 5, 7, 15)),
    case("kpool_select_mini_dense_to_sparse", *_select(1, 8, 0)),
    case("kpool_select_mini_sparse", *_select(1, 8, 49)),
    case("kpool_select_small_dense_to_sparse", *_select(4, 16, 0)),
    case("kpool_select_small_dense_to_sparse_from_3", *_select(4, 16, 3)),
    case("kpool_select_small_sparse", *_select(4, 16, 49)),
    case("kpool_select_prime", *_select(4, 16, 3), gates=frozenset({NUMPY}), ts=(40,)),  # GEMM scores
    case("mla_attend_mini", *_mla(2, 16, 49)),
    case("mla_attend_small", *_mla(4, 32, 49)),
    case("mla_attend_small_from_3", *_mla(4, 32, 3)),
    case("mla_attend_odd_dense", *_mla(3, 67, 0), ts=(1, 7, 13, 15)),
    # tile edges: 70 heads (two passes), 200 channels (two mix tiles, not a multiple of 32),
    # 150 entries (three mix splits, the last short; scores tiles of 16 and 32 both partial)
    case("mla_attend_tile_edges", *_mla_lists(70, 200, 150, 300), ts=(1, 3, 4, 8, 15)),
    case("mla_attend_one_split", *_mla_lists(5, 33, MIX_SPLIT, 80), ts=(1, 4, 15)),
    case("mla_attend_bench_shape", *_mla_lists(64, 512, 2048 + 15, 4096), ts=(1, 8, 15)),
    # prime class: dense GEMMs under the selection's mask (backend/cuda/prime.py)
    case("mla_attend_prime", *_mla(4, 32, 3), gates=frozenset({NUMPY}), ts=(16, 40)),
    case("mla_attend_prime_dense", *_mla(3, 67, 0), gates=frozenset({NUMPY}), ts=(40,)),
    case("mla_attention_small", *_mla_heads(4, 32, 8, 16, 49)),
    case("mla_attention_prime", *_mla_heads(4, 32, 8, 16, 3), gates=frozenset({NUMPY}), ts=(16, 40)),
]


class _EveryRowAtTheLastPosition(MlaOps):
    """The mutation: each row of a walk selects as if it sat at the walk's last position, so a
    row sees the rows after it (the causal step forgotten)."""

    def kpool_select(self, q, w, pool_keys, pos0, pool, budget, width, scale):
        last, select = pos0 + q.shape[0] - 1, super().kpool_select
        return cp.concatenate([select(q[r:r + 1], w[r:r + 1], pool_keys, last, pool, budget, width, scale)
                               for r in range(q.shape[0])])


class _MixSplitFollowsRows(MlaOps):
    """The mutation: the mix splits its lists by a size that shrinks as rows are added (as if
    sized to fill the GPU), so a row's sum order depends on t."""

    def mla_attend(self, q_lat, latent, positions, scale):
        self._mix_split = MIX_SPLIT if q_lat.shape[0] == 1 else MIX_STEP
        return super().mla_attend(q_lat, latent, positions, scale)


def _case(name):
    return next(c for c in CASES if c.name == name)


class TestMlaOps(OpGates):
    ops, tol, cases = MlaOps, TOL, CASES
    untabled = ("kpool_finalize",)  # a plane write: test_kpool_finalize_* below
    red_arms = (RedArm("kpool_select_rows_at_the_last_position", _case("kpool_select_small_sparse"),
                       _EveryRowAtTheLastPosition),
                RedArm("mla_attend_mix_split_follows_rows", _case("mla_attend_tile_edges"),
                       _MixSplitFollowsRows))
    ulp_cases = ("mla_attend_small", "mla_attend_tile_edges", "kpool_compress_small",
                 "kpool_select_small_sparse")


def test_kpool_select_exact_ties_go_to_the_lower_pool():
    # exact arithmetic (halves, quarters): pools 2, 5 and 9 tie at the top, so 2 and 5 win;
    # with all pools equal, pools 0 and 1 win. Rows at 61..63: tails 60..61, 60..62, none.
    q, w = np.ones((3, 2, 8), F32), np.full((3, 2), 0.5, F32)
    top3 = np.full((PLANE // POOL + 1, 8), 0.5, F32)
    top3[[2, 5, 9]] = 1.0
    flat = np.full((PLANE // POOL + 1, 8), 0.5, F32)
    tails = [[60, 61, -1], [60, 61, 62], [-1, -1, -1]]
    for pool_keys, pools in ((top3, [2, 5]), (flat, [0, 1])):
        cols = [j * POOL + m for j in pools for m in range(POOL)]
        want = np.array([cols + tail for tail in tails], np.int32)
        args = (q, w, pool_keys, 61, POOL, BUDGET, WIDTH, 0.25)
        np.testing.assert_array_equal(REF.kpool_select(*args), want)
        dev = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        np.testing.assert_array_equal(cp.asnumpy(MlaOps().kpool_select(*dev)), want)


# ---- empty mix splits -----------------------------------------------------------------------------

@pytest.mark.parametrize("t", [1, 8])
def test_more_padding_past_a_short_list_changes_no_bit(t):
    """The mix skips a split with no selected entry (its partial would be +0, which moves no sum):
    a list padded with -1 to the bench width gives the bytes of the same list padded to the end of
    its last filled split, and a split cut short by the width (a partial tail split) is kept."""
    rng = np.random.default_rng(t)
    h, rank, wide = 8, 64, 2048 + 15
    n = [int(rng.integers(1, 3 * MIX_SPLIT)) for _ in range(t)]
    narrow = (max(n) + MIX_SPLIT - 1) // MIX_SPLIT * MIX_SPLIT
    pos = np.full((t, wide), -1, np.int32)
    for r in range(t):
        pos[r, :n[r]] = np.sort(rng.choice(4096, n[r], replace=False))
    q, latent = cp.asarray(normal(rng, (t, h, rank))), cp.asarray(normal(rng, (4096, rank)))
    ops, scale = MlaOps(), F32(rank ** -0.5)
    padded = cp.asnumpy(ops.mla_attend(q, latent, cp.asarray(pos), scale))
    short = cp.asnumpy(ops.mla_attend(q, latent, cp.asarray(pos[:, :narrow]), scale))
    assert padded.tobytes() == short.tobytes()
    cut = cp.asnumpy(ops.mla_attend(q, latent, cp.asarray(pos[:, :max(n)]), scale))
    assert cut.tobytes() == short.tobytes()
    np.testing.assert_allclose(padded, REF.mla_attend(q.get(), latent.get(), pos, scale), *TOL["mla_attend"])


# ---- mla_scores' register tiles ---------------------------------------------------------------

SCORE_KERNELS = ((1, 1), (2, 2), (4, 2))  # mla.cu's MLA_SCORES


def _scores_of(mod, tile, q, latent, pos, scale, guard=0):
    """mla_scores_h<TH>p<TP> of `mod` on these inputs; entries it does not write stay NaN."""
    (t, h, rank), width = q.shape, pos.shape[1]
    th, tp = tile
    out = cp.full((t * h, width), np.nan, cp.float32)
    mod.get_function(f"mla_scores_h{th}p{tp}")(
        (blocks_of(width, 16 * tp), t, blocks_of(h, 16 * th)), (BLOCK,),
        (q, latent, pos, out, np.int32(h), np.int32(rank), np.int32(width), F32(scale), np.int32(guard)))
    return cp.asnumpy(out)


def _score_inputs(h, rank, width, plane, t=3):
    rows, shared = _mla_lists(h, rank, width, plane)[0](np.random.default_rng([h, rank, width]), t)
    return (cp.asarray(rows["q_lat"]), cp.asarray(shared["latent"]), cp.asarray(rows["positions"]),
            rank ** -0.5)


SCORE_SHAPES = [(70, 200, 150, 300), (3, 67, 37, 80), (64, 512, 2048 + 15, 4096)]


@pytest.mark.parametrize("h, rank, width, plane", SCORE_SHAPES)
def test_every_score_tile_writes_the_same_bits(h, rank, width, plane):
    """The tile only says which thread runs a dot: every (TH, TP) writes the bytes of (1, 1), at
    partial head, position and channel tiles (R = 67 and 200 leave a channel tail), and writes
    no entry whose position is -1. The wrapper's choice by shape is therefore free."""
    args = _score_inputs(h, rank, width, plane)
    mod = runtime.module("mla")
    base = _scores_of(mod, (1, 1), *args)
    valid = np.repeat(cp.asnumpy(args[2]) >= 0, h, axis=0)
    assert np.isfinite(base[valid]).all() and np.isnan(base[~valid]).all()
    for tile in SCORE_KERNELS[1:]:
        assert _scores_of(mod, tile, *args).tobytes() == base.tobytes(), tile
    assert {score_tile(t, width, h, long) for t in (1, 15) for long in (False, True)} <= set(SCORE_KERNELS)


def test_red_arm_a_score_tile_adding_two_channels_swapped_is_caught():
    """The mutation: the tiles add channels k and k + 1 (and k + 2, k + 3) of every 4 in swapped
    order (a different serial dot); the same comparison tells their bytes from (1, 1)'s."""
    src = runtime.kernel_dir().joinpath("mla.cu").read_text()
    swapped = src.replace("channel(q4[a], c)", "channel(q4[a], c ^ 1)")
    swapped = swapped.replace("channel(c4[b], c)", "channel(c4[b], c ^ 1)")
    assert swapped != src
    args = _score_inputs(*SCORE_SHAPES[0])
    base = _scores_of(runtime.module("mla"), (1, 1), *args)
    mutated = runtime.source_module(swapped)
    for tile in SCORE_KERNELS:
        assert _scores_of(mutated, tile, *args).tobytes() != base.tobytes(), tile


# ---- the tile guard: the lists' length read on the device -------------------------------------

def _guarded_runs(mod, lengths, long_list=6, width=12):
    """Rows whose lists hold `lengths` positions (ascending, -1 padded): which of the two guarded
    launches score -> (short tile ran, long tile ran)."""
    q, latent, _, scale = _score_inputs(3, 16, width, 40, t=len(lengths))
    pos = np.full((len(lengths), width), -1, np.int32)
    for r, n in enumerate(lengths):
        pos[r, :n] = np.arange(n)
    ran = lambda tile, guard: bool(np.isfinite(_scores_of(mod, tile, q, latent, cp.asarray(pos), scale, guard)).any())
    return ran((1, 1), -long_list), ran((2, 2), long_list)


@pytest.mark.parametrize("lengths, long", [([6], True), ([5], False), ([6, 9, 12], True), ([7, 5, 9], False),
                                           ([12, 12], True), ([1], False)])
def test_exactly_one_guarded_tile_scores_and_it_is_the_lists_class(lengths, long):
    """A walk launches both tiles guarded by +-LONG_LIST (mla.py score_launches); the long one
    scores only where every row's list holds LONG_LIST positions, the short one only elsewhere."""
    assert _guarded_runs(runtime.module("mla"), lengths) == (not long, long)


def test_red_arm_a_guard_reading_the_slot_before_is_caught():
    """guard_passes reading slot L - 2 calls a list of L - 1 positions long: both tiles, or none,
    would score where the lists cross the length."""
    src = runtime.kernel_dir().joinpath("mla.cu").read_text()
    early = src.replace("positions[(long long)r * W + L - 1] >= 0", "positions[(long long)r * W + L - 2] >= 0")
    assert early != src
    assert _guarded_runs(runtime.source_module(early), [5]) == (False, True)
    assert _guarded_runs(runtime.module("mla"), [5]) == (True, False)  # green


def test_a_walk_launches_one_tile_where_both_classes_take_it_and_both_guarded_where_they_differ():
    from memra.backend.cuda.mla import LONG_LIST, score_launches, score_tile

    assert score_launches(8, 2063, 64) == [(*score_tile(8, 2063, 64, True), 0)]  # the wide tile either way
    assert score_launches(1, 2063, 64) == [(1, 1, -LONG_LIST), (2, 2, LONG_LIST)]
    assert score_launches(1, LONG_LIST - 1, 64) == [(1, 1, 0)]  # too narrow to be long


# ---- the position read from the device (what a captured walk replays) -------------------------

@pytest.mark.parametrize("at, t", [(0, 1), (3, 1), (2, 6), (5, 15), (47, 15), (60, 4)])
def test_kpool_finalize_at_a_device_position_is_kpool_compress_of_the_completed_pools(at, t):
    """Bit for bit the compress kernel on the same pools; pools outside the rows untouched."""
    rng = np.random.default_rng([at, t])
    keys, gates = normal(rng, (PLANE, 8)), normal(rng, (PLANE, 8))
    ape = normal(rng, (POOL, 8), 0.5)
    ops = MlaOps()
    pool_keys = cp.full((PLANE // POOL + 1, 8), 7.0, cp.float32)
    ops.kpool_finalize(cp.asarray(keys), cp.asarray(gates), cp.asarray(ape), pool_keys, position(at), t)
    got = cp.asnumpy(pool_keys)
    first, last = at // POOL, (at + t) // POOL
    done = slice(first * POOL, last * POOL)
    shape = (last - first, POOL, 8)
    want = cp.asnumpy(ops.kpool_compress(cp.asarray(keys[done].reshape(shape)),
                                         cp.asarray(gates[done].reshape(shape)), cp.asarray(ape)))
    assert got[first:last].tobytes() == want.tobytes() and got[first:last].shape == want.shape
    assert (np.delete(got, range(first, last), axis=0) == 7.0).all()


@pytest.mark.parametrize("pos0", [0, 9, 49])
def test_kpool_select_reads_the_same_positions_from_a_host_int_or_a_device_buffer(pos0):
    rows, shared = _select_inputs(np.random.default_rng(pos0), T_MAX, 4, 16, pos0)
    q, w, pool_keys = cp.asarray(rows["q"]), cp.asarray(rows["w"]), cp.asarray(shared["pool_keys"])
    ops = MlaOps()
    from_int = cp.asnumpy(ops.kpool_select(q, w, pool_keys, pos0, POOL, BUDGET, WIDTH, 0.25))
    from_buffer = cp.asnumpy(ops.kpool_select(q, w, pool_keys, position(pos0), POOL, BUDGET, WIDTH, 0.25))
    assert np.array_equal(from_int, from_buffer)
    np.testing.assert_array_equal(from_int, _select_call(REF, rows, shared))
