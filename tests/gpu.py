"""The GPU test files' guard: CuPy and a usable CUDA device, or the whole module skips cleanly."""

import pytest


def cupy_or_skip():
    """Return the cupy module, or skip the calling test module (no CuPy, no driver, no device)."""
    cp = pytest.importorskip("cupy")
    try:
        usable = cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver or no device: skipped, not errored
        usable = False
    if not usable:
        pytest.skip("no usable CUDA device", allow_module_level=True)
    return cp
