"""The per-row snapshots a verify walk's KDA ops write for its rollback (`rows`): on both
backends, rows[r] of a t-row short_conv / kda_recurrence is, bit for bit, the ring / state that
the first r rows alone leave (rows[0]: the one the call found, a rewind's; rows past t - 1
untouched), written through a strided view (one layer's slot of a part's [rows, layers, ...]
buffer). Red arm: a snapshot taken after the row's update instead of before it is caught."""

from __future__ import annotations

import numpy as np
import pytest

from memra.backend.numpy_ref import NumpyBackend
from tests.backend.inputs import normal, uniform

HK, C, K, T = 2, 48, 4, 6
# (dk, dv); dv = 20 or 12: a block of 8 value columns only half full; dk = 256: every slot
SHAPES = [(32, 32), (40, 20), (256, 12)]


def _backends():
    yield pytest.param("numpy", id="numpy")
    yield pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)


def _backend(name):
    if name == "numpy":
        return NumpyBackend(), np.asarray, np.asarray
    from tests.gpu import cupy_or_skip
    cp = cupy_or_skip()
    from memra.backend.cuda.backend import CudaBackend
    return CudaBackend(), cp.asarray, cp.asnumpy


def _inputs(t, dk=32, dv=32):
    rng = np.random.default_rng(3)
    q, k = normal(rng, (t, HK, dk), 0.2), normal(rng, (t, HK, dk), 0.2)
    return {"q": q, "k": k, "v": normal(rng, (t, HK, dv)), "g": uniform(rng, (t, HK, dk), -0.5, -0.01),
            "beta": uniform(rng, (t, HK), 0.1, 0.9), "state": normal(rng, (HK, dk, dv), 0.1),
            "x": normal(rng, (t, C)), "ring": normal(rng, (K - 1, C)), "w": normal(rng, (C, K), 0.5)}


def _recurrence(be, dev, a, rows_of=None, t=T):
    state = dev(a["state"].copy())
    rows = None if rows_of is None else rows_of(state.shape)
    be.kda_recurrence(*(dev(a[n][:t]) for n in ("q", "k", "v", "g", "beta")), state, rows)
    return state, rows


def _conv(be, dev, a, rows_of=None, t=T):
    ring = dev(a["ring"].copy())
    rows = None if rows_of is None else rows_of(ring.shape)
    be.short_conv(dev(a["x"][:t]), ring, dev(a["w"]), rows)
    return ring, rows


@pytest.mark.parametrize("op,shape", [(_recurrence, s) for s in SHAPES] + [(_conv, SHAPES[0])],
                         ids=[f"kda_recurrence_dk{dk}_dv{dv}" for dk, dv in SHAPES] + ["short_conv"])
@pytest.mark.parametrize("backend", _backends())
def test_row_r_is_what_the_first_r_rows_leave(backend, op, shape):
    be, dev, host = _backend(backend)
    a = _inputs(T, *shape)
    sentinel = np.float32(-7.0)

    def rows_of(shape):  # slot 1 of a [T + 1, 2, ...] buffer: a strided view, one spare row
        return dev(np.full((T + 1, 2, *shape), sentinel, np.float32))[:, 1]

    final, rows = op(be, dev, a, rows_of)
    rows = host(rows)
    for r in range(T):
        alone, _ = op(be, dev, a, t=r)
        assert np.array_equal(rows[r], host(alone)), f"row {r}"
    assert np.all(rows[T:] == sentinel)  # the ring / state after the last row is the live one
    assert np.array_equal(host(final), host(op(be, dev, a)[0]))  # snapshots change nothing else


class _LateSnapshots(NumpyBackend):
    """The mutation: each snapshot taken after its row's update (the next row's state)."""

    def kda_recurrence(self, q, k, v, g, beta, state, rows=None):
        out = np.empty((q.shape[0], *v.shape[1:]), np.float32)
        for r in range(q.shape[0]):
            out[r] = super().kda_recurrence(q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1], beta[r:r + 1], state)[0]
            if rows is not None:
                rows[r] = state
        return out


def test_red_arm_a_snapshot_taken_after_its_row_is_caught():
    a = _inputs(T)
    rows = np.zeros((T, *a["state"].shape), np.float32)
    state = a["state"].copy()
    _LateSnapshots().kda_recurrence(*(a[n] for n in ("q", "k", "v", "g", "beta")), state, rows)
    alone, _ = _recurrence(NumpyBackend(), np.asarray, a, t=1)
    assert not np.array_equal(rows[1], alone)
