"""The CUDA backend: the NumpyBackend interface, every op a hand-written .cu kernel.

Op families live in mixins beside this file: backend/cuda/X.py launches kernels_cu/X.cu and
nothing else. This class composes them and owns device memory. Projection matrices keep their stored precision (bf16
stays bf16 and runs on tensor cores against exact bf16 pieces of the activations); everything
else is float32 on the device. Decode and verify walks replay CUDA graphs (graphs.py)
unless the backend is made with graphs=False.
"""

from __future__ import annotations

import numpy as np

import cupy as cp

from memra.backend.cuda.dense import DenseOps
from memra.backend.cuda.draft import DraftOps
from memra.backend.cuda.fp8 import DeviceFp8
from memra.backend.cuda.graphs import WalkGraphs
from memra.backend.cuda.hyper import HyperOps
from memra.backend.cuda.kda import KdaOps
from memra.backend.cuda.mla import MlaOps
from memra.backend.cuda.moe import MoeOps
from memra.backend.cuda.norm import NormOps
from memra.backend.cuda.philox import PhiloxOps
from memra.backend.cuda.prime import is_prime
from memra.backend.cuda.runtime import host_copy_later, position
from memra.backend.cuda.sampling import FilterOps
from memra.backend.cuda.streams import Beside
from memra.backend.fp8 import Fp8Block
from memra.backend.numpy_ref import Inline
from memra.safetensors_io import bf16_to_f32


class CudaBackend(DenseOps, DraftOps, FilterOps, NormOps, HyperOps, KdaOps, MlaOps, MoeOps, PhiloxOps):
    name = "cuda"
    xp = cp
    compiles_on_first_use = True  # runtime.module: NVRTC builds each family on its first launch

    def __init__(self, graphs: bool = True):
        self.graphs = graphs

    def beside(self, fn, t: int):
        """NumpyBackend.beside: fn's launches on a side stream (streams.Beside) for a walk of
        exact-class rows, where both branches are chains of small kernels; in line for a prompt
        (its ops are GEMMs that fill the GPU alone, and cuBLAS calls stay on one stream)."""
        return Inline(fn) if is_prime(t) else Beside(fn)

    def device_name(self) -> str:
        try:
            name = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["name"]
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # a name is a nicety; never fail a finished run over it
            return "cuda"

    def free_bytes(self) -> int:
        """Free memory on this device: the driver's free bytes plus what CuPy's pool holds unused
        (memra.memory plans and checks allocations against it)."""
        free, _total = cp.cuda.runtime.memGetInfo()
        return int(free) + int(cp.get_default_memory_pool().free_bytes())

    def synchronize(self) -> None:
        cp.cuda.Device().synchronize()

    def position(self, pos0: int):
        return position(pos0)

    def walks(self) -> WalkGraphs:
        return WalkGraphs(enabled=self.graphs)

    def asarray(self, a, dtype=np.float32):
        return cp.ascontiguousarray(cp.asarray(a, dtype=dtype))

    def weight(self, a: np.ndarray):
        host = bf16_to_f32(a) if a.dtype == np.uint16 else np.asarray(a, dtype=np.float32)
        return cp.asarray(np.ascontiguousarray(host))

    def matrix(self, a: np.ndarray):
        """bf16 (raw uint16) stays bf16 on the device, an FP8 block stays e4m3 with its scales
        (cuda/fp8.py); anything else becomes float32."""
        if isinstance(a, Fp8Block):
            return DeviceFp8.upload(a)
        if a.dtype == np.uint16:
            return cp.asarray(np.ascontiguousarray(a))
        return self.weight(a)

    def zeros(self, shape, dtype=np.float32):
        return cp.zeros(shape, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return cp.asnumpy(a)

    def to_host_async(self, a):
        """A copy of `a` to pinned host memory, enqueued behind the work so far without waiting
        for it -> a function that waits for the copy and returns it."""
        return host_copy_later(a)

    def contiguous(self, a):
        return cp.ascontiguousarray(a)

    def copy(self, a):
        return a.copy()

    def assign(self, dst, src) -> None:
        """dst[...] = src in place, as one device-to-device memcpy on the current stream (a
        rollback's state restore: no elementwise kernel's host work)."""
        assert dst.shape == src.shape and dst.dtype == src.dtype, f"assign: {src.shape} {src.dtype} into {dst.shape} {dst.dtype}"
        assert dst.flags.c_contiguous and src.flags.c_contiguous, "assign: both sides must be C-contiguous"
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                    cp.cuda.get_current_stream().ptr)

    def concat(self, arrays, axis: int = -1):
        return cp.ascontiguousarray(cp.concatenate(arrays, axis=axis))
