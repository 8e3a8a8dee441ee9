"""Placement: which contiguous trunk layers each pipeline stage owns.

A model too large for one GPU runs as N stages: stage s owns layers ranges[s] (their weights,
KDA states, conv rings, latent planes and pool keys) and runs them on its own device and stream.
The embedding sits on the first stage; the final norm, lm head, MTP block and every draft source
on the last. Stages are contiguous so that a walk crosses each boundary once, carrying only the
t rows' mHC streams (and the taps and shared indexer selections later stages read).

    plan = plan_stages(6, stages=2)                      # equal layer counts
    plan = plan_stages(6, stages=2, balance=split)       # split(n) -> ranges: the memory plan's, by bytes
    plan = plan_stages(6, stage_layers="0-2,3-5")        # explicit
    plan.ranges, plan.stage_of(4), plan.describe()       # ((0, 3), (3, 6)), 1, "0-2,3-5"
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from memra.errors import InputError


@dataclass(frozen=True)
class StagePlan:
    """Half-open layer ranges [start, stop), one per stage, in order, covering the trunk."""

    ranges: tuple[tuple[int, int], ...]

    @property
    def count(self) -> int:
        return len(self.ranges)

    @property
    def num_layers(self) -> int:
        return self.ranges[-1][1]

    def layers(self, stage: int) -> range:
        return range(*self.ranges[stage])

    def stage_of(self, layer: int) -> int:
        for s, (start, stop) in enumerate(self.ranges):
            if start <= layer < stop:
                return s
        raise InputError(f"layer {layer} is outside the trunk 0..{self.num_layers - 1}")

    def describe(self) -> str:
        """The --stage-layers spelling of this plan, e.g. "0-2,3-5"."""
        return ",".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in self.ranges)


def plan_stages(num_layers: int, stages: int = 1, stage_layers=None, balance=None) -> StagePlan:
    """The placement of a `num_layers` trunk: an explicit `stage_layers` split (a "0-3,4-7"
    string or a sequence of (start, stop) ranges), else `stages` ranges from `balance(stages)`
    (load_model passes the memory plan's split by weight bytes), else equal layer counts."""
    if isinstance(stages, bool) or not isinstance(stages, (int, np.integer)) or not 1 <= stages <= num_layers:
        raise InputError(f"stages={stages!r}: a {num_layers}-layer trunk splits into 1..{num_layers} stages "
                         "(each stage owns at least one layer)")
    if stage_layers is not None:
        ranges = parse_stage_layers(stage_layers, num_layers)
        if stages not in (1, len(ranges)):
            raise InputError(f"stages={stages} but the explicit split {stage_layers!r} has {len(ranges)} stages; "
                             "give one of them, or make them agree")
        return StagePlan(ranges)
    if stages == 1:
        return StagePlan(((0, num_layers),))
    if balance is not None:
        ranges = tuple((int(a), int(b)) for a, b in balance(int(stages)))
        return StagePlan(parse_stage_layers(ranges, num_layers))  # checked like an explicit split
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    return StagePlan(tuple(zip(bounds, bounds[1:])))


def stage_devices(devices, count: int) -> tuple[int, ...]:
    """The local GPU of each of `count` stages: `devices` (one non-negative integer a stage; two
    stages may share one), or GPU s for stage s when None."""
    if devices is None:
        return tuple(range(count))
    if isinstance(devices, (str, bytes)) or not isinstance(devices, (list, tuple, range, np.ndarray)):
        raise InputError(f"devices must be a list of GPU indices, one a stage, got {devices!r:.40}")
    devices = tuple(devices)
    if any(isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or d < 0 for d in devices):
        raise InputError(f"devices {list(devices)!r:.60} must be GPU indices (integers >= 0), one a stage")
    if len(devices) != count:
        raise InputError(f"{len(devices)} stage devices {list(devices)} for {count} stages; give one device per stage")
    if count == 1 and devices != (0,):
        raise InputError(f"devices={list(devices)} places pipeline stages, and this model is one stage: choose its "
                         "GPU with CUDA_VISIBLE_DEVICES (or cupy.cuda.Device(n).use()), or give stages > 1")
    return tuple(int(d) for d in devices)


def parse_stage_layers(spec, num_layers: int) -> tuple[tuple[int, int], ...]:
    """"0-3,4-7" (inclusive ranges, a lone index for a one-layer stage) or a sequence of
    half-open (start, stop) pairs -> half-open ranges, checked to cover every layer once, in order."""
    if isinstance(spec, str):
        ranges = [_parse_range(part, spec) for part in spec.replace(" ", "").split(",")]
    elif isinstance(spec, (list, tuple)):
        ranges = [_pair(r, spec) for r in spec]
    else:
        raise InputError(f"stage_layers must be a string like '0-3,4-7' or a list of (start, stop) ranges, got "
                         f"{type(spec).__name__}")
    if not ranges:
        raise InputError("stage_layers is empty: give one layer range per stage, like '0-3,4-7'")
    expected = 0
    for start, stop in ranges:
        if stop <= start:
            raise InputError(f"stage_layers {spec!r}: the range starting at layer {start} is empty; every stage "
                             "owns at least one layer")
        if start != expected:
            gap = f"layer {expected}" if start - expected == 1 else f"layers {expected}..{start - 1}"
            what = "overlaps the stage before it" if start < expected else f"leaves {gap} on no stage"
            raise InputError(f"stage_layers {spec!r}: the stage starting at layer {start} {what}; the ranges must "
                             f"cover layers 0..{num_layers - 1} exactly once, in order")
        expected = stop
    if expected != num_layers:
        raise InputError(f"stage_layers {spec!r} covers layers 0..{expected - 1} but the trunk has {num_layers} "
                         f"(0..{num_layers - 1}); the last range must end at layer {num_layers - 1}")
    return tuple(ranges)


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _parse_range(part: str, spec: str) -> tuple[int, int]:
    m = _RANGE.match(part)
    if m is None:
        raise InputError(f"stage_layers {spec!r}: {part!r} is not a layer range; write FIRST-LAST or one index, "
                         "like '0-3,4-7'")
    first = int(m.group(1))
    last = first if m.group(2) is None else int(m.group(2))
    if last < first:
        raise InputError(f"stage_layers {spec!r}: {part!r} runs backwards; write FIRST-LAST with FIRST <= LAST")
    return first, last + 1


def _pair(r, spec) -> tuple[int, int]:
    ok = isinstance(r, (list, tuple)) and len(r) == 2 and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in r)
    if not ok:
        raise InputError(f"stage_layers {spec!r}: {r!r} is not a (start, stop) pair of layer indices")
    return int(r[0]), int(r[1])
