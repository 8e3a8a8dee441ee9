"""What a verify walk's KDA ops leave for its rollback, on both backends. short_conv's `rows`:
rows[r] of a t-row call is, bit for bit, the ring that the first r rows alone leave (rows[0]: the
one the call found; rows past t - 1 untouched), written through a strided view (one layer's slot
of a part's [rows, layers, ...] buffer). kda_recurrence's `marks` and `record`: marks[m] is the
state the first m KDA_MARK_ROWS rows alone leave (marks[0]: the one found), and kda_replay to r
recorded rows (from the last mark at or before r), every layer of a part in one call, leaves each
state bit for bit as the first r rows alone do. Red arms: a ring snapshot taken after its row's
update, a replay one row short, and a mark taken one row late, are caught."""

from __future__ import annotations

import numpy as np
import pytest

from memra.backend.numpy_kda import kda_mark_count, kda_record_width
from memra.backend.numpy_ref import NumpyBackend
from memra.kernels_cu.constants import KDA_MARK_ROWS
from memra.limits import VERIFY_CAP
from tests.backend.inputs import normal, uniform

HK, C, K, T = 2, 48, 4, 6
WALK = VERIFY_CAP  # a recorded walk: past KDA_MARK_ROWS rows, so it keeps several marks (longer is a prompt)
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


def _inputs(t, dk=32, dv=32, seed=3):
    rng = np.random.default_rng(seed)
    q, k = normal(rng, (t, HK, dk), 0.2), normal(rng, (t, HK, dk), 0.2)
    return {"q": q, "k": k, "v": normal(rng, (t, HK, dv)), "g": uniform(rng, (t, HK, dk), -0.5, -0.01),
            "beta": uniform(rng, (t, HK), 0.1, 0.9), "state": normal(rng, (HK, dk, dv), 0.1),
            "x": normal(rng, (t, C)), "ring": normal(rng, (K - 1, C)), "w": normal(rng, (C, K), 0.5)}


def _recurrence(be, dev, a, t=T):
    state = dev(a["state"].copy())
    be.kda_recurrence(*(dev(a[n][:t]) for n in ("q", "k", "v", "g", "beta")), state)
    return state


def _conv(be, dev, a, rows_of=None, t=T):
    ring = dev(a["ring"].copy())
    rows = None if rows_of is None else rows_of(ring.shape)
    be.short_conv(dev(a["x"][:t]), ring, dev(a["w"]), rows)
    return ring, rows


@pytest.mark.parametrize("backend", _backends())
def test_ring_row_r_is_what_the_first_r_rows_leave(backend):
    be, dev, host = _backend(backend)
    a = _inputs(T)
    sentinel = np.float32(-7.0)
    buf = dev(np.full((T + 1, 2, K - 1, C), sentinel, np.float32))[:, 1]  # a strided view, one spare row
    final, rows = _conv(be, dev, a, lambda shape: buf)
    rows = host(rows)
    for r in range(T):
        assert np.array_equal(rows[r], host(_conv(be, dev, a, t=r)[0])), f"row {r}"
    assert np.all(rows[T:] == sentinel)  # the ring after the last row is the live one
    assert np.array_equal(host(final), host(_conv(be, dev, a)[0]))  # snapshots change nothing else


def _recorded_walk(be, dev, layers):
    """Each layer's WALK-row walk recording into slot j of a part's buffers (a spare mark and a
    spare recorded row, filled with a sentinel). Returns (marks, record, states after, outputs)."""
    (dk, dv), n = layers[0]["state"].shape[1:], len(layers)
    marks = dev(np.full((n, kda_mark_count(WALK) + 1, HK, dk, dv), -7.0, np.float32))
    record = dev(np.full((n, WALK + 1, HK, kda_record_width(dk, dv)), -7.0, np.float32))
    states, outs = [], []
    for j, a in enumerate(layers):
        state = dev(a["state"].copy())
        outs.append(be.kda_recurrence(*(dev(a[n]) for n in ("q", "k", "v", "g", "beta")), state, marks[j], record[j]))
        states.append(state)
    return marks, record, states, outs


