"""The dense family of the CUDA backend (kernels_cu/dense.cu): embedding, projections,
elementwise activations and arithmetic (scale, add), and the state planes' row writes.

`DenseOps` is one of the mixins `CudaBackend` composes (backend/cuda/backend.py); it needs nothing
from the others, so tests use it alone (`ops = DenseOps()`). Every method has the signature and
meaning of its twin in `NumpyBackend` (numpy_ref.py) and takes and returns cupy arrays.

All ops are exact class (DESIGN.md section 2): each output's reduction order is independent of
the row count, so row r of a t-row call is bit-identical to the row alone. Projection weights
may be float32 (CUDA cores) or raw bf16 bits (uint16: tensor cores on exact bf16 pieces of the
activations, kernels_cu/exact_mma.cuh) or FP8; each weight is read once per call for all rows (up
to 16). The bf16 or FP8 weights that share an input run as one launch (a projection group; a lone
projection is a group of one), each member with the tiles it would have alone: a member whose
outputs fill few blocks splits its in-features into fixed slices (`split_k`, by shape only) that
the launch itself adds in order.

    ops = DenseOps()
    y = ops.linear(cp.asarray(x, cp.float32), w_bf16)   # x [t, in], w [out, in] -> [t, out]
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import numpy as np

import cupy as cp

from memra.backend.cuda.fp8 import DeviceFp8
from memra.backend.cuda.prime import is_prime, pieces, prime_head_linear, prime_linear
from memra.backend.cuda.runtime import BLOCK, MAX_GRID, check, f32, i32, launch, position, weight_kind
from memra.backend.cuda.streams import on_side
from memra.errors import InputError
from memra.kernels_cu.constants import BF16_OUTS, FP8_BLOCK, OUTS_PER_WARP, SPLIT_KC, WARPS_PER_BLOCK
from memra.limits import VERIFY_CAP

ROW_TEMPLATES = sorted(OUTS_PER_WARP)  # the float32 projection kernels linear_f32_t<T>
SPLIT_BELOW_BLOCKS = 256  # split-K is taken when the outputs alone make fewer blocks than this
ONE4_GAIN = 0.05  # how much fuller a one-row launch's last round must be at four blocks an SM (_one_row_kernel)


def projection(kind: str, t: int, n_out: int) -> tuple[str, int]:
    """(kernel name suffix, blocks along the outputs) for a t-row projection. float32 weights:
    row template T, the smallest of 1, 2, 4, 8, 16 covering min(t, 16); bf16 weights: n1 (8 rows
    per pass) for t <= 8, else n2. A row's bits never depend on the pick, only the registers."""
    if kind == "bf16":
        return f"bf16_n{1 if t <= 8 else 2}", (n_out + BF16_OUTS - 1) // BF16_OUTS
    T = next(T for T in ROW_TEMPLATES if T >= min(t, ROW_TEMPLATES[-1]))
    per_block = WARPS_PER_BLOCK * OUTS_PER_WARP[T]
    return f"f32_t{T}", (n_out + per_block - 1) // per_block


def split_k(t: int, n_in: int, n_out: int) -> int:
    """Split-K slices of SPLIT_KC in-features for a bf16 projection (1: none). Taken for exact-class
    row counts when the outputs alone make few blocks and the in-features are long; it depends
    on the shape only, so every row count 1..15 sums each output alike."""
    blocks = (n_out + BF16_OUTS - 1) // BF16_OUTS
    if t > VERIFY_CAP or blocks >= SPLIT_BELOW_BLOCKS or n_in < 2 * SPLIT_KC:
        return 1
    return (n_in + SPLIT_KC - 1) // SPLIT_KC


