"""The CUDA backend: the NumpyBackend interface, every op a hand-written .cu kernel.

Op families live in mixins beside this file (one per kernels_cu/*.cu family); this class
composes them and owns device memory. Projection matrices keep their stored precision (bf16
stays bf16 and runs on tensor cores against exact bf16 pieces of the activations); everything
else is float32 on the device.
"""

from __future__ import annotations

import numpy as np

import cupy as cp

from memra.backend.cuda_dense import DenseOps
from memra.backend.cuda_recurrent import RecurrentOps
from memra.backend.cuda_sampling import SamplingOps
from memra.backend.cuda_sparse import SparseOps
from memra.safetensors_io import bf16_to_f32


class CudaBackend(DenseOps, RecurrentOps, SparseOps, SamplingOps):
    name = "cuda"

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

    def concat(self, arrays, axis: int = -1):
        return cp.ascontiguousarray(cp.concatenate(arrays, axis=axis))
