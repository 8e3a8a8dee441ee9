"""CUDA graphs of a cache's walks: capture each walk shape once, then replay it.

A walk (the trunk over t rows) is a fixed sequence of kernel launches whose only host inputs are
the token ids and the first position. Every kernel that depends on the position reads it from a
device buffer and is sized by what the cache can hold, not by how full it is. So one graph per
walk shape serves every later step of that shape: write the inputs into the graph's buffer,
launch the graph. Token ids may already be on the device (a native-mtp chain's last argmax): they
are then copied into the buffer on the device, and no step waits for the host. The graph runs
the very kernels the eager walk runs, on the same arguments, so its results are the eager walk's
bits (tests/model/test_walk_graphs.py holds it to that).

The graphs are per cache (and per native-MTP draft session, whose steps also take the carrier
rows as a device input), because they hold that cache's state planes by address. The first walk
of a shape runs eagerly, which compiles and loads every kernel it needs. The second is captured
on a private stream, with a private memory pool, so the graph's intermediates are never handed
to other work, and with programmatic dependent launch (runtime.dependent_launches); then it is
launched. Later walks of the shape replay it. A replay's outputs are the graph's own buffers,
overwritten by the next replay of the same shape.
"""

from __future__ import annotations

import contextlib

import numpy as np

import cupy as cp

from memra.backend.cuda.dense import graph_counters, split_k_counters
from memra.backend.cuda.runtime import dependent_launches


def _load(inputs, tokens, pos0: int) -> None:
    """inputs (int32 [1 + t]) = [pos0, tokens...]. Host ids go up in one upload; device ids (a
    draft chain's own argmax) are copied on the device, so the chain never waits for the host."""
    if isinstance(tokens, cp.ndarray):
        inputs[:1].fill(pos0)
        cp.copyto(inputs[1:], tokens.reshape(-1), casting="unsafe")
    else:
        inputs.set(np.concatenate([[pos0], np.asarray(tokens, np.int64)]).astype(np.int32))


def _inputs(tokens, pos0: int):
    inputs = cp.empty(1 + len(tokens), cp.int32)
    _load(inputs, tokens, pos0)
    return inputs


def capture(fn, *contexts):
    """fn() captured (not run) into a graph on a private stream and memory pool, inside
    `contexts`: (what fn returned, the graph, the pool, which must live as long as the graph)."""
    pool, stream = cp.cuda.MemoryPool(), cp.cuda.Stream(non_blocking=True)  # the legacy stream cannot be captured
    with cp.cuda.using_allocator(pool.malloc), stream, contextlib.ExitStack() as inside:
        for context in contexts:
            inside.enter_context(context)
        stream.begin_capture()
        try:
            result = fn()
        finally:
            graph = stream.end_capture()
    return result, graph, pool


class CapturedWalk:
    """One walk shape captured into a graph, with its input buffers and output arrays."""

    def __init__(self, walk, tokens, pos0: int, arrays: tuple):
        self.inputs = _inputs(tokens, pos0)
        self.arrays = tuple(a.copy() for a in arrays)  # device inputs, copied in before a replay
        self.counters = split_k_counters()  # the graph's projection groups count split-K tiles here
        self.outputs, self.graph, self.pool = capture(
            lambda: walk(self.inputs[1:], self.inputs[:1], *self.arrays),
            graph_counters(self.counters), dependent_launches())

    def replay(self, tokens, pos0: int, arrays: tuple):
        _load(self.inputs, tokens, pos0)
        for buffer, a in zip(self.arrays, arrays):
            cp.copyto(buffer, a)  # stream-ordered: done before the graph overwrites its outputs
        self.graph.launch()  # on the current stream, after the uploads
        return self.outputs


class WalkGraphs:
    """A cache's walk runner on the CUDA backend: `run(key, walk, tokens, pos0, *arrays)` returns
    walk(device tokens, device position, *arrays) for host or device token ids, replaying a graph
    per `key` when `enabled` (the key fixes the arrays' shapes). key None (a prefill, whose length
    varies) always runs eagerly. `steps(key, fn)` does the same for a launch sequence with no
    inputs and no outputs (a rollback's restore of a cache part: fixed buffers, one per keep)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.captures = 0  # graphs captured so far: a benchmark checks that none fell in its timed span
        self.seen: set = set()
        self.graphs: dict = {}
        self.fixed: dict = {}  # steps key -> (graph, its pool)

    def steps(self, key, fn) -> None:
        """fn() eagerly the first time `key` comes (its kernels compile and load), captured the
        second time and replayed from then on: one graph launch's host work instead of every
        launch's (a bench rollback took about 0.12 ms of host work eagerly, its GPU time 0.045)."""
        if not self.enabled or key not in self.seen:
            self.seen.add(key)
            fn()
            return
        if key not in self.fixed:
            self.fixed[key] = capture(fn)[1:]
            self.captures += 1
        self.fixed[key][0].launch()  # on the current stream

    def run(self, key, walk, tokens, pos0: int, *arrays):
        if key is None or not self.enabled or key not in self.seen:
            if key is not None:
                self.seen.add(key)
            inputs = _inputs(tokens, pos0)
            return walk(inputs[1:], inputs[:1], *arrays)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = CapturedWalk(walk, tokens, pos0, arrays)
            self.captures += 1
        return captured.replay(tokens, pos0, arrays)
