"""The memory plan: the bytes each device needs, computed from the config and the safetensors
headers before anything is allocated (DESIGN.md section 4), and a refusal that names what would fit.

Per device: the weights of its layers by how they are held (memra.memory.held_bytes: bf16 and fp8
matrices as stored, with fp8's float32 block scales; everything else float32), the state planes of
its layers at the requested max_ctx (memra.memory.cache_parts), and buffers: one verify walk's
attention buffers, and on the CUDA backend (graphs=True, the backend that captures walks as CUDA
graphs) what the graphs keep (graph_buffer_bytes) and a prompt walk's largest transient working
set over the device's layers (memra.memory.prime_buffer_bytes). With devices=N the trunk layers are cut into N contiguous ranges balanced by
weight bytes, the embedding on the first device, the final norm, lm_head and the MTP block (with
a copy of the embedding) on the last, so a plan answers "needs N GPUs".

    plan = plan_for_config(cfg, dtype="fp8", max_ctx=8192, devices=4, free=140 * 2**30)
    plan = plan_for_checkpoint(path, cfg, max_ctx=8192, free=free_bytes(be))   # dtypes from headers
    plan.check()                # InputError naming the numbers and what would fit
    print(plan.describe()); json.dumps(plan.to_dict())
"""

from __future__ import annotations

import dataclasses
import math

from memra.errors import InputError
from memra.limits import VERIFY_CAP
from memra.memory import (
    F32, SCALE_SUFFIX, WeightBytes, cache_parts, config_weight_bytes, group_weight_bytes, prime_buffer_bytes,
    walk_buffer_bytes,
)


def graph_buffer_bytes(cfg) -> int:
    """What a cache's captured walk graphs keep (CUDA): one graph per row count t = 1..VERIFY_CAP,
    each with a private pool that holds its outputs (logits [t, V], the collapsed rows [t, D]) and
    the largest working set of one layer: the mHC streams in and out (2 x hc_mult x D) and the MoE
    experts' hidden and output rows (k x (I + D)). All float32."""
    d, k = cfg.hidden_size, cfg.num_experts_per_tok
    per_row = cfg.vocab_size + d + 2 * cfg.hc_mult * d + k * (cfg.moe_intermediate_size + d)
    return VERIFY_CAP * (VERIFY_CAP + 1) // 2 * per_row * F32


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """One device's share: trunk layers [first, stop), what it holds, and the free bytes it has."""

    index: int
    first: int
    stop: int
    groups: tuple           # WeightBytes groups on this device (layer indices, "embed", "head", "mtp")
    weights: dict           # held dtype -> bytes
    cache: int              # state planes at max_ctx
    cache_per_pos: int      # bytes one more position costs
    buffers: int            # walk (and graph) buffers
    free: int | None        # None: unknown, taken as fitting

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.cache + self.buffers

    @property
    def fits(self) -> bool:
        return self.free is None or self.total <= self.free

    def to_dict(self) -> dict:
        return {"device": self.index, "layers": [self.first, self.stop], "weights": dict(self.weights),
                "weights_total": sum(self.weights.values()), "cache": self.cache, "buffers": self.buffers,
                "total": self.total, "free": self.free, "fits": self.fits}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A model's bytes on `devices` at `max_ctx`; `source` says where the dtypes came from."""

    source: str
    dtype: str              # "fp8" when any matrix is FP8, else "bf16" when any is BF16, else "f32"
    max_ctx: int
    devices: tuple
    weights: WeightBytes
    cfg: object
    graphs: bool

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    @property
    def total(self) -> int:
        return sum(d.total for d in self.devices)

    def to_dict(self) -> dict:
        return {"source": self.source, "dtype": self.dtype, "max_ctx": self.max_ctx, "devices": len(self.devices),
                "weights_total": self.weights.total, "total": self.total, "fits": self.fits,
                "per_device": [d.to_dict() for d in self.devices]}

    def describe(self) -> str:
        lines = [f"memory plan for {self.source}: {self.dtype} weights, max_ctx {self.max_ctx}, "
                 f"{_devices(len(self.devices))}: "
                 f"{size(self.total)} in all ({size(self.weights.total)} of weights)"]
        for d in self.devices:
            held = ", ".join(f"{k} {size(v)}" for k, v in sorted(d.weights.items(), key=lambda kv: -kv[1]))
            free = "free unknown" if d.free is None else f"{size(d.free)} free"
            lines.append(f"  device {d.index}: layers {d.first}-{d.stop - 1}"
                         + "".join(f" + {g}" for g in d.groups if isinstance(g, str))
                         + f": weights {size(sum(d.weights.values()))} ({held}), cache {size(d.cache)}, buffers "
                         f"{size(d.buffers)}; total {size(d.total)} of {free}: {'fits' if d.fits else 'DOES NOT FIT'}")
        return "\n".join(lines)

    def check(self) -> None:
        """Refuse a plan that does not fit, naming the numbers and what would fit."""
        if self.fits:
            return
        worst = max((d for d in self.devices if not d.fits), key=lambda d: d.total - d.free)
        ctx = f"at max_ctx {self.max_ctx}" if self.max_ctx else "before any cache"
        raise InputError(
            f"{self.source} does not fit: {self.dtype} weights {ctx} on {_devices(len(self.devices))} "
            f"need {size(worst.total)} on device {worst.index} (weights {size(sum(worst.weights.values()))}, "
            f"cache {size(worst.cache)}, buffers {size(worst.buffers)}) but {size(worst.free)} is free; "
            "what would fit: " + "; ".join(self.what_fits()))

    def what_fits(self) -> list[str]:
        """The fixes: FP8 weights, the largest max_ctx, the number of GPUs (each with device 0's free bytes)."""
        out = []
        if self.dtype != "fp8":
            fp8 = self._replan(config_weight_bytes(self.cfg, "fp8"), len(self.devices))
            need = fp8.devices_needed()
            out.append(f"FP8 weights ({size(fp8.weights.total)}) " + (
                f"fit on {_devices(len(self.devices))}" if fp8.fits else
                f"on {_devices(need)} (--gpus {need})" if need else "do not fit either"))
        ctx = self.max_ctx_that_fits()
        out.append(f"max_ctx {ctx} or less (--max-ctx {ctx})" if ctx >= 1 else
                   f"no max_ctx on {_devices(len(self.devices))} (the weights and buffers alone are too large)")
        need = self.devices_needed()
        out.append(f"{self.dtype} weights on {_devices(need)}: needs {need} GPUs (--gpus {need})" if need else
                   f"no split over up to {self.cfg.num_hidden_layers} GPUs")
        return out

    def max_ctx_that_fits(self) -> int:
        """The largest max_ctx (up to the model's) at which every device of this split fits; -1: not
        even max_ctx 0. A bisection: the total grows with max_ctx, but not linearly (a prompt's
        buffers stop growing at PRIME_CHUNK rows)."""
        ranges = [(d.first, d.stop) for d in self.devices]
        fits = lambda ctx: _plan(self.cfg, self.weights, self.source, ctx, len(ranges), [d.free for d in self.devices],
                                 self.graphs, ranges).fits
        low, high = -1, self.cfg.max_position_embeddings
        if fits(high):
            return high
        while high - low > 1:  # fits(low) (or low == -1), not fits(high)
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

    def devices_needed(self) -> int | None:
        """The fewest devices (each with device 0's free bytes) that hold this plan; None: none do."""
        for n in range(1, self.cfg.num_hidden_layers + 1):
            if self._replan(self.weights, n).fits:
                return n
        return None

    def _replan(self, weights: WeightBytes, n: int) -> "MemoryPlan":
        return _plan(self.cfg, weights, self.source, self.max_ctx, n, [self.devices[0].free] * n, self.graphs)


