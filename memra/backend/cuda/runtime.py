"""Compiling and launching memra's .cu kernels through CuPy RawModule.

One `.cu` file per op family lives in memra/kernels_cu/ (package data, with the shared
`common.cuh`). Each family is compiled once per process by NVRTC, lazily, with the exact-class
flags (C++17, no FMA contraction, never fast-math; CuPy itself adds -ftz=true) and every shared
constant of memra/kernels_cu/constants.py as a -D define.
Wrappers pass every scalar as a numpy scalar of the kernel's type: CuPy checks nothing.
"""

from __future__ import annotations

import functools
from importlib import resources

import numpy as np

import cupy as cp

from memra.kernels_cu.constants import DEFINES, FLAGS
from memra.kernels_cu.constants import MEMRA_BLOCK as BLOCK  # threads per block of most launches

OPTIONS = FLAGS + DEFINES


def kernel_dir():
    return resources.files("memra.kernels_cu")


@functools.cache
def module(family: str) -> "cp.RawModule":
    src = kernel_dir().joinpath(f"{family}.cu").read_text()
    include = "-I" + str(kernel_dir())
    mod = cp.RawModule(code=src, options=OPTIONS + (include,))
    mod.compile()
    return mod


@functools.cache
def kernel(family: str, name: str):
    """The launchable kernel, made once: RawModule.get_function builds a new RawKernel on every
    call, a host cost a decode step would otherwise pay once per launch (hundreds of times)."""
    return module(family).get_function(name)


def launch(family: str, name: str, grid, block, args, shared_mem: int = 0) -> None:
    kernel(family, name)(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)


def i32(v) -> np.int32:
    return np.int32(v)


def f32(v) -> np.float32:
    return np.float32(v)


def position(at):
    """A walk's first position as the int32[1] device buffer the position-reading kernels take.
    A host int is uploaded; a captured walk passes its own static buffer, refreshed before every
    replay, so the graph follows the cache as it grows."""
    if isinstance(at, cp.ndarray):
        check(at, cp.int32, "position")
        assert at.shape == (1,), f"position: expected one int32, got shape {at.shape}"
        return at
    assert int(at) >= 0, f"position {at} must be >= 0"
    return cp.asarray(np.array([at], np.int32))


def check(a, dtype=cp.float32, name: str = "array"):
    """Kernel arguments must be C-contiguous device arrays of the kernel's dtype."""
    assert isinstance(a, cp.ndarray), f"{name}: expected a cupy array, got {type(a).__name__}"
    assert a.dtype == dtype, f"{name}: expected {np.dtype(dtype)}, got {a.dtype}"
    assert a.flags.c_contiguous, f"{name}: must be C-contiguous"
    return a


# ---- argument helpers shared by the op-family wrappers -------------------------------------

MAX_GRID = 65535 * 32  # elementwise launches: grid-stride loops cover the rest
INT32_MAX = 2**31 - 1


def weight_kind(w, name: str) -> str:
    """Weights stay in their stored precision: float32, or bf16 as raw uint16 bits; kernel names
    take the returned suffix."""
    if isinstance(w, cp.ndarray) and w.dtype == cp.uint16:
        check(w, cp.uint16, name)
        return "bf16"
    check(w, cp.float32, name)
    return "f32"


def rows_of(x, name: str) -> tuple[int, int]:
    """(rows, n) for a reduction over the last axis of x, any leading shape."""
    check(x, cp.float32, name)
    assert x.ndim >= 1 and x.shape[-1] > 0, f"{name}: needs a non-empty last axis, got {x.shape}"
    n = x.shape[-1]
    assert x.size // n <= INT32_MAX, f"{name}: too many rows for one launch"
    return x.size // n, n


def vector(w, n: int, name: str):
    check(w, cp.float32, name)
    assert w.shape == (n,), f"{name}: expected shape ({n},), got {w.shape}"
    return w


def device_input(a, name: str):
    """A read-only float32 input. Strided views (v is sliced out of the conv output) are copied
    to C order, which changes no value; host arrays and other dtypes are refused."""
    assert isinstance(a, cp.ndarray), f"{name}: expected a cupy array, got {type(a).__name__}"
    return check(cp.ascontiguousarray(a), cp.float32, name)


def blocks_of(n: int, per: int = BLOCK) -> int:
    return (n + per - 1) // per


def columns_grid(rows: int, d: int) -> tuple[int, int]:
    """A thread per column of d, rows over grid y (the kernel loops past 65535): no 64-bit
    division per element."""
    return blocks_of(d), min(rows, 65535)


def grid_1d(total: int) -> tuple[int]:
    return (blocks_of(total),)
