"""The stage boundary: what crosses a cut between pipeline stages, and how it gets there.

A walk crosses the cut after stage s once: stage s calls `send(s, boundary)`, stage s+1 calls
`recv(s + 1)` and gets the boundary on its own device. A Boundary holds the t rows' mHC streams
[t, n, D] (the whole residual state between two layers), the contracted tap rows of layers
already walked (draft sources live on the last stage and read them) and the kpool selections of
indexer layers whose `shared` followers sit on later stages. Nothing else crosses: every state
plane stays with the stage that owns its layer.

Two pieces carry it:
* Lanes: where a stage runs. `scope(s)` makes stage s's device and stream current for the work
  inside it, ordered after everything the caller issued before and before everything after
  (one event each way). HostLanes (numpy) has no devices; DeviceLanes drives local GPUs, one
  stream per stage (several stages may share a device: each still gets its own stream).
* InProcessTransport: stages in one process. On one device a boundary is handed over by
  reference (the scopes order the hand-off); across local devices its arrays are copied device
  to device. Stages in different processes would exchange the same Boundary over NCCL
  (docs/pipeline.md: the same send/recv, fixed shapes from t and the plan).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from memra.errors import InputError


@dataclass
class Boundary:
    """What stage s hands stage s+1."""

    streams: object                                   # [t, n, D] mHC streams after stage s's last layer
    taps: dict = field(default_factory=dict)          # tap layer -> contracted rows [t, D]
    selections: dict = field(default_factory=dict)    # indexer layer -> attended positions [t, W]


class InProcessTransport:
    """Every stage in this process: send parks the boundary, recv hands it to the next stage on
    that stage's device."""

    def __init__(self, lanes):
        self.lanes = lanes
        self.parked: dict[int, Boundary] = {}

    def send(self, stage: int, boundary: Boundary) -> None:
        self.parked[stage + 1] = boundary

    def recv(self, stage: int) -> Boundary:
        if stage not in self.parked:
            raise InputError(f"stage {stage} received before stage {stage - 1} sent its boundary; stages run "
                             "in order within one walk")
        b = self.parked.pop(stage)
        move = lambda a: self.lanes.to_stage(stage, a)  # noqa: E731
        return Boundary(move(b.streams), {i: move(a) for i, a in b.taps.items()},
                        {i: move(a) for i, a in b.selections.items()})


class HostLanes:
    """Stages on the host (the numpy backend): no devices, no streams, nothing to order."""

    def __init__(self, count: int):
        self.devices = (None,) * count

    def scope(self, stage: int):
        return nullcontext()

    def to_stage(self, stage: int, a):
        return a

    def make_current(self, stage: int) -> None:
        """Nothing to select on the host."""


class DeviceLanes:
    """Stages on local GPUs: stage s runs on device devices[s] with a stream of its own."""

    def __init__(self, xp, devices):
        self.xp, self.cuda = xp, xp.cuda
        have = self.cuda.runtime.getDeviceCount()
        bad = [d for d in devices if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < have]
        if bad:
            raise InputError(f"stage devices {list(devices)}: {bad} name no GPU of this host, which has {have} "
                             f"(0..{have - 1}); {len(devices)} stages as placed need {len(set(devices))} GPUs: "
                             f"use --gpus {have} or fewer, or devices={[0] * len(devices)} for every stage on one GPU")
        self.devices = tuple(int(d) for d in devices)
        self.streams = []
        for d in self.devices:
            with self.cuda.Device(d):
                self.streams.append(self.cuda.Stream(non_blocking=True))

    @contextmanager
    def scope(self, stage: int):
        """Stage `stage`'s device and stream for the block: its stream first waits for what the
        caller's stream has issued; afterwards the caller's stream waits for the stage."""
        cuda = self.cuda
        caller = cuda.get_current_stream()
        ready = caller.record()
        stream = self.streams[stage]
        with cuda.Device(self.devices[stage]):
            stream.wait_event(ready)
            try:
                with stream:
                    yield
            finally:
                done = stream.record()
        caller.wait_event(done)

    def make_current(self, stage: int) -> None:
        """Make stage `stage`'s device the process's current one (the last stage's, at load: the
        outputs, the draft sources and sampling live there)."""
        self.cuda.Device(self.devices[stage]).use()

    def to_stage(self, stage: int, a):
        """`a` on stage `stage`'s device: itself when it already lives there, else a device-to-
        device copy on that stage's stream (called inside the stage's scope)."""
        device = self.devices[stage]
        if a.device.id == device:
            return a
        assert a.flags.c_contiguous, "a boundary array must be C-contiguous to copy between devices"
        with self.cuda.Device(device):
            out = self.xp.empty_like(a)
            out.data.copy_from_device_async(a.data, a.nbytes, self.streams[stage])
        return out


def lanes_for(be, devices):
    """The lanes a backend offers for these stage devices: its array module's device runtime
    when it has one (CuPy's `cuda`), else the host."""
    if getattr(be.xp, "cuda", None) is None:
        return HostLanes(len(devices))
    return DeviceLanes(be.xp, devices)
