"""CudaBackend.beside on the GPU: work on a side stream, joined back at the end of its block
(backend/cuda/streams.py), as the KDA mixer uses it.

* The work runs on the side stream, and its result is the same bits as run in line; a prompt's
  rows (the prime class) run in line.
* Red arm: the join is what orders it. With the side stream held busy by a spinning kernel, a
  result read without the join is stale; with the join it is the result.
* Work that raises is joined before the error goes on: a capture still ends.
* Split-K tile counters: a captured walk's side stream counts on its own half of the graph's
  counters, so its projections never share a counter with the main stream's.
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_beside.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda import dense, streams  # noqa: E402
from memra.backend.cuda.backend import CudaBackend  # noqa: E402
from memra.backend.cuda.graphs import capture  # noqa: E402
from memra.backend.numpy_ref import Inline  # noqa: E402
from tests.backend.inputs import normal, uniform  # noqa: E402
from tests.backend.test_cuda_hc_site import SPIN  # noqa: E402

EPS = 1e-5


@pytest.fixture(scope="module")
def be():
    return CudaBackend()


def bits(a) -> np.ndarray:
    return cp.asnumpy(a).view(np.uint32)


def test_beside_runs_on_the_side_stream_with_the_same_bits(be):
    rng = np.random.default_rng(1)
    x, w = cp.asarray(normal(rng, (3, 4096))), cp.asarray(uniform(rng, (4096,), 0.5, 1.5))
    main, seen = cp.cuda.get_current_stream().ptr, []

    def work():
        seen.append(cp.cuda.get_current_stream().ptr)
        return be.rmsnorm(x, w, EPS)

    with be.beside(work, 3) as side:
        other = be.rmsnorm(x * np.float32(2), w, EPS)
    assert seen == [streams.side_stream(cp.cuda.Device().id, "beside").ptr] and seen[0] != main
    assert cp.cuda.get_current_stream().ptr == main
    assert np.array_equal(bits(side.result), bits(be.rmsnorm(x, w, EPS)))
    assert np.array_equal(bits(other), bits(be.rmsnorm(x * np.float32(2), w, EPS)))


def test_a_prompts_rows_run_in_line(be):
    assert isinstance(be.beside(lambda: 1, 4096), Inline)


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "red_arm_unjoined"])
def test_the_join_orders_the_side_streams_work(be, monkeypatch, joined):
    rng = np.random.default_rng(2)
    w = cp.asarray(uniform(rng, (4096,), 0.5, 1.5))
    x, earlier = cp.asarray(normal(rng, (1, 4096))), cp.asarray(normal(rng, (1, 4096)))
    want = bits(be.rmsnorm(x, w, EPS))
    with be.beside(lambda: be.rmsnorm(earlier, w, EPS), 1) as side:
        pass
    del side  # its result goes back to the side stream's pool
    cp.cuda.Device().synchronize()
    if not joined:
        monkeypatch.setattr(streams.Beside, "_join", lambda self: setattr(self, "_fn", None))
    with streams.side_stream(cp.cuda.Device().id, "beside"):
        SPIN((1,), (1,), (np.int64(20_000_000),))  # ~10 ms: the work runs long after the read
    with be.beside(lambda: be.rmsnorm(x, w, EPS), 1) as side:
        pass
    got = bits(side.result)  # copied on the main stream
    cp.cuda.Device().synchronize()
    assert np.array_equal(got, want) == joined


def test_a_captured_side_stream_counts_on_its_own_half():
    counters = dense.split_k_counters()
    with dense.graph_counters(counters):
        main = dense._counters()
        with streams.side_stream(cp.cuda.Device().id, "beside"):
            side = dense._counters()
    assert main.size == side.size == dense.COUNTERS
    assert main.data.ptr == counters.data.ptr and side.data.ptr == counters.data.ptr + 4 * dense.COUNTERS


def test_work_that_raises_is_joined_so_a_capture_still_ends(be):
    rng = np.random.default_rng(3)
    x, w = cp.asarray(normal(rng, (1, 256))), cp.asarray(uniform(rng, (256,), 0.5, 1.5))

    def walk():
        with pytest.raises(ZeroDivisionError):
            be.beside(lambda: (be.rmsnorm(x, w, EPS), 1 // 0), 1)  # a launch on the side, then the error
        return be.rmsnorm(x, w, EPS)

    out, graph, _pool = capture(walk)  # an unjoined side stream would fail end_capture
    graph.launch()
    assert np.array_equal(bits(out), bits(be.rmsnorm(x, w, EPS)))
