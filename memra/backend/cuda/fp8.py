"""FP8 matrices on the device: e4m3 bytes and their float32 block scales, one object.

`CudaBackend.matrix(Fp8Block)` returns a `DeviceFp8`; `linear` (dense.py -> linear_group_fp8_*) and
`moe_experts` (moe.py -> moe_*_fp8_*) take it where they take a bf16 matrix, and read one byte
per weight (kernels_cu/exact_mma_fp8.cuh). It answers `shape`, `dtype` and `nbytes` like an array,
so the benchmarks' byte counts see data plus scales.

    w = DeviceFp8.upload(block)        # block: memra.backend.fp8.Fp8Block from the loader
    y = be.linear(x, w)
"""

from __future__ import annotations

import numpy as np

import cupy as cp

from memra.backend.cuda.runtime import check
from memra.backend.fp8 import Fp8Block, Fp8Shaped, scale_grid


class DeviceFp8(Fp8Shaped):
    dtype = np.dtype(np.uint8)  # the weight bytes; the scales ride along in nbytes

    def __init__(self, data, scale_inv):
        check(data, cp.uint8, "fp8 data")
        check(scale_inv, cp.float32, "fp8 scale_inv")
        assert scale_inv.shape == scale_grid(data.shape), (data.shape, scale_inv.shape)
        self.data, self.scale_inv = data, scale_inv

    @classmethod
    def upload(cls, block: Fp8Block) -> "DeviceFp8":
        return cls(cp.asarray(np.ascontiguousarray(block.data)), cp.asarray(np.ascontiguousarray(block.scale_inv)))
