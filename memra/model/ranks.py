"""The trunk's stages in separate processes: rank r holds and runs stage r, the last rank drives.

One process per GPU, started by a standard launcher (torchrun or SLURM set RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Every rank builds the same StagePlan (one stage per rank)
and holds only its own stage's weights and planes; the last rank also holds the head, the MTP
block and the embedding copy, so the user's program (generate, sessions, draft sources) runs
there, on a RankedGlm5Model that is a StagedGlm5Model in every contract. The other ranks follow:

    model = load_ranked(path, backend="cuda")          # reads the launcher's environment
    if model.driver:
        generate(model, prompt, 64, draft="native-mtp")
        model.close()                                  # the followers' serve() returns
    else:
        model.serve()

Each operation that touches trunk planes (a new cache, a walk, the KDA snapshot buffers, a
rollback, a rewind) is a seam of the staged model. On the driver the seam first broadcasts a
command (kind, cache id, pos0 or keep or max_ctx, flags; then the walk's token ids and tap layers);
every follower runs the same seam on its own stage. So all ranks' caches move together, and a
walk's boundaries meet: rank r receives stage r-1's boundary, walks its layers, sends its own on.
A rollback or rewind moves no tensor: each rank restores its planes from its own snapshot of the
cache's last verify walk. Caches the driver drops are freed on the followers with its next command.
A follower that fails sends its report instead of a boundary, so the driver raises it (BackendError)
instead of waiting forever.

The comms and the boundary transport are memra/model/comms.py (NCCL on GPUs, threads in CI). The
bits cannot move: every rank runs the unsplit walk's ops on an exact copy of the boundary.
"""

from __future__ import annotations

import re
import weakref
from collections import deque

import numpy as np

from memra.errors import BackendError, InputError
from memra.model.comms import RankTransport
from memra.model.pipeline import StagedGlm5Model, StageWalks, selection_routes
from memra.model.stages import StagePlan
from memra.model.transport import lanes_for
from memra.model.trunk import Glm5Model, TrunkLayer, VerifyCkpt

NEW, SNAPSHOTS, WALK, ROLLBACK, STOP = range(5)  # a rewind is a rollback to 0 rows
COMMAND_WORDS = 8  # kind, cache id, a, b, c, token count, tap count, freed cache count


