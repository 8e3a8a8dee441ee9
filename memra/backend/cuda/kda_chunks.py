"""A prompt's delta-rule scan in chunks (prime class; kernels_cu/kda_chunks.cu).

A walk of more than VERIFY_CAP rows is a prefill (DESIGN.md section 2): accuracy, not row
invariance. The row walk's t dependent steps per head become t / KDA_CHUNK: a prep launch builds
each chunk's state-free pieces (the in-chunk solve) for all chunks at once, then a scan launch
walks the chunks with the state in registers. Numpy twin: NumpyBackend.kda_chunks.

    o = prime_kda(q, k, v, g, beta, state)   # float32 cupy; state [Hk, dk, dv] advances in place
"""

from __future__ import annotations

import cupy as cp

from memra.backend.cuda.runtime import BLOCK, check, i32, kernel, launch, opt_in
from memra.backend.cuda.streams import fork, join, recorded
from memra.kernels_cu.constants import KDA_CHUNK, KDA_CHUNK_MAX_DK, KDA_SCAN_KEYS

SCRATCH_BYTES = 1 << 28  # the pieces of the two spans of chunks in flight (a 4096-row bench prompt: 5 spans)
TILE = 32                # value columns per scan block (kda_chunks.cu)
SCAN_THREADS = 32 * KDA_CHUNK_MAX_DK // KDA_SCAN_KEYS  # a warp per KDA_SCAN_KEYS keys
# the scan's two stages of one chunk's pieces (kda_chunks.cu STAGE_FLOATS): W, Qtil, Khat rows,
# U0 columns, Qm, decay; over the 48 KB default, so the kernel is given the room explicitly
SCAN_SHARED = 2 * 4 * (3 * KDA_CHUNK * KDA_CHUNK_MAX_DK + KDA_CHUNK * TILE + KDA_CHUNK ** 2 + KDA_CHUNK_MAX_DK)


def kda_shapes(what: str, q, k, v, g, beta, state) -> tuple[int, int, int, int]:
    """(t, Hk, dk, dv) of a delta-rule call, every operand checked: float32, C-contiguous,
    shapes that agree."""
    for a, name in ((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta"), (state, "state")):
        check(a, cp.float32, name)
    t, hk, dk = q.shape
    dv = v.shape[2]
    assert k.shape == g.shape == (t, hk, dk) and v.shape == (t, hk, dv) and beta.shape == (t, hk), (
        f"{what}: q {q.shape} k {k.shape} v {v.shape} g {g.shape} beta {beta.shape}")
    assert state.shape == (hk, dk, dv), f"{what}: state {state.shape}, expected {(hk, dk, dv)}"
    return t, hk, dk, dv


def prime_kda(q, k, v, g, beta, state):
    """kda_recurrence over t rows in chunks: q, k, g [t, Hk, dk], v [t, Hk, dv], beta [t, Hk],
    C-contiguous float32; returns o [t, Hk, dv]. dk <= KDA_CHUNK_MAX_DK.

    Spans of chunks go through two scratch sets: while the "chunks" side stream (high
    priority: its blocks are placed first) scans span i, the main stream preps span i + 1 into
    the other set, once span i - 1's scan is done reading it. The prep does not read the state,
    and the scan, a block per 32 value columns of a head, leaves most of each SM to it."""
    t, hk, dk, dv = kda_shapes("prime_kda", q, k, v, g, beta, state)
    assert dk <= KDA_CHUNK_MAX_DK, f"prime_kda: dk={dk}, at most {KDA_CHUNK_MAX_DK} (raise KDA_CHUNK_MAX_DK)"
    out = cp.empty((t, hk, dv), cp.float32)
    chunks = -(-t // KDA_CHUNK)
    if not chunks:
        return out
    per_chunk = 4 * hk * KDA_CHUNK * (3 * dk + dv + KDA_CHUNK + 1)  # bytes: w, qtil, khat; u0; qm; decay
    span = max(1, min(chunks, SCRATCH_BYTES // (2 * per_chunk)))
    starts = range(0, chunks, span)
    sets = [_scratch(span, hk, dk, dv) for _ in starts[:2]]
    opt_in(kernel("kda_chunks", "kda_chunk_scan"), SCAN_SHARED)
    main, side = fork("chunks")
    scanned = []
    try:  # joined however the loop ends: the main stream never runs on past the side's scans
        for i, c0 in enumerate(starts):
            if i >= 2:  # span i's prep goes into the set span i - 2's scan reads
                main.wait_event(scanned[i - 2])
            nc = min(span, chunks - c0)
            _prep(q, k, v, g, beta, sets[i % 2], c0, nc, t, hk, dk, dv)
            prepped = recorded(main)
            with side:
                side.wait_event(prepped)
                _scan(sets[i % 2], state, out, c0, nc, t, hk, dk, dv)
                scanned.append(recorded(side))
    finally:
        join(main, side)
    return out


def _scratch(span: int, hk: int, dk: int, dv: int) -> tuple:
    """One span's pieces in the kernels' argument order: w [span, Hk, C, dk], u0 [span, Hk, C, dv],
    qm [span, Hk, C, C], qtil and khat [span, Hk, C, dk], decay [span, Hk, dk]."""
    w, qtil, khat = (cp.empty((span, hk, KDA_CHUNK, dk), cp.float32) for _ in range(3))
    return (w, cp.empty((span, hk, KDA_CHUNK, dv), cp.float32), cp.empty((span, hk, KDA_CHUNK, KDA_CHUNK), cp.float32),
            qtil, khat, cp.empty((span, hk, dk), cp.float32))


def _prep(q, k, v, g, beta, pieces, c0: int, nc: int, t: int, hk: int, dk: int, dv: int) -> None:
    launch("kda_chunks", "kda_chunk_prep", (nc, hk), (BLOCK,),
           (q, k, v, g, beta, *pieces, i32(c0 * KDA_CHUNK), i32(t), i32(hk), i32(dk), i32(dv)))


def _scan(pieces, state, out, c0: int, nc: int, t: int, hk: int, dk: int, dv: int) -> None:
    launch("kda_chunks", "kda_chunk_scan", (-(-dv // TILE), hk), (SCAN_THREADS,),
           (*pieces, state, out, i32(c0 * KDA_CHUNK), i32(nc), i32(t), i32(hk), i32(dk), i32(dv)), SCAN_SHARED)

