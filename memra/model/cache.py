"""The state planes of one sequence: what a decode step reads and writes.

* KDA layers: the conv ring (the last K-1 pre-conv inputs) and the recurrent state S.
* DSA layers: the latent plane (one c row per position, append-only, position-addressed) and,
  for layers with their own indexer, the indexer key/gate rows and the finalized pool keys.
  `pools_ready` counts finalized pool keys; it may never exceed floor(length / P) — reading
  past that is the residency tripwire (a `ResidencyError`, never a silent stale read).

`Cache.pos` is the number of committed positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memra.errors import ResidencyError


@dataclass
class KdaPart:
    """The KDA layers of one cache part (a whole trunk, or one pipeline stage): their live rings
    and states side by side, and what a verify walk leaves for its rollback: ring_rows[r], every
    layer's ring before row r of the walk (r < t); marks[:, m], every layer's state after m
    KDA_MARK_ROWS rows of the walk (m = 0: as the walk found it); record, each layer's walked
    rows (k | g | v | beta, kda_record_width floats a head).
    A rollback to keep rows copies ring_rows[keep] and walks each state again from its last mark
    through the recorded rows up to keep, all layers in one launch: the same bits the walk left.
    Why marks and not a state a row: a state is the large plane (Hk dk dv floats a layer;
    GLM-5-Next's 4 MB on each of its KDA layers), so one a row cost VERIFY_CAP of them in memory
    and t of them written every verify walk, where the record is 3 dk + 1 floats a row and head.
    Why marks and not the found state alone: the replay walks rows one after another, so its
    time grows with the rows it walks (bench's 9 layers: about 4 us a row beside a 20 us state
    copy); a mark every KDA_MARK_ROWS rows bounds that walk to KDA_MARK_ROWS - 1 rows for one
    more state written by a walk each KDA_MARK_ROWS rows it passes."""

    layers: tuple               # trunk layer indices, in slot order
    ring: object                # [n, K-1, 3C]
    state: object               # [n, Hk, dk, dv] float32
    ring_rows: object = None    # [VERIFY_CAP, n, K-1, 3C], made by the first verify walk
    marks: object = None        # [n, kda_mark_count(VERIFY_CAP), Hk, dk, dv]
    record: object = None       # [n, VERIFY_CAP, Hk, kda_record_width(dk, dv)]

    def restore(self, keep: int, be) -> None:
        """Every layer back to `keep` rows into the last verify walk (0 <= keep < its t; 0: where
        the walk found them) on backend `be`."""
        be.assign(self.ring, self.ring_rows[keep])
        be.kda_replay(self.record, self.marks, self.state, keep)


@dataclass
class KdaState:
    ring: object   # [K-1, 3C] previous q|k|v projections, oldest first (a view of part.ring)
    state: object  # [Hk, dk, dv] float32 (a view of part.state)
    part: KdaPart = field(default=None, repr=False)
    slot: int = 0  # this layer's index in its part

    def snapshots(self) -> tuple:
        """(ring rows [VERIFY_CAP, K-1, 3C] strided, marks [kda_mark_count(VERIFY_CAP), Hk, dk,
        dv], record [VERIFY_CAP, Hk, width]) of this layer: what its verify walk writes."""
        return self.part.ring_rows[:, self.slot], self.part.marks[self.slot], self.part.record[self.slot]


@dataclass
class LatentPlane:
    """One DSA layer's cache (also used by the MTP block for its own plane)."""

    latent: object                 # [max_ctx, kv_lora]
    index_keys: object = None      # [max_ctx, Di] (layers with an indexer)
    index_gates: object = None     # [max_ctx, Di]
    pool_keys: object = None       # [max_ctx // P, Di]
    length: int = 0
    pools_ready: int = 0

    def check_append(self, pos0: int, name: str) -> None:
        if self.length != pos0:
            raise ResidencyError(
                f"{name}: the latent plane holds {self.length} rows but rows are being written at "
                f"position {pos0}; the plane and the cache position disagree (a missed rollback?)"
            )

    def advance(self, length: int, pool: int) -> None:
        """After a walk wrote rows up to `length`: every pool they complete is finalized."""
        self.length = length
        if self.pool_keys is not None:
            self.pools_ready = length // pool

    def truncate(self, length: int, pool: int) -> None:
        """Shorten the plane to `length` rows; pool keys past floor(length / P) become stale,
        so `pools_ready` is clamped with it (rows are rewritten by position, nothing else)."""
        self.length = length
        if self.pool_keys is not None:
            self.pools_ready = min(self.pools_ready, length // pool)

    def check_residency(self, pool: int, name: str) -> None:
        """The tripwire: finalized pool keys must be exactly the complete pools of the plane.
        Past floor(length / P) they are stale; short of it a walk would score unwritten keys
        (walks finalize only the pools their own rows complete)."""
        if self.pools_ready > self.length // pool:
            raise ResidencyError(
                f"{name}: index_pools_ready={self.pools_ready} but the latent plane holds "
                f"{self.length} rows (at most {self.length // pool} complete pools of {pool}); "
                "pool keys past the plane are stale — a rollback must clamp index_pools_ready "
                "to floor(len / index_kpool)"
            )
        if self.pools_ready < self.length // pool:
            raise ResidencyError(
                f"{name}: index_pools_ready={self.pools_ready} but the latent plane holds "
                f"{self.length} rows ({self.length // pool} complete pools of {pool}); pools were "
                "completed without being finalized — the plane was written outside a walk"
            )

    def check(self, pos0: int, pool: int, name: str) -> None:
        """Before a walk writes at pos0: the plane sits there with its pool keys in step."""
        self.check_append(pos0, name)
        if self.pool_keys is not None:
            self.check_residency(pool, name)


@dataclass
class VerifyCkpt:
    """What `rollback` needs to undo a verify walk down to its first `keep` rows."""

    cache: "Cache"
    pos: int                       # cache.pos before the walk
    rows: int                      # t, the walk's row count
    latent_len: dict[int, int]     # each DSA plane's length before the walk
    taps: dict[int, object] = field(default_factory=dict)  # layer -> contracted rows [t, D]
    spent: bool = False


@dataclass
class Cache:
    config: object  # the ModelConfig of the model that made it
    max_ctx: int
    # The model that made it: a twin with an identical config has other weights, so its planes
    # would be read against the wrong ones. Every walk, rollback and rewind checks `owner is model`.
    owner: object = field(default=None, repr=False)
    kda: dict[int, KdaState] = field(default_factory=dict)
    kda_parts: list[KdaPart] = field(default_factory=list)  # one per part (pipeline stage)
    mla: dict[int, LatentPlane] = field(default_factory=dict)
    pos: int = 0
    walks: object = None  # the backend's walk runner for this cache (CUDA: its captured graphs)

    def check_planes(self) -> None:
        """Every latent plane must sit at `pos` with its pool keys clamped — checked before a walk
        writes anything, so a tripped wire leaves the cache as it was."""
        for layer, plane in self.mla.items():
            plane.check(self.pos, self.config.index_kpool, f"layer {layer}")
