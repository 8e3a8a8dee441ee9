"""Compiling and launching memra's .cu kernels through CuPy RawModule.

One `.cu` file per op family lives in memra/kernels_cu/ (package data, with the shared
`common.cuh`). Each family is compiled once per process by NVRTC, lazily, with the exact-class
flags (C++17, no FMA contraction, never fast-math; CuPy itself adds -ftz=true) and every shared
constant of memra/kernels_cu/constants.py as a -D define.
Wrappers pass every scalar as a numpy scalar of the kernel's type: nothing checks it on launch.

Launches captured into a walk's graph go through the driver's cuLaunchKernelEx (NVIDIA's
cuda.bindings; CuPy's RawKernel takes no launch attributes) with programmatic dependent launch on
sm_90+: a decode step replays hundreds of short kernels, and each may start while its predecessor
drains. Every kernel opens with `after_predecessor()` (common.cuh), which keeps the stream's order
of reads and writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import weakref
from importlib import resources

import numpy as np

import cupy as cp
import cupyx
from cuda.bindings import driver

from memra.kernels_cu import with_header_digest
from memra.kernels_cu.constants import DEFINES, FLAGS
from memra.kernels_cu.constants import MEMRA_BLOCK as BLOCK  # threads per block of most launches

OPTIONS = FLAGS + DEFINES


def kernel_dir():
    return resources.files("memra.kernels_cu")


@functools.cache
def module(family: str) -> "cp.RawModule":
    return source_module(kernel_dir().joinpath(f"{family}.cu").read_text())


def source_module(src: str) -> "cp.RawModule":
    """CUDA source compiled as the kernel families are: the build's flags and defines, with
    kernels_cu on the include path (tests compile mutated families and probes with it), keyed in
    CuPy's kernel cache by the headers too."""
    mod = cp.RawModule(code=with_header_digest(src, kernel_dir()), options=OPTIONS + ("-I" + str(kernel_dir()),))
    mod.compile()
    return mod


@functools.cache
def kernel(family: str, name: str):
    """The launchable kernel, made once: RawModule.get_function builds a new RawKernel on every
    call, a host cost a decode step would otherwise pay once per launch (hundreds of times)."""
    return module(family).get_function(name)


SHARED_BYTES = 48 * 1024  # a launch's dynamic shared memory without opting in to more


def opt_in(k, staged: int) -> None:
    """Lets kernel k launch with `staged` bytes of dynamic shared memory: past SHARED_BYTES it
    opts in, up to what the device allows a block. The limit is only ever raised, so a captured
    launch stays valid whatever another caller's shapes set later."""
    if staged <= SHARED_BYTES or staged <= k.max_dynamic_shared_size_bytes:
        return
    most = cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    assert staged <= most, f"{k.name}: {staged} bytes of shared memory, a block may have {most}"
    k.max_dynamic_shared_size_bytes = staged


def launch(family: str, name: str, grid, block, args, shared_mem: int = 0) -> None:
    launch_kernel(kernel(family, name), grid, block, args, shared_mem, dependent=_dependent)


_dependent = False  # inside dependent_launches()


@contextlib.contextmanager
def dependent_launches():
    """Inside this block launch() asks for programmatic dependent launch: graphs.CapturedWalk
    captures its walk in it, so every replay overlaps each kernel's start with its predecessor's
    end. Outside, launches stay CuPy's own: the driver call through cuda.bindings marshals its
    arguments in Python, about 30 us more host time per launch, which an eager walk would pay at
    every launch and a captured one pays once."""
    global _dependent
    before, _dependent = _dependent, True
    try:
        yield
    finally:
        _dependent = before


def launch_kernel(k: "cp.RawKernel", grid, block, args, shared_mem: int = 0,
                  dependent: bool = False) -> None:
    """Launches k on the current stream, with programmatic dependent launch when `dependent` and
    the device takes it (compute capability 9.0 on)."""
    if not (dependent and _takes_dependent_launch(cp.cuda.runtime.getDevice())):
        k(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)
        return
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = _dim3(grid)
    config.blockDimX, config.blockDimY, config.blockDimZ = _dim3(block)
    config.sharedMemBytes = shared_mem
    config.hStream = driver.CUstream(cp.cuda.get_current_stream().ptr)
    config.attrs = [_DEPENDENT_LAUNCH]
    config.numAttrs = 1
    # k.kernel is the function loaded on the current device (CuPy loads a module per device)
    (err,) = driver.cuLaunchKernelEx(config, driver.CUfunction(k.kernel.ptr), _kernel_params(args), 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"launching {k.name} (grid {tuple(grid)}, block {tuple(block)}): {err.name}")


def _dim3(dims) -> tuple[int, int, int]:
    dims = tuple(int(d) for d in dims)
    assert 1 <= len(dims) <= 3, f"a launch takes 1 to 3 dimensions, got {dims}"
    return dims + (1,) * (3 - len(dims))


def _dependent_launch_attribute():
    a = driver.CUlaunchAttribute()
    a.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    a.value.programmaticStreamSerializationAllowed = 1
    return a


_DEPENDENT_LAUNCH = _dependent_launch_attribute()


@functools.cache
def _takes_dependent_launch(device: int) -> bool:
    return int(cp.cuda.Device(device).compute_capability) >= 90


# the C type of each scalar argument; device arrays pass their data pointer
_SCALAR_TYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
                 np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
                 np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def _kernel_params(args) -> tuple[tuple, tuple]:
    values, types = [], []
    for a in args:
        if isinstance(a, cp.ndarray) or a is None:  # None: a null pointer (an absent input)
            values.append(0 if a is None else a.data.ptr)
            types.append(ctypes.c_void_p)
        else:
            assert isinstance(a, np.generic) and a.dtype in _SCALAR_TYPES, \
                f"kernel scalars are numpy scalars of the kernel's type, got {type(a).__name__}"
            values.append(a.item())
            types.append(_SCALAR_TYPES[a.dtype])
    return tuple(values), tuple(types)


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


def host_copy_later(a):
    """A copy of `a` to pinned host memory, enqueued behind the work so far without waiting for
    it -> a function that waits for the copy alone (work queued after it runs on) and returns it."""
    host = cupyx.empty_pinned(a.shape, a.dtype)
    a.get(out=host, blocking=False)
    copied = cp.cuda.Event(disable_timing=True)
    copied.record()

    def wait() -> np.ndarray:
        copied.synchronize()
        return host
    # never waited for (a session ended by an EOS leaves its step ahead): the buffer goes back
    # to CuPy's pinned pool only once the copy has landed, or a later buffer could take it
    weakref.finalize(wait, _landed, copied, host).atexit = False
    return wait


def _landed(copied, host) -> None:
    copied.synchronize()


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