@pytest.mark.parametrize("dk,dv", SHAPES, ids=[f"dk{dk}_dv{dv}" for dk, dv in SHAPES])
@pytest.mark.parametrize("backend", _backends())
def test_replaying_r_recorded_rows_is_what_the_first_r_rows_leave(backend, dk, dv):
    be, dev, host = _backend(backend)
    layers = [_inputs(WALK, dk, dv, seed) for seed in (3, 4)]
    marks, record, states, outs = _recorded_walk(be, dev, layers)
    for j, a in enumerate(layers):  # recording changes nothing the walk returns or leaves
        plain = dev(a["state"].copy())
        assert np.array_equal(host(outs[j]), host(be.kda_recurrence(*(dev(a[n]) for n in ("q", "k", "v", "g", "beta")), plain)))
        assert np.array_equal(host(states[j]), host(plain))
        for m in range(kda_mark_count(WALK)):
            want = a["state"] if m == 0 else host(_recurrence(be, dev, a, t=m * KDA_MARK_ROWS))
            assert np.array_equal(host(marks[j, m]), want), f"layer {j}, mark {m}"
    assert np.all(host(record)[:, WALK:] == -7.0)  # rows past the walk untouched
    assert np.all(host(marks)[:, kda_mark_count(WALK):] == -7.0)  # and marks past its last
    for r in range(WALK + 1):
        state = dev(np.full(marks[:, 0].shape, 5.0, np.float32))
        be.kda_replay(record, marks, state, r)
        for j, a in enumerate(layers):
            assert np.array_equal(host(state)[j], host(_recurrence(be, dev, a, t=r))), f"layer {j}, {r} rows"


@pytest.mark.parametrize("backend", _backends())
def test_a_walk_keeps_no_mark_it_has_no_rows_after(backend):
    """A mark at the walk's last row is never replayed from (a rollback keeps fewer rows than the
    walk had), so a walk of exactly KDA_MARK_ROWS rows writes mark 0 only."""
    be, dev, host = _backend(backend)
    a = _inputs(KDA_MARK_ROWS)
    marks = dev(np.full((2, HK, 32, 32), -7.0, np.float32))
    record = dev(np.zeros((KDA_MARK_ROWS, HK, kda_record_width(32, 32)), np.float32))
    be.kda_recurrence(*(dev(a[n]) for n in ("q", "k", "v", "g", "beta")), dev(a["state"].copy()), marks, record)
    assert kda_mark_count(KDA_MARK_ROWS) == 1
    assert np.array_equal(host(marks)[0], a["state"]) and np.all(host(marks)[1] == -7.0)


class _ShortReplay(NumpyBackend):
    """The mutation: a replay that walks one recorded row too few."""

    def kda_replay(self, record, marks, state, keep):
        super().kda_replay(record, marks, state, max(keep - 1, 0))


def test_red_arm_a_replay_one_row_short_is_caught():
    layers = [_inputs(WALK)]
    marks, record, _, _ = _recorded_walk(NumpyBackend(), np.asarray, layers)
    state = np.zeros_like(marks[:, 0])
    _ShortReplay().kda_replay(record, marks, state, 3)
    assert not np.array_equal(state[0], _recurrence(NumpyBackend(), np.asarray, layers[0], t=3))


class _LateMarks(NumpyBackend):
    """The mutation: each mark past the first taken one row late (after row m M + 1)."""

    def kda_recurrence(self, q, k, v, g, beta, state, marks=None, record=None):
        if marks is None:
            return super().kda_recurrence(q, k, v, g, beta, state)
        out = super().kda_recurrence(q[:1], k[:1], v[:1], g[:1], beta[:1], state, marks, record[:1])
        record[:q.shape[0]] = np.concatenate((k, g, v, beta[..., None]), axis=2)
        for r in range(1, q.shape[0]):
            out = np.concatenate((out, super().kda_recurrence(q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1],
                                                              beta[r:r + 1], state)))
            if r % KDA_MARK_ROWS == 0 and r + 1 < q.shape[0]:
                marks[r // KDA_MARK_ROWS] = state
        return out


def test_red_arm_a_mark_taken_one_row_late_is_caught():
    layers = [_inputs(WALK)]
    marks, record, _, _ = _recorded_walk(_LateMarks(), np.asarray, layers)
    state = np.zeros_like(marks[:, 0])
    NumpyBackend().kda_replay(record, marks, state, KDA_MARK_ROWS + 2)
    assert not np.array_equal(state[0], _recurrence(NumpyBackend(), np.asarray, layers[0], t=KDA_MARK_ROWS + 2))
    NumpyBackend().kda_replay(record, marks, state, 3)  # rows before the first late mark: still right
    assert np.array_equal(state[0], _recurrence(NumpyBackend(), np.asarray, layers[0], t=3))


class _LateSnapshots(NumpyBackend):
    """The mutation: each ring snapshot taken after its row's update (the next row's ring)."""

    def short_conv(self, x, ring, w, rows=None, groups: int = 1):
        out = np.empty_like(x)
        for r in range(x.shape[0]):
            out[r] = super().short_conv(x[r:r + 1], ring, w)[0]
            if rows is not None:
                rows[r] = ring
        return out


def test_red_arm_a_ring_snapshot_taken_after_its_row_is_caught():
    a = _inputs(T)
    rows = np.zeros((T, K - 1, C), np.float32)
    _LateSnapshots().short_conv(a["x"], a["ring"].copy(), a["w"], rows)
    assert not np.array_equal(rows[1], _conv(NumpyBackend(), np.asarray, a, t=1)[0])