def _elementwise(name: str, inputs: tuple, out, scalars: tuple = ()) -> None:
    """Kernel args (inputs..., out, n, scalars...) over out.size floats."""
    n = out.size
    if n:
        grid = min((n + BLOCK - 1) // BLOCK, MAX_GRID)
        launch("dense", name, (grid,), (BLOCK,), (*inputs, out, np.int64(n), *scalars))


# dense.cu's GroupField order: a projection group's member table has these int64 fields per weight
GROUP_FIELDS = ("w", "scale", "n_out", "splits", "first", "y", "part", "counter")
COUNTERS = 1 << 16  # split-K tiles one group launch may count (the size of a counter buffer)


class _Group:
    """A projection group's launch plan, independent of t: the member table on the device, the
    blocks, and the outputs and split-K partial outputs per row."""

    def __init__(self, members: tuple):
        rows, blocks, outs, parts, tiles_split = [], 0, 0, 0, 0
        for w, scale, n_out, n_in in members:  # exact-class rows only: splits by the shape alone
            splits, tiles = split_k(1, n_in, n_out), (n_out + BF16_OUTS - 1) // BF16_OUTS
            rows.append((w, scale, n_out, splits, blocks, outs, parts, tiles_split))
            blocks, outs = blocks + tiles * splits, outs + n_out
            if splits > 1:
                parts, tiles_split = parts + splits * n_out, tiles_split + tiles
        assert tiles_split <= COUNTERS, f"a projection group of {tiles_split} split tiles (at most {COUNTERS})"
        self.table = cp.asarray(np.array(rows, np.int64).reshape(len(members), len(GROUP_FIELDS)))
        self.n_outs = tuple(m[2] for m in members)
        self.blocks, self.outs, self.parts = blocks, outs, parts


@functools.lru_cache(maxsize=4096)
def _group(members: tuple) -> _Group:
    """Keyed by the members' addresses and shapes, which is all the table holds."""
    return _Group(members)


_COUNTERS: dict = {}
_CAPTURING = contextvars.ContextVar("split_k_counters", default=None)


def split_k_counters():
    """Zeroed split-K tile counters for a graph about to be captured, which keeps them (its
    replays run on whatever stream launches them); `with graph_counters(c):` around the capture.
    Two halves: the main stream's and the side streams' (streams.py), whose launches may overlap."""
    return cp.zeros(2 * COUNTERS, cp.int32)


@contextlib.contextmanager
def graph_counters(counters):
    """The group launches captured inside count on `counters` (split_k_counters)."""
    token = _CAPTURING.set(counters)
    try:
        yield
    finally:
        _CAPTURING.reset(token)


def _counters():
    """The split-K tile counters of this launch. Each is 0 between launches (the block that adds a
    tile's slices resets it). Launches on one stream never overlap, launches on two might: a graph
    being captured counts on its own buffer (graph_counters, owned by the graph), an eager launch
    on its stream's. A stream's entry keeps the stream, so no later stream reuses the handle."""
    captured = _CAPTURING.get()
    if captured is not None:
        return captured[COUNTERS:] if on_side() else captured[:COUNTERS]
    stream = cp.cuda.get_current_stream()
    key = (cp.cuda.Device().id, stream.ptr)
    if key not in _COUNTERS:
        _COUNTERS[key] = (stream, cp.zeros(COUNTERS, cp.int32))
    return _COUNTERS[key][1]


def _project(x, ws, kind: str) -> list:
    """[linear(x, w) for w in ws] for bf16 (kind "bf16") or FP8 ("fp8") weights, t <= VERIFY_CAP
    rows, in one launch (dense.cu's linear_group_*). The outputs are consecutive pieces of one
    buffer, each C-contiguous [t, n_out]."""
    t, n_in = x.shape
    members = []
    for w in ws:
        data, scale = (w.data, w.scale_inv.data.ptr) if kind == "fp8" else (w, 0)
        members.append((data.data.ptr, scale, w.shape[0], n_in))
    group = _group(tuple(members))
    y = cp.empty(t * group.outs, cp.float32)
    starts = np.cumsum((0,) + group.n_outs) * t
    outs = [y[a:b].reshape(t, n) for a, b, n in zip(starts[:-1], starts[1:], group.n_outs)]
    if t and group.blocks:
        part = cp.empty(max(t * group.parts, 1), cp.float32)
        whole = kind == "fp8" and _whole(x, members)  # only an FP8 group's kernel depends on it
        launch("dense", _group_kernel(kind, t, whole, group.blocks), (group.blocks,), (BLOCK,),
               (x, group.table, i32(len(ws)), y, part, _counters(), i32(t), i32(n_in)))
    return outs


def _group_kernel(kind: str, t: int, whole: bool, blocks: int) -> str:
    """The projection group kernel of t rows in `blocks` blocks. One row has its own kernels
    (dense.cu's linear_group_bf16_one or _one4 (_one_row_kernel), and linear_group_fp8_one where
    every tile is whole); the bits are the same whichever runs."""
    if t == 1 and kind == "bf16":
        return _one_row_kernel(blocks)
    if t == 1 and whole:
        return "linear_group_fp8_one"
    return f"linear_group_{kind}_n{1 if t <= 8 else 2}"


def _one_row_kernel(blocks: int) -> str:
    """linear_group_bf16_one (three blocks an SM), or its twin _one4 (four) where the launch's last
    round of blocks is fuller at four by more than ONE4_GAIN. A one-row block keeps a fixed load in
    flight, so an SM's last, part-filled round takes about as long as a full one. Graph-timed on
    the H200 (same bits): 4096 x 8192 (512 blocks: one round at four, 1.3 at three) 25.1 -> 20.5
    us, 4096 x 16384 (1024 blocks) 40.8 -> 38.4 and 16384 x 1536 (512) 18.2 -> 16.1 at four, while
    the 768-block groups (1.9 rounds at three, 1.5 at four) ran 10-12% slower there. FP8 keeps
    three: its tiles read half the bytes, and at four its 1024-block projection ran 12% slower."""
    sms = _multiprocessors(cp.cuda.Device().id)

    def filled(per_sm: int) -> float:
        rounds = blocks / (per_sm * sms)
        return rounds / math.ceil(rounds)

    return f"linear_group_bf16_one{'4' if filled(4) > filled(3) + ONE4_GAIN else ''}"


@functools.cache
def _multiprocessors(device: int) -> int:
    return cp.cuda.Device(device).attributes["MultiProcessorCount"]


def _whole(x, members) -> bool:
    """Every FP8 tile of the group loads unchecked (exact_mma_fp8.cuh): x and each member's rows
    16-byte aligned, the in-features whole FP8 blocks."""
    n_in = x.shape[1]
    return n_in % FP8_BLOCK == 0 and x.data.ptr % 16 == 0 and all(m[0] % 16 == 0 for m in members)


def _linear_f32(x, w):
    """A float32-weight projection of t <= VERIFY_CAP rows on CUDA cores (dense.cu's linear_f32_t<T>)."""
    t, n_out = x.shape[0], w.shape[0]
    out = cp.empty((t, n_out), cp.float32)
    if t and n_out:
        suffix, blocks = projection("f32", t, n_out)
        launch("dense", f"linear_{suffix}", (blocks,), (BLOCK,), (x, w, out, i32(t), i32(w.shape[1]), i32(n_out)))
    return out


def _kind(w) -> str:
    return "fp8" if isinstance(w, DeviceFp8) else weight_kind(w, "w")


def head_linear(x, w):
    """Per-head projection: y[r, h] = w[h] @ x[r, h]; x [t, H, in], w [H, out, in]. More than
    VERIFY_CAP rows (a prompt) go to cuBLAS, batched over the heads (prime.py)."""
    kind = weight_kind(w, "w")
    check(x, cp.float32, "x")
    heads, n_out, n_in = w.shape
    assert x.ndim == 3 and x.shape[1:] == (heads, n_in), \
        f"x: expected [t, {heads}, {n_in}], got {x.shape}"
    t = x.shape[0]
    if is_prime(t):
        return prime_head_linear(x, w)
    out = cp.empty((t, heads, n_out), cp.float32)
    if t and heads and n_out:
        suffix, blocks = projection(kind, t, n_out)
        launch("dense", f"head_linear_{suffix}", (blocks, heads), (BLOCK,),
               (x, w, out, i32(t), i32(n_in), i32(n_out)))
    return out


class DenseOps:
    def embed(self, table, ids):
        """table [vocab, D] (float32 or bf16 bits), ids any int shape (host or device) ->
        float32 ids.shape + (D,). Host ids outside the vocab are refused; device ids outside it
        give NaN rows (checking them here would cost a device sync per step)."""
        kind = weight_kind(table, "table")
        vocab, dim = table.shape
        if isinstance(ids, cp.ndarray):
            dev = cp.ascontiguousarray(ids.astype(cp.int32))
        else:
            host = np.asarray(ids)
            assert host.dtype.kind in "iu", f"ids: expected integers, got {host.dtype}"
            if host.size and (host.min() < 0 or host.max() >= vocab):
                bad = host[(host < 0) | (host >= vocab)].reshape(-1)[0]
                raise InputError(f"token id {bad} is outside the vocab [0, {vocab}); "
                                 f"pass ids below {vocab}")
            dev = cp.asarray(np.ascontiguousarray(host, dtype=np.int32))
        out = cp.empty((*dev.shape, dim), cp.float32)
        if dev.size:
            launch("dense", f"embed_{kind}", (dev.size,), (BLOCK,),
                   (table, dev, out, i32(vocab), i32(dim)))
        return out

    def linear(self, x, w):
        """y[r] = w @ x[r]; x [t, in], w [out, in] (float32, bf16 bits or DeviceFp8) -> [t, out].
        More than VERIFY_CAP rows (a prompt) go to cuBLAS (prime.py)."""
        return self.linears(x, (w,))[0]

    def linears(self, x, ws) -> list:
        """The projections of one input, [linear(x, w) for w in ws]. Up to VERIFY_CAP rows, the
        bf16 weights run as one launch and the FP8 weights as another; a prompt's rows are split
        into their bf16 pieces once for all the bf16 and FP8 weights instead of once per weight."""
        check(x, cp.float32, "x")
        assert x.ndim == 2, f"x: expected [t, in], got {x.shape}"
        kinds = [_kind(w) for w in ws]
        for w in ws:
            assert w.shape[1] == x.shape[1], f"x: expected [t, {w.shape[1]}], got {x.shape}"
        if is_prime(x.shape[0]):
            shared = pieces(x) if sum(k != "f32" for k in kinds) > 1 else None
            return [prime_linear(x, w, None if k == "f32" else shared) for w, k in zip(ws, kinds)]
        out = [None] * len(ws)
        for kind in ("bf16", "fp8"):
            at = [i for i, k in enumerate(kinds) if k == kind]
            if at:
                for i, y in zip(at, _project(x, [ws[i] for i in at], kind)):
                    out[i] = y
        return [_linear_f32(x, w) if k == "f32" else y for w, k, y in zip(ws, kinds, out)]

    def head_linear(self, x, w):
        """Per-head projection: y[r, h] = w[h] @ x[r, h]; x [t, H, in], w [H, out, in]."""
        return head_linear(x, w)

    def silu(self, x):
        check(x, cp.float32, "x")
        out = cp.empty_like(x)
        _elementwise("silu_kernel", (x,), out)
        return out

    def sigmoid(self, x):
        check(x, cp.float32, "x")
        out = cp.empty_like(x)
        _elementwise("sigmoid_kernel", (x,), out)
        return out

    def swiglu(self, gate, up, limit: float):
        """silu(min(gate, limit)) * clip(up, -limit, limit)."""
        check(gate, cp.float32, "gate")
        check(up, cp.float32, "up")
        assert gate.shape == up.shape, f"up: expected {gate.shape}, got {up.shape}"
        out = cp.empty_like(gate)
        _elementwise("swiglu_kernel", (gate, up), out, (f32(limit),))
        return out

    def scale(self, x, factor: float):
        """x * float32(factor), elementwise, any shape (the KDA q and indexer weight scales)."""
        check(x, cp.float32, "x")
        out = cp.empty_like(x)
        _elementwise("scale_kernel", (x,), out, (f32(factor),))
        return out

    def add(self, a, b):
        """a + b, elementwise, same shapes (no broadcasting; the MoE routed + shared sum)."""
        check(a, cp.float32, "a")
        check(b, cp.float32, "b")
        assert a.shape == b.shape, f"b: expected {a.shape}, got {b.shape}"
        out = cp.empty_like(a)
        _elementwise("add_kernel", (a, b), out)
        return out

    def write_rows(self, dst, src, at):
        """dst[at:at + t] = src [t, W] in place (a state plane's next rows); `at` a host int or
        the walk's device position (runtime.position)."""
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
