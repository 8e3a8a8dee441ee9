"""Programmatic dependent launch on the GPU (backend/cuda/runtime.launch_kernel), which launch()
asks for inside runtime.dependent_launches(): while graphs.CapturedWalk captures a walk.

* The attribute is live in a graph: a successor launched after a predecessor that lets it start
  early, and that does not wait, reads the predecessor's flag before it is written (red arm:
  without this, the guard of tests/backend/test_kernel_entry.py would guard nothing).
* The guard holds: the same successor opening with common.cuh's after_predecessor() reads the
  written flag.
* Plain launches, eager or captured, keep the stream's order without the guard.
* launch() asks for it inside dependent_launches() only, and a captured walk is inside.
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_dependent_launch.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda import graphs, runtime  # noqa: E402
from memra.backend.cuda.runtime import launch_kernel, source_module  # noqa: E402

SOURCE = r'''
#include "common.cuh"
// Lets its successor launch at once, then spins about `spin` cycles before it writes the flag.
extern "C" __global__ void slow_writer(float* flag, long long spin) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {}
    flag[0] = 1.0f;
}
extern "C" __global__ void reads_at_once(const float* flag, float* out) { out[0] = flag[0]; }
extern "C" __global__ void reads_after_wait(const float* flag, float* out) {
    after_predecessor();
    out[0] = flag[0];
}
'''
SPIN = np.int64(20_000_000)  # ~10 ms at the H200's clock: the successor is resident long before


@pytest.fixture(scope="module")
def module():
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    mod = source_module(SOURCE)
    # each function's first launch loads it (CUDA's lazy loading), which waits for the device;
    # done here, so the launches under test are the decode step's kind
    flag, out = cp.zeros(1, cp.float32), cp.zeros(1, cp.float32)
    launch_kernel(mod.get_function("slow_writer"), (1,), (1,), (flag, np.int64(0)))
    for reader in ("reads_at_once", "reads_after_wait"):
        launch_kernel(mod.get_function(reader), (1,), (1,), (flag, out))  # plain: the default
    cp.cuda.Device().synchronize()
    return mod


def flag_read_by(module, reader: str, captured: bool, dependent: bool = True) -> float:
    """The flag as `reader` saw it, launched after slow_writer on a stream or in a graph."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        flag, out = cp.zeros(1, cp.float32), cp.full(1, -1.0, cp.float32)
        stream.synchronize()
        if captured:
            stream.begin_capture()
        launch_kernel(module.get_function("slow_writer"), (1,), (1,), (flag, SPIN), dependent=dependent)
        launch_kernel(module.get_function(reader), (1,), (1,), (flag, out), dependent=dependent)
        if captured:
            stream.end_capture().launch(stream)
    stream.synchronize()
    return float(out.get()[0])


def test_red_arm_a_captured_successor_that_does_not_wait_runs_beside_its_predecessor(module):
    assert flag_read_by(module, "reads_at_once", captured=True) == 0.0


def test_a_captured_successor_that_waits_sees_its_predecessors_writes(module):
    assert flag_read_by(module, "reads_after_wait", captured=True) == 1.0


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_plain_launches_keep_the_stream_order(module, captured):
    assert flag_read_by(module, "reads_at_once", captured, dependent=False) == 1.0


def launches_asked_dependent(monkeypatch, run) -> list[bool]:
    """What each launch() inside run() asked launch_kernel for, the launches themselves skipped."""
    asked = []
    monkeypatch.setattr(runtime, "kernel", lambda family, name: None)
    monkeypatch.setattr(runtime, "launch_kernel", lambda k, grid, block, args, shared_mem, dependent:
                        asked.append(dependent))
    run()
    return asked


def test_launch_asks_for_dependent_launch_only_inside_dependent_launches(monkeypatch):
    def run():
        runtime.launch("norm", "softmax_rows", (1,), (1,), ())
        with runtime.dependent_launches():
            runtime.launch("norm", "softmax_rows", (1,), (1,), ())
        runtime.launch("norm", "softmax_rows", (1,), (1,), ())

    assert launches_asked_dependent(monkeypatch, run) == [False, True, False]


def test_a_captured_walk_launches_dependent(monkeypatch):
    def walk(tokens, position):
        runtime.launch("norm", "softmax_rows", (1,), (1,), ())
        return (tokens + position,)  # the graph holds one node, so the capture is not empty

    assert launches_asked_dependent(monkeypatch, lambda: graphs.CapturedWalk(walk, [5], 3, ())) == [True]