def size(n: int) -> str:
    """Bytes in the largest binary unit that keeps a whole number in front: 512 B, 1.50 MiB, 598.81 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _devices(n: int) -> str:
    return f"{n} device{'s' if n != 1 else ''}"


# ---- the split ------------------------------------------------------------------------------

def _edge_groups(weights: WeightBytes, first: int, stop: int) -> tuple:
    """The non-layer groups a device holding trunk layers [first, stop) keeps: the embedding on the
    first, the head and MTP block on the last, which also keeps its own copy of the embedding when
    it is another device (the MTP block embeds each drafted token)."""
    last = stop == weights.num_layers
    embed = first == 0 or (last and weights.mtp > 0)
    return (("embed",) if embed else ()) + (("head", "mtp") if last else ())


def balanced_split(weights: WeightBytes, n: int) -> list[tuple[int, int]]:
    """Cut the trunk layers into n contiguous non-empty ranges that minimise the largest device's
    weight bytes (the groups of _edge_groups counted too); ties go to the earliest cut. Exact
    (dynamic programming over the cut points): n x L^2 steps."""
    layers = weights.layers
    count = len(layers)
    if not 1 <= n <= count:
        raise InputError(f"{n} devices for {count} layers: give 1..{count} devices (each holds at least one layer)")
    prefix = [0]
    for b in layers:
        prefix.append(prefix[-1] + b)

    def load(start: int, stop: int) -> int:
        return prefix[stop] - prefix[start] + sum(weights.group(g) for g in _edge_groups(weights, start, stop))

    # best[j][i]: the smallest possible largest load when j devices hold layers [0, i)
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(n + 1)]
    cut = [[0] * (count + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for j in range(1, n + 1):
        for i in range(j, count - (n - j) + 1):
            for s in range(j - 1, i):
                value = max(best[j - 1][s], load(s, i))
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, s
    ranges, stop = [], count
    for j in range(n, 0, -1):
        ranges.append((cut[j][stop], stop))
        stop = cut[j][stop]
    return ranges[::-1]


# ---- building plans -------------------------------------------------------------------------

def _plan(cfg, weights: WeightBytes, source: str, max_ctx: int, n: int, free: list, graphs: bool,
          ranges=None) -> MemoryPlan:
    """`ranges` (the stages' layer ranges, when a split is already chosen) or the balanced split."""
    count = cfg.num_hidden_layers
    devices = []
    for index, (first, stop) in enumerate(balanced_split(weights, n) if ranges is None else ranges):
        groups = tuple(range(first, stop)) + _edge_groups(weights, first, stop)
        per_pos, kda = cache_parts(cfg, range(first, stop), cfg.has_mtp and stop == count)
        per_pos_bytes = math.ceil(per_pos * F32)
        buffers = walk_buffer_bytes(cfg)
        if graphs:  # the CUDA backend: captured walks, and a prompt's transient buffers
            buffers += graph_buffer_bytes(cfg) + prime_buffer_bytes(cfg, range(first, stop), max_ctx)
        devices.append(DevicePlan(index, first, stop, groups, weights.by_dtype(groups),
                                  per_pos_bytes * max_ctx + kda * F32, per_pos_bytes, buffers, free[index]))
    held = weights.by_dtype()
    dtype = "fp8" if held.get("fp8") else "bf16" if held.get("bf16") else "f32"
    return MemoryPlan(source, dtype, max_ctx, tuple(devices), weights, cfg, graphs)


def _frees(free, n: int) -> list:
    if free is None or isinstance(free, int):
        return [free] * n
    free = list(free)
    if len(free) != n:
        raise InputError(f"{len(free)} free-memory figures for {n} devices: give one per device, or one for all")
    return free


def _ctx(cfg, max_ctx) -> int:
    max_ctx = cfg.max_position_embeddings if max_ctx is None else max_ctx
    if not isinstance(max_ctx, int) or isinstance(max_ctx, bool) or max_ctx < 0:
        raise InputError(f"max_ctx must be an integer >= 0, got {max_ctx!r}")
    return max_ctx


def plan_for_config(cfg, dtype: str = "bf16", max_ctx: int | None = None, devices: int = 1, free=None,
                    graphs: bool = True, source: str | None = None, ranges=None) -> MemoryPlan:
    """The plan of a release checkpoint of `cfg` in `dtype` ("bf16", "fp8" or "f32"), no files needed.
    max_ctx defaults to max_position_embeddings; `free` is one byte count for every device, one per
    device, or None (unknown: the plan then always fits); `ranges` as plan_for_checkpoint's."""
    source = source or f"a {cfg.num_hidden_layers}-layer glm5_next config"
    devices = devices if ranges is None else len(ranges)
    return _plan(cfg, config_weight_bytes(cfg, dtype), source, _ctx(cfg, max_ctx), devices,
                 _frees(free, devices), graphs, ranges)


def checkpoint_weight_bytes(path: str, cfg) -> WeightBytes:
    """WeightBytes from a checkpoint's safetensors headers (no tensor is read): each stored tensor
    as its header's dtype says, a `<name>_scale_inv` sibling as its weight's float32 scales."""
    from memra.checkpoint import _canonical_name, _shard_plan  # memra.checkpoint imports memra.memory
    from memra.safetensors_io import read_header

    tensors = []
    for file in _shard_plan(path):
        for raw, entry in read_header(file).entries.items():
            base = raw[:-len(SCALE_SUFFIX)] if raw.endswith(SCALE_SUFFIX) else raw
            name = _canonical_name(base, cfg)
            if name is not None:
                tensors.append((name + raw[len(base):], entry.dtype, tuple(entry.shape)))
    return group_weight_bytes(cfg, tensors)


def plan_for_checkpoint(path: str, cfg, max_ctx: int | None = None, devices: int = 1, free=None,
                        graphs: bool = True, ranges=None) -> MemoryPlan:
    """The plan of the checkpoint at `path`, its dtypes read from the safetensors headers; `ranges`
    fixes the stages' layer ranges (an explicit split), else they are balanced by bytes."""
    devices = devices if ranges is None else len(ranges)
    return _plan(cfg, checkpoint_weight_bytes(path, cfg), str(path), _ctx(cfg, max_ctx), devices,
                 _frees(free, devices), graphs, ranges)


def check_device_fits(path: str, cfg, be, devices: int = 1, ranges=None) -> MemoryPlan | None:
    """At load: refuse a checkpoint whose weights, fixed state and buffers do not fit `devices`
    devices (each with the current device's free bytes), naming what would. Only a backend with
    memory of its own (`be.free_bytes`, CUDA) is checked here; the host's memory is checked by the
    loader, which reads every tensor into it first. The cache is checked when it is made."""
    ask = getattr(be, "free_bytes", None)
    if not callable(ask):
        return None
    plan = plan_for_checkpoint(path, cfg, max_ctx=0, devices=devices, free=ask(), graphs=True, ranges=ranges)
    plan.check()
    return plan
