"""Side streams: launches that run beside the main stream's, forked from it and joined back by
events. In a captured walk the fork and the join are graph edges, so a replay runs the two
branches at once: a chain of small latency-bound kernels hides behind another one.

    with be.beside(lambda: be.linear(a, w), t) as side:   # forked: runs beside what follows
        y = be.rmsnorm(b, v, eps)
    z = side.result                                       # joined: later launches wait for it
"""

from __future__ import annotations

import functools

import cupy as cp

# hc_site's Sinkhorn mixes; Beside; a prompt's KDA chunk scan (kda_chunks.py). Each its own
# stream: none waits on another
LANES = ("mix", "beside", "chunks")
URGENT = ("chunks",)  # lanes of the device's highest stream priority: their blocks are placed first


@functools.cache
def side_stream(device: int, lane: str) -> "cp.cuda.Stream":
    """The side stream of `lane` on a device."""
    assert lane in LANES, f"side stream lane {lane!r}, one of {LANES}"
    with cp.cuda.Device(device):
        # CUDA clamps a priority to the device's range: this is its greatest
        return cp.cuda.Stream(non_blocking=True, priority=-(1 << 20) if lane in URGENT else None)


def on_side() -> bool:
    """Whether launches now go to a side stream (they count split-K tiles apart: dense.py)."""
    current, device = cp.cuda.get_current_stream().ptr, cp.cuda.Device().id
    return any(current == side_stream(device, lane).ptr for lane in LANES)


def fork(lane: str) -> tuple["cp.cuda.Stream", "cp.cuda.Stream"]:
    """(main, side): the side stream of `lane` waits for everything launched on main so far."""
    main, side = cp.cuda.get_current_stream(), side_stream(cp.cuda.Device().id, lane)
    side.wait_event(recorded(main))
    return main, side


def join(main: "cp.cuda.Stream", side: "cp.cuda.Stream") -> None:
    """main waits for everything launched on side so far."""
    main.wait_event(recorded(side))


def recorded(stream: "cp.cuda.Stream") -> "cp.cuda.Event":
    """An event marking everything launched on stream so far."""
    done = cp.cuda.Event(disable_timing=True)
    done.record(stream)
    return done


class Beside:
    """fn() launched on the "beside" side stream, after everything launched so far; leaving the
    `with` block makes the main stream wait for it (always, as does fn raising: a capture must
    never end forked), and `result` is then fn's return. fn's arrays stay referenced until the
    join: the main stream must not reuse their memory while the side stream may still read it."""

    def __init__(self, fn):
        self._main, self._side = fork("beside")
        self._fn = fn
        try:
            with self._side:
                self._value = fn()
        except BaseException:
            self._join()
            raise

    def _join(self) -> None:
        join(self._main, self._side)
        self._fn = None

    def __enter__(self) -> "Beside":
        return self

    def __exit__(self, *exc) -> None:
        self._join()

    @property
    def result(self):
        assert self._fn is None, "Beside.result before the join: read it after the with block"
        return self._value
