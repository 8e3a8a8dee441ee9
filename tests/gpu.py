"""The GPU test files' guard: CuPy and a usable CUDA device, or the whole module skips cleanly."""

import pytest


def cupy_or_skip():
    """Return the cupy module, or skip the calling test module (no CuPy or cuda-bindings, no driver,
    no device)."""
    cp = pytest.importorskip("cupy")
    pytest.importorskip("cuda.bindings")
    try:
        usable = cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver or no device: skipped, not errored
        usable = False
    if not usable:
        pytest.skip("no usable CUDA device", allow_module_level=True)
    return cp


def stale_position_walks():
    """Red arm of the graph gates: a CUDA walk runner whose replays upload the tokens and arrays
    but keep the position each graph was captured at (a trunk cache's, a drafter's context length)."""
    from memra.backend.cuda.graphs import WalkGraphs

    class KeepsTheCapturedPosition(WalkGraphs):
        def run(self, key, walk, tokens, pos0, *arrays):
            captured = self.graphs.get(key)
            if captured is not None:
                pos0 = int(captured.inputs[0].get())
            return super().run(key, walk, tokens, pos0, *arrays)

    return KeepsTheCapturedPosition()
