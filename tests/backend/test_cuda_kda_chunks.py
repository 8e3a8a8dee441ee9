"""A prompt's chunked delta-rule scan on the GPU (backend/cuda/kda_chunks.py -> kernels_cu/
kda_chunks.cu), GPU host only. Prime class: accurate, not row invariant (DESIGN.md section 2).

Gates, max |got - want| / rms(want) <= CHUNK_REL (tests/backend/test_kda_chunks.py) for the
outputs and the final state: the CUDA scan against the numpy row walk at t = 16, 37, 300, 1000
on bench-like heads (dk = dv = 128) and small odd shapes, gates with and without the lower
bound; against the numpy twin (kda_chunks) likewise; spans of a few chunks carry the state
(the scans on a lane of the device's highest priority);
KdaOps.kda_recurrence takes it for a prompt and keeps the row walk for t <= VERIFY_CAP. Red arms
on the device pieces (in-chunk rows dropped from Qm, the chunk decay ignored) break the bound.
Run: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_kda_chunks.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda import kda_chunks  # noqa: E402
from memra.backend.cuda.kda import KdaOps  # noqa: E402
from memra.backend.numpy_ref import NumpyBackend  # noqa: E402
from tests.backend.test_kda_chunks import CHUNK_REL, kda_inputs, rel_error  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")
SHAPES = [(16, 4, 128, 128), (37, 4, 128, 128), (300, 4, 128, 128), (1000, 2, 128, 128),
          (37, 3, 40, 24), (300, 3, 96, 72), (50, 2, 33, 40)]


def _device_run(rows, state0, op=kda_chunks.prime_kda):
    state = cp.asarray(state0)
    out = op(*(cp.asarray(rows[n]) for n in NAMES), state)
    return cp.asnumpy(out), cp.asnumpy(state)


def _gate(got, want, what):
    errors = rel_error(got[0], want[0]), rel_error(got[1], want[1])
    print(f"{what}: outputs {errors[0]:.2e}, state {errors[1]:.2e} of the rms")
    return max(errors)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lb", "softplus"])
@pytest.mark.parametrize("t, hk, dk, dv", SHAPES)
def test_cuda_chunked_scan_tracks_the_row_walk_and_the_twin(t, hk, dk, dv, lower_bound):
    rows, state0 = kda_inputs(t + dk, t, hk, dk, dv, lower_bound)
    be, walk_state, twin_state = NumpyBackend(), state0.copy(), state0.copy()
    walk = be.kda_recurrence(*(rows[n] for n in NAMES), walk_state), walk_state
    twin = be.kda_chunks(*(rows[n] for n in NAMES), twin_state), twin_state
    got = _device_run(rows, state0)
    assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()
    assert _gate(got, walk, "cuda chunks vs numpy walk") <= CHUNK_REL
    assert _gate(got, twin, "cuda chunks vs numpy twin") <= CHUNK_REL


def test_a_span_of_chunks_at_a_time_carries_the_state(monkeypatch):
    """A scratch budget of a few chunks splits the prompt into spans (two in flight: one scanned,
    the next prepped beside it); the state carries over through global memory, exactly: the
    bits of one span."""
    rows, state0 = kda_inputs(5, 300, 2, 128, 128)
    whole = _device_run(rows, state0)
    monkeypatch.setattr(kda_chunks, "SCRATCH_BYTES", 2 * 3 * 4 * 2 * 16 * (3 * 128 + 128 + 17))
    spans = _device_run(rows, state0)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(spans, whole)), "spans of 3 chunks vs one span"


def test_the_scans_lane_outranks_the_other_side_streams():
    """The scans run on the "chunks" lane at the device's highest priority, so their blocks are
    placed before the next span's prep (on the main stream, of the default priority the other
    lanes keep); CUDA: a lower number ranks higher."""
    from memra.backend.cuda import streams

    device = cp.cuda.Device().id
    rank = lambda stream: cp.cuda.runtime.streamGetPriority(stream.ptr)
    assert rank(streams.side_stream(device, "chunks")) < rank(streams.side_stream(device, "beside"))


def test_kda_recurrence_takes_the_chunked_scan_for_a_prompt_only():
    """t > VERIFY_CAP without snapshots: the chunked scan's bytes; t <= VERIFY_CAP (exact class):
    the row walk's bytes (kda_recurrence_k16 launched alone)."""
    from tests.backend.test_cuda_kda import _launch_recurrence

    rows, state0 = kda_inputs(6, 40, 2, 128, 128)
    ops = KdaOps()
    assert _device_run(rows, state0, ops.kda_recurrence)[0].tobytes() == _device_run(rows, state0)[0].tobytes()
    short = {n: a[:15] for n, a in rows.items()}
    walk = _launch_recurrence("kda_recurrence_k16", short, state0, 128)
    got = _device_run(short, state0, ops.kda_recurrence)
    assert got[0].tobytes() == walk[0].tobytes() and got[1].tobytes() == walk[1].tobytes()


def _mutated(mutation):
    """kda_chunks.launch with the prep's pieces broken after it runs: Qm's strictly lower
    triangle dropped (a row no longer sees its chunk's earlier rows), or the chunk's decay
    taken as 1 (the state carried undecayed from chunk to chunk)."""
    real = kda_chunks.launch

    def launch(family, name, grid, block, args, shared_mem=0):
        real(family, name, grid, block, args, shared_mem)
        if name == "kda_chunk_prep":
            qm, decay = args[7], args[10]
            if mutation == "in_chunk_rows_dropped":
                qm *= cp.eye(qm.shape[-1], dtype=cp.float32)
            else:
                decay[...] = 1
    return launch


@pytest.mark.parametrize("mutation", ["in_chunk_rows_dropped", "decay_ignored"])
def test_red_arm_a_broken_chunk_piece_breaks_the_bound(mutation, monkeypatch):
    rows, state0 = kda_inputs(3, 37, 3, 40, 24)
    be, walk_state = NumpyBackend(), state0.copy()
    walk = be.kda_recurrence(*(rows[n] for n in NAMES), walk_state), walk_state
    monkeypatch.setattr(kda_chunks, "launch", _mutated(mutation))
    assert _gate(_device_run(rows, state0), walk, f"{mutation} vs walk") > CHUNK_REL
    monkeypatch.undo()
    assert _gate(_device_run(rows, state0), walk, "real vs walk") <= CHUNK_REL  # the same inputs
