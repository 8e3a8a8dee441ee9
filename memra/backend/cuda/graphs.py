"""CUDA graphs of a cache's walks: capture each walk shape once, then replay it.

A walk (the trunk over t rows) is a fixed sequence of kernel launches whose only host inputs are
the token ids and the first position. Every kernel that depends on the position reads it from a
device buffer and is sized by what the cache can hold, not by how full it is. So one graph per
walk shape serves every later step of that shape: write the inputs into the graph's buffer,
launch the graph. The graph runs the very kernels the eager walk runs, on the same arguments, so
its results are the eager walk's bits (tests/model/test_walk_graphs.py holds it to that).

The graphs are per cache (and per native-MTP draft session, whose steps also take the carrier
rows as a device input), because they hold that cache's state planes by address. The first walk
of a shape runs eagerly, which compiles and loads every kernel it needs. The second is captured
on a private stream, with a private memory pool, so the graph's intermediates are never handed
to other work, and then launched. Later walks of the shape replay it. A replay's outputs are the
graph's own buffers, overwritten by the next replay of the same shape.
"""

from __future__ import annotations

import numpy as np

import cupy as cp

from memra.backend.cuda.dense import graph_counters, split_k_counters


def _packed(tokens, pos0: int) -> np.ndarray:
    """The walk's host inputs in one int32 upload: [pos0, tokens...]."""
    return np.concatenate([[pos0], np.asarray(tokens, np.int64)]).astype(np.int32)


class CapturedWalk:
    """One walk shape captured into a graph, with its input buffers and output arrays."""

    def __init__(self, walk, packed: np.ndarray, arrays: tuple):
        self.pool = cp.cuda.MemoryPool()
        self.inputs = cp.asarray(packed)
        self.arrays = tuple(a.copy() for a in arrays)  # device inputs, copied in before a replay
        self.counters = split_k_counters()  # the graph's projection groups count split-K tiles here
        stream = cp.cuda.Stream(non_blocking=True)  # the legacy stream cannot be captured
        with cp.cuda.using_allocator(self.pool.malloc), stream, graph_counters(self.counters):
            stream.begin_capture()
            try:
                self.outputs = walk(self.inputs[1:], self.inputs[:1], *self.arrays)
            finally:
                self.graph = stream.end_capture()

    def replay(self, packed: np.ndarray, arrays: tuple):
        self.inputs.set(packed)
        for buffer, a in zip(self.arrays, arrays):
            cp.copyto(buffer, a)  # stream-ordered: done before the graph overwrites its outputs
        self.graph.launch()  # on the current stream, after the uploads
        return self.outputs


class WalkGraphs:
    """A cache's walk runner on the CUDA backend: `run(key, walk, tokens, pos0, *arrays)` returns
    walk(device tokens, device position, *arrays), replaying a graph per `key` when `enabled`
    (the key fixes the arrays' shapes). key None (a prefill, whose length varies) always runs
    eagerly."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.seen: set = set()
        self.graphs: dict = {}

    def run(self, key, walk, tokens, pos0: int, *arrays):
        packed = _packed(tokens, pos0)
        if key is None or not self.enabled or key not in self.seen:
            if key is not None:
                self.seen.add(key)
            inputs = cp.asarray(packed)
            return walk(inputs[1:], inputs[:1], *arrays)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = CapturedWalk(walk, packed, arrays)
        return captured.replay(packed, arrays)