class RankedGlm5Model(StagedGlm5Model):
    """Stage `rank` of `plan` in this process; the last rank drives (module docstring)."""

    def __init__(self, cfg, weights: dict, backend, plan: StagePlan, rank: int, comm, device: int | None = None):
        if plan.num_layers != cfg.num_hidden_layers:
            raise InputError(f"the stage plan covers {plan.num_layers} layers but the model has "
                             f"{cfg.num_hidden_layers}; plan the stages for this config")
        if not 0 <= rank < plan.count or comm.world != plan.count:
            raise InputError(f"rank {rank} of {comm.world} processes for {plan.count} stages: run one process "
                             "per stage (WORLD_SIZE = the stage count)")
        self.cfg, self.be, self.placement, self.rank, self.comm = cfg, backend, plan, rank, comm
        last = plan.count - 1
        self.driver = rank == last
        self.lanes = lanes_for(backend, (0 if device is None else device,) * plan.count)
        self.transport = RankTransport(comm, backend, cfg.num_hidden_layers)
        with self.lanes.scope(rank):
            self.first_embed = backend.weight(weights["embed_tokens.weight"]) if rank == 0 else None
            mine = [TrunkLayer(backend, weights, cfg, i) for i in plan.layers(rank)]
        self.stage_layers = [mine if s == rank else [] for s in range(plan.count)]
        self.layers = mine
        self.embed_table = self.lm_head = self.final_norm = self.mtp = None
        if self.driver:
            with self.lanes.scope(rank):
                self._hold_the_head(weights, self.first_embed if rank == 0 else None)
        self.lanes.make_current(rank)
        self.selections_in, self.selections_out = selection_routes(cfg, plan)
        self.caches: dict = {}    # follower: the driver's cache id -> this rank's cache
        self.next_cache = 0       # driver: the id of its next cache
        self.freed = deque()      # driver: ids of dropped caches, freed with the next command
        self.walked = 0           # walks this rank ran its stage of (non-vacuity for tests)

    # ---- the driver's commands ---------------------------------------------------------------
    def _command(self, kind: int, cache=None, a: int = 0, b: int = 0, c: int = 0, tokens=(), taps=()) -> None:
        """Broadcast one command (the driver only; a follower runs its seams as told)."""
        if not self.driver:
            return
        freed = []
        while self.freed:  # a deque: the caches' finalizers may append from any thread
            freed.append(self.freed.popleft())
        words = [kind, -1 if cache is None else cache.rank_id, a, b, c, len(tokens), len(taps), len(freed)]
        self.comm.broadcast(self.be.asarray(np.asarray(words, np.int64), dtype=np.int64), self.rank)
        payload = np.concatenate([np.asarray(tokens, np.int64), np.asarray(taps, np.int64),
                                  np.asarray(freed, np.int64)])
        if payload.size:
            self.comm.broadcast(self.be.asarray(payload, dtype=np.int64), self.rank)

    def close(self) -> None:
        """Release the followers (their serve() returns); the driver's last call."""
        self._command(STOP)

    # ---- seams of the staged model ------------------------------------------------------------
    def new_cache(self, max_ctx: int):
        cache = super().new_cache(max_ctx)  # its planes broadcast NEW with the id it gets here
        if self.driver:
            cache.rank_id, self.next_cache = self.next_cache, self.next_cache + 1
            weakref.finalize(cache, self.freed.append, cache.rank_id)
        return cache

    def _new_walks(self):
        return StageWalks(self.be.walks() for _ in range(self.placement.count))

    def _new_planes(self, cache, layers) -> None:
        self._command(NEW, None, a=cache.max_ctx, b=self.next_cache)
        super()._new_planes(cache, layers)

    def _new_snapshots(self, layers, cache) -> None:
        self._command(SNAPSHOTS, cache)
        super()._new_snapshots(layers, cache)

    def _rollback_layers(self, layers, cache, ckpt, keep: int) -> None:
        self._command(ROLLBACK, cache, a=keep)
        super()._rollback_layers(layers, cache, ckpt, keep)

    def _run_walk(self, tokens, cache, snapshots: bool, tap_layers: tuple, replay: bool):
        """This rank's turn of the walk (the stages before it and after it run on their ranks)."""
        self._command(WALK, cache, a=cache.pos, b=int(snapshots), c=int(replay), tokens=tokens, taps=tap_layers)
        out, taps = self._stage_turn(self.rank, tokens, cache, snapshots, tap_layers, replay)
        self.walked += 1
        logits, collapsed = out if self.driver else (None, None)
        return logits, collapsed, taps

    # ---- a follower ------------------------------------------------------------------------------
    def serve(self) -> None:
        """Run the driver's commands on this rank's stage until it closes. A failure here (or
        one a rank before reported) is passed on instead of a boundary in that walk and every
        later one, so the driver raises it rather than waiting forever; this rank's own failure
        is raised again when the driver closes."""
        if self.driver:
            raise InputError("serve() runs on the ranks before the last; the last rank drives the model")
        root = self.placement.count - 1
        failed, own = None, None  # (failing rank, its message) once a failure is known; this rank's own
        while True:
            words = self.be.zeros(COMMAND_WORDS, dtype=np.int64)
            self.comm.broadcast(words, root)
            kind, cid, a, b, c, n_tokens, n_taps, n_freed = (int(v) for v in self.be.to_host(words))
            payload = np.zeros(0, np.int64)
            if n_tokens + n_taps + n_freed:
                buf = self.be.zeros(n_tokens + n_taps + n_freed, dtype=np.int64)
                self.comm.broadcast(buf, root)
                payload = np.asarray(self.be.to_host(buf))
            for gone in payload[n_tokens + n_taps:]:
                self.caches.pop(int(gone), None)
            if kind == STOP:
                if own is not None:
                    raise own
                return
            taken = self.transport.received
            if failed is None:
                try:
                    self._follow(kind, cid, a, b, c, payload[:n_tokens],
                                 tuple(int(t) for t in payload[n_tokens:n_tokens + n_taps]))
                    continue
                except BackendError as exc:
                    if not hasattr(exc, "report"):
                        raise
                    failed = exc.report  # a rank before this one failed: pass its report on
                except Exception as exc:
                    failed, own = (self.rank, f"{type(exc).__name__}: {exc}"), exc
            if kind == WALK:
                if self.rank and self.transport.received == taken:
                    try:  # the rank before sent this walk's boundary: take it, so its send completes
                        self.transport.recv(self.rank)
                    except BackendError:
                        pass
                self.transport.send_failure(self.rank, *failed)

    def _follow(self, kind: int, cid: int, a: int, b: int, c: int, tokens, taps: tuple) -> None:
        if kind == NEW:
            self.caches[b] = Glm5Model.new_cache(self, a)
            return
        cache = self.caches[cid]
        if kind == SNAPSHOTS:
            super()._new_snapshots(self.layers, cache)
        elif kind == WALK:
            cache.pos = a
            if b:  # what this rank's rollback and rewind of the walk need: its own planes' lengths
                cache.last_ckpt = VerifyCkpt(cache=cache, pos=a, rows=len(tokens), taps={},
                                             latent_len={i: plane.length for i, plane in cache.mla.items()})
            self.forward_rows(tokens, cache, snapshots=bool(b), taps={t: None for t in taps} or None,
                              replay=bool(c))
        elif kind == ROLLBACK:
            ckpt = cache.last_ckpt
            super()._rollback_layers(self.layers, cache, ckpt, a)
            cache.pos = ckpt.pos + a


def stage_tensors(cfg, plan: StagePlan, rank: int):
    """The canonical tensor names rank `rank` holds (load_checkpoint's `only`): its layers'; the
    embedding on the first rank; the final norm, lm head, MTP block and embedding on the last."""
    last = plan.count - 1
    mine = set(plan.layers(rank)) | ({cfg.num_hidden_layers} if rank == last else set())

    def keep(name: str) -> bool:
        layer = re.match(r"layers\.(\d+)\.", name)
        if layer is not None:
            return int(layer.group(1)) in mine
        if name.startswith("embed_tokens."):
            return rank in (0, last)
        return rank == last  # norm, lm_head

    return keep
