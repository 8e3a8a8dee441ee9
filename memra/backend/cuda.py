"""The CUDA backend: the NumpyBackend interface, every op a hand-written .cu kernel.

Op families live in mixins beside this file (one per kernels_cu/*.cu family); this class
composes them and owns device memory. Projection matrices keep their stored precision (bf16
stays bf16 and runs on tensor cores against exact bf16 pieces of the activations); everything
else is float32 on the device. Decode and verify walks replay CUDA graphs (cuda_graphs.py)
unless the backend is made with graphs=False.
"""

from __future__ import annotations

import numpy as np

import cupy as cp

from memra.backend.cuda_dense import MAX_GRID, DenseOps
from memra.backend.cuda_graphs import WalkGraphs
from memra.backend.cuda_recurrent import RecurrentOps
from memra.backend.cuda_runtime import BLOCK, check, i32, launch, position
from memra.backend.cuda_sampling import SamplingOps
from memra.backend.cuda_sparse import SparseOps
from memra.safetensors_io import bf16_to_f32


class CudaBackend(DenseOps, RecurrentOps, SparseOps, SamplingOps):
    name = "cuda"

    def __init__(self, graphs: bool = True):
        self.graphs = graphs

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
        """bf16 (raw uint16) stays bf16 on the device; anything else becomes float32."""
        if a.dtype == np.uint16:
            return cp.asarray(np.ascontiguousarray(a))
        return self.weight(a)

    def zeros(self, shape, dtype=np.float32):
        return cp.zeros(shape, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return cp.asnumpy(a)

    def contiguous(self, a):
        return cp.ascontiguousarray(a)

    def copy(self, a):
        return a.copy()

    def concat(self, arrays, axis: int = -1):
        return cp.ascontiguousarray(cp.concatenate(arrays, axis=axis))

    def write_rows(self, dst, src, at):
        """dst[at:at + t] = src [t, W] in place (a state plane's next rows); `at` a host int or
        the walk's device position (cuda_runtime.position)."""
        check(dst, cp.float32, "dst")
        check(src, cp.float32, "src")
        assert dst.ndim == 2 and src.ndim == 2 and src.shape[1] == dst.shape[1], (
            f"write_rows: src {src.shape} into dst {dst.shape}")
        if not isinstance(at, cp.ndarray):
            assert at + src.shape[0] <= dst.shape[0], f"write_rows: rows {at}+{src.shape[0]} past {dst.shape[0]}"
        if src.size:
            grid = min((src.size + BLOCK - 1) // BLOCK, MAX_GRID)
            launch("dense", "write_rows", (grid,), (BLOCK,),
                   (src, dst, np.int64(src.size), position(at), i32(dst.shape[1])))
