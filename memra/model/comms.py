"""How ranks of a model split over processes talk (memra/model/ranks.py): the comms and the
boundary transport over them.

* NcclComm: one GPU per process through cupyx.distributed's NCCL backend, every call on the
  current (the stage's) stream. ThreadComm: the ranks as threads of one process (numpy; how CI
  runs the gate). Both offer send, recv into a buffer, and broadcast from a root, of arrays.
* RankTransport: stage s's Boundary to rank s + 1 as a header of int64 words (count; per array
  its part, layer, dtype code, ndim and shape: the selections' widths depend on the position,
  so the header carries them) and then the arrays in a fixed order (streams, taps by ascending
  layer, selections by ascending layer); or, in place of a boundary, a failure report.
* launcher_env: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT as torchrun and SLURM set them.
"""

from __future__ import annotations

import os
import queue

import numpy as np

from memra.errors import BackendError, InputError
from memra.model.transport import Boundary

DTYPES = (np.float32, np.int32, np.int64)  # a boundary array's dtype, by its code
PARTS = ("streams", "taps", "selections")


class ThreadComm:
    """Ranks as threads of one process (the numpy backend): point-to-point queues and one
    broadcast queue per rank; arrays travel as copies, so no rank sees another's buffers. A
    receive that waits `timeout` seconds raises instead of hanging (a rank that died)."""

    def __init__(self, hub: dict, rank: int, world: int, timeout: float):
        self.rank, self.world, self.hub, self.timeout = rank, world, hub, timeout

    @classmethod
    def group(cls, world: int, timeout: float = 120.0) -> list["ThreadComm"]:
        hub = {"p2p": {(a, b): queue.Queue() for a in range(world) for b in range(world) if a != b},
               "bcast": [queue.Queue() for _ in range(world)]}
        return [cls(hub, r, world, timeout) for r in range(world)]

    def _get(self, q, peer: int):
        try:
            return q.get(timeout=self.timeout)
        except queue.Empty:
            raise InputError(f"rank {self.rank} waited {self.timeout:.0f} s for rank {peer}: that rank stopped "
                             "(see its own error)") from None

    def send(self, a, peer: int) -> None:
        self.hub["p2p"][(self.rank, peer)].put(np.array(a, copy=True))

    def recv(self, out, peer: int) -> None:
        out[...] = self._get(self.hub["p2p"][(peer, self.rank)], peer)

    def broadcast(self, buf, root: int) -> None:
        if self.rank == root:
            for r in range(self.world):
                if r != root:
                    self.hub["bcast"][r].put(np.array(buf, copy=True))
        else:
            buf[...] = self._get(self.hub["bcast"][self.rank], root)


class NcclComm:
    """One GPU per process through cupyx.distributed's NCCL backend; every call runs on the
    current stream (the stage's), ordered with the walk's kernels."""

    def __init__(self, rank: int, world: int, host: str, port: int):
        import cupyx.distributed

        self.rank, self.world = rank, world
        self.nccl = cupyx.distributed.init_process_group(world, rank, backend="nccl", host=host, port=port)

    def _stream(self):
        import cupy

        return cupy.cuda.get_current_stream()

    def send(self, a, peer: int) -> None:
        self.nccl.send(a, peer, self._stream())

    def recv(self, out, peer: int) -> None:
        self.nccl.recv(out, peer, self._stream())

    def broadcast(self, buf, root: int) -> None:
        self.nccl.broadcast(buf, root, self._stream())


class RankTransport:
    """Stage s's boundary to rank s + 1: a header of int64 words (count; then per array its
    part, layer, dtype code, ndim and shape), then the arrays, in the fixed order."""

    def __init__(self, comm, be, num_layers: int):
        self.comm, self.be = comm, be
        self.words = 1 + 7 * (1 + 2 * num_layers)  # streams, then at most a tap and a selection a layer
        self.received = 0  # boundaries (or failures) taken from the rank before

    def send_failure(self, stage: int, rank: int, message: str) -> None:
        """Instead of a boundary, tell rank stage + 1 that rank `rank` failed: count -1, the
        failing rank, then as much of the message's UTF-8 as the header holds."""
        raw = message.encode()[:8 * (self.words - 3)]
        header = np.zeros(self.words, np.int64)
        header[:3] = [-1, rank, len(raw)]
        words = -(-len(raw) // 8)
        header[3:3 + words] = np.frombuffer(raw.ljust(8 * words, b"\0"), np.int64)
        self.comm.send(self.be.asarray(header, dtype=np.int64), stage + 1)

    def send(self, stage: int, b: Boundary) -> None:
        arrays = [(0, -1, b.streams)] + [(1, i, b.taps[i]) for i in sorted(b.taps)] \
            + [(2, i, b.selections[i]) for i in sorted(b.selections)]
        header = np.zeros(self.words, np.int64)
        header[0] = len(arrays)
        for j, (part, layer, a) in enumerate(arrays):
            code = [np.dtype(d) for d in DTYPES].index(np.dtype(a.dtype))
            header[1 + 7 * j:1 + 7 * j + 4 + a.ndim] = [part, layer, code, a.ndim, *a.shape]
        self.comm.send(self.be.asarray(header, dtype=np.int64), stage + 1)
        for _, _, a in arrays:
            self.comm.send(self.be.contiguous(a), stage + 1)

    def recv(self, stage: int) -> Boundary:
        buf = self.be.zeros(self.words, dtype=np.int64)
        self.comm.recv(buf, stage - 1)
        header = np.asarray(self.be.to_host(buf))
        self.received += 1
        if header[0] == -1:
            origin, message = int(header[1]), header[3:].tobytes()[:int(header[2])].decode(errors="replace")
            err = BackendError(f"rank {origin} failed ({message}); the ranks after it stopped walking: close "
                               "this model and start the group again")
            err.report = (origin, message)
            raise err
        got = Boundary(None)
        for j in range(int(header[0])):
            part, layer, code, ndim = (int(v) for v in header[1 + 7 * j:5 + 7 * j])
            out = self.be.zeros(tuple(int(d) for d in header[5 + 7 * j:5 + 7 * j + ndim]), dtype=DTYPES[code])
            self.comm.recv(out, stage - 1)
            if part == 0:
                got.streams = out
            else:
                getattr(got, PARTS[part])[layer] = out
        return got


def launcher_env(environ=None) -> dict:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT as torchrun and SLURM set them."""
    env = os.environ if environ is None else environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise InputError(f"a ranked run needs the launcher's {missing}: start one process per GPU with torchrun "
                         "(or srun), which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")
    def number(key: str, default=None) -> int:
        text = env.get(key, default)
        try:
            value = int(text)
        except (TypeError, ValueError):
            value = -1
        if value < 0:
            raise InputError(f"{key}={text!r} must be a non-negative integer, as the launcher (torchrun, srun) "
                             "sets it: start the ranks with one")
        return value

    return {"rank": number("RANK"), "world": number("WORLD_SIZE"), "local": number("LOCAL_RANK", "0"),
            "host": env["MASTER_ADDR"], "port": number("MASTER_PORT")}
