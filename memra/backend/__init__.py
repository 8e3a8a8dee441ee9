"""Compute backends: one op set (see numpy_ref.NumpyBackend), two implementations.

`get_backend("numpy")` runs everywhere; `"cuda"` needs CuPy, NVIDIA's cuda-bindings (the launches,
backend/cuda/runtime.py) and a usable GPU; `"auto"` picks cuda when it is usable and numpy otherwise.
"""

from __future__ import annotations

from memra.errors import BackendError, InputError

BACKENDS = ("numpy", "cuda", "auto")


def cuda_available() -> bool:
    try:
        import cupy
        from cuda.bindings import driver  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy or cuda-bindings, no driver, no device: all mean "not usable"
        return False


def get_backend(name: str):
    if name not in BACKENDS:
        raise InputError(f"unknown backend {name!r}: choose one of {list(BACKENDS)}")
    if name == "auto":
        name = "cuda" if cuda_available() else "numpy"
    if name == "numpy":
        from memra.backend.numpy_ref import NumpyBackend

        return NumpyBackend()
    if not cuda_available():
        raise BackendError(
            "backend='cuda' needs CuPy, cuda-bindings and a CUDA GPU, and none is usable here: "
            "install memra[cuda12] or memra[cuda13] on a GPU machine, or use backend='numpy'"
        )
    from memra.backend.cuda import CudaBackend

    return CudaBackend()
