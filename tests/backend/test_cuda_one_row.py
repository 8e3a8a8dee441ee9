"""The one-row bf16 tile (exact_mma.cuh's mma_tile with ONE): a decode step's projections
(dense.cu's linear_group_bf16_one) and every expert pass of one row split their activation row
once a warp instead of once a lane group, and load their weights unchecked. Its gate: the same
bits as the checked tile, which the same row takes when its weights sit one element off 16-byte
alignment; red arms: a piece staged into another piece's plane, and lanes reading a neighbour's
words, each caught while the real tile passes. (The row-invariance gates of test_cuda_dense and
test_cuda_moe see the same thing from the other side: t = 1 runs this tile, t > 1 the checked one.)
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_one_row.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from benchmarks.common import counted_launches  # noqa: E402
from memra.backend.cuda import dense, moe  # noqa: E402
from memra.backend.cuda.dense import DenseOps  # noqa: E402
from memra.backend.cuda.moe import MoeOps  # noqa: E402
from memra.safetensors_io import f32_to_bf16  # noqa: E402
from tests.backend.harness import mutated_launch  # noqa: E402
from tests.backend.inputs import normal  # noqa: E402

D, I, E, K = 384, 64, 6, 2  # in-features whole 32-wide k-blocks, outputs whole 16-row blocks


class Ops(DenseOps, MoeOps):
    pass


def _bf16(rng, shape):
    return cp.asarray(f32_to_bf16(normal(rng, shape, shape[-1] ** -0.5)))


def _off_by_one(w):
    """w's bits one element off 16-byte alignment: a tile reading them takes its checked loads."""
    out = cp.empty(w.size + 1, cp.uint16)[1:].reshape(w.shape)
    out[...] = w
    return out


def _runs(seed: int):
    """(name, op(weights), weights): a projection of 64 outputs, one of 45 (a ragged tile, which
    stays checked), and the experts of one row routed to K of E."""
    rng, ops = np.random.default_rng(seed), Ops()
    x = cp.asarray(normal(rng, (1, D)))
    idx = cp.asarray(np.sort(rng.choice(E, K, replace=False))[None].astype(np.int64))
    wts = cp.full((1, K), 1.0 / K, cp.float32)
    return [
        ("dense", lambda w: ops.linear(x, w[0]), [_bf16(rng, (64, D))]),
        ("dense", lambda w: ops.linear(x, w[0]), [_bf16(rng, (45, D))]),
        ("moe", lambda w: ops.moe_experts(x, idx, wts, *w, 10.0),
         [_bf16(rng, (E, I, D)), _bf16(rng, (E, I, D)), _bf16(rng, (E, D, I))]),
    ]


def _one_row_equals_checked(seed: int, launch=None) -> bool:
    same = True
    for family, op, weights in _runs(seed):
        with pytest.MonkeyPatch.context() as m:
            if launch is not None:
                m.setattr(dense if family == "dense" else moe, "launch", launch(family))
            one, checked = op(weights), op([_off_by_one(w) for w in weights])
        same &= bool(cp.array_equal(one.view(cp.uint32), checked.view(cp.uint32)))
    return same


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_one_row_tile_gives_the_checked_tiles_bits(seed):
    assert _one_row_equals_checked(seed)


def test_a_decode_row_runs_the_one_row_kernel(monkeypatch):
    monkeypatch.setattr(dense, "_multiprocessors", lambda device: 132)  # the H200's
    assert dense._group_kernel("bf16", 1, False, 128) == "linear_group_bf16_one"
    assert dense._group_kernel("bf16", 2, True, 128) == "linear_group_bf16_n1"
    assert dense._group_kernel("fp8", 1, True, 128) == "linear_group_fp8_one"  # whole tiles only
    assert dense._group_kernel("fp8", 1, False, 128) == "linear_group_fp8_n1"
    assert dense._group_kernel("fp8", 2, True, 128) == "linear_group_fp8_n1"
    # four blocks an SM where the last round is fuller: 512 blocks one round at four (1.3 at three)
    for blocks, kernel in ((512, "one4"), (1024, "one4"), (768, "one"), (778, "one"), (4840, "one"), (256, "one")):
        assert dense._group_kernel("bf16", 1, False, blocks) == f"linear_group_bf16_{kernel}", blocks
    assert dense._group_kernel("bf16", 8, False, 512) == "linear_group_bf16_n1"
    assert dense._group_kernel("fp8", 1, True, 512) == "linear_group_fp8_one"  # FP8 keeps three an SM


@pytest.mark.parametrize("seed", [0, 1])
def test_the_four_blocks_an_sm_kernel_gives_the_three_blocks_bits(monkeypatch, seed):
    """linear_group_bf16_one4 against linear_group_bf16_one on one group (a member split into
    K slices, one not): the same bits, each kernel seen to run (else the gate compares one with itself)."""
    rng, ops = np.random.default_rng(seed), Ops()
    ws = [_bf16(rng, (64, 4096)), _bf16(rng, (45, 4096)), _bf16(rng, (256 * 32, 4096))]
    x = cp.asarray(normal(rng, (1, 4096)))
    outs = {}
    for suffix in ("", "4"):
        monkeypatch.setattr(dense, "_one_row_kernel", lambda blocks: f"linear_group_bf16_one{suffix}")
        with counted_launches() as launches:
            outs[suffix] = ops.linears(x, ws)
        assert dict(launches) == {f"dense.linear_group_bf16_one{suffix}": 1}
    for a, b in zip(outs[""], outs["4"]):
        assert cp.array_equal(a.view(cp.uint32), b.view(cp.uint32))


@pytest.mark.parametrize("exact, broken", [
    ("stage[1][lane] = mid >> 16;", "stage[1][lane] = lo >> 16;"),          # a piece in another's plane
    ("&stage[piece][8 * lane]", "&stage[piece][8 * (lane ^ 1)]"),          # a neighbour's words
], ids=["piece_plane", "neighbour_words"])
def test_red_arm_a_broken_one_row_tile_is_caught(monkeypatch, tmp_path, exact, broken):
    mutants = {}
    for family in ("dense", "moe"):
        (tmp_path / family).mkdir()
        mutants[family] = mutated_launch(monkeypatch, tmp_path / family, "exact_mma.cuh", exact, broken, family)
    assert not _one_row_equals_checked(0, launch=mutants.get)
    assert _one_row_equals_checked(0)  # green on the very same inputs
