"""The MLA family of the CUDA backend: the DSA kpool indexer (kernels_cu/kpool.cu) and absorbed
attention (kernels_cu/mla.cu).

Mixin of CudaBackend with NumpyBackend's names, signatures and meaning, on cupy arrays:

    positions = MlaOps().kpool_select(q, w, pool_keys, pos0, pool, budget, width, scale)

Exact class: each output's reduction order is fixed by its own row's data; pool selection uses
a strict total order (score, then lower index), so it is deterministic.
"""

from __future__ import annotations

import cupy as cp

from memra.backend.cuda.dense import head_linear
from memra.backend.cuda.prime import is_prime, prime_pool_scores
from memra.backend.cuda.prime_attention import prime_attend, prime_attend_heads
from memra.backend.cuda.runtime import BLOCK, blocks_of, check, f32, i32, kernel, launch, opt_in, position
from memra.kernels_cu.constants import KPOOL_POOLS, MIX_CHANNELS, MIX_SPLIT, MIX_STEP
from memra.limits import LONG_LIST

# mla_scores' register tiles (heads, positions a thread), by list length: a walk takes the wide
# tile when its grid has SCORE_BLOCKS blocks, else the narrow one. Graph-timed at H 64, R 512,
# lists of 2063 entries (us; full / 1400 / 600 valid):
#   t = 1: (1, 1) 21.7 / 18.9 / 11.9, (2, 2) 14.7 / 14.6 / 14.6;
#   t = 2: (1, 1) 42.4 / 32.5 / 19.9, (2, 2) 22.3 / 22.4 / 22.3, (4, 2) 23.2;
#   t = 8: (4, 2) 70.6 / 56.7 / 36.6, (2, 2) 80.2 / 60.7 / 32.4.
# A short list leaves most blocks of a wider tile idle (one block's time is then the kernel's), so
# the narrow tile there is one dot a thread. (2, 2) on short lists from 4 rows was tried: 4 us
# faster at t = 8 and 600 entries, but a 15-row walk of bench-dense at context 512 profiled 53 us
# a call against (4, 2)'s 40. The tile changes no score (each is one serial dot over R, whichever
# thread runs it), so it may follow t and the lists' length.
SCORE_TILES = {True: ((4, 2), (2, 2)), False: ((4, 2), (1, 1))}  # lists of LONG_LIST or more -> (wide, narrow)
SCORE_BLOCKS = 256


def score_tile(t: int, width: int, heads: int, long_lists: bool) -> tuple[int, int]:
    """(TH, TP) of mla_scores_h<TH>p<TP> for t rows of `width` entries and `heads` heads;
    long_lists: every row's list holds at least LONG_LIST positions."""
    wide, narrow = SCORE_TILES[bool(long_lists)]
    th, tp = wide
    return wide if t * blocks_of(width, 16 * tp) * blocks_of(heads, 16 * th) >= SCORE_BLOCKS else narrow


def score_launches(t: int, width: int, heads: int) -> list[tuple[int, int, int]]:
    """(TH, TP, guard) of each mla_scores launch. Whether the lists are long is read on the device
    (mla.cu guard_passes), not passed in, so one captured walk serves every position: where the
    two classes take different tiles both are launched, guarded by +-LONG_LIST, and one returns
    at once (a walk crossing LONG_LIST used to be captured again mid-stream, some 36 ms on bench)."""
    short, long = score_tile(t, width, heads, False), score_tile(t, width, heads, True)
    if short == long or width < LONG_LIST:
        return [(*short, 0)]
    return [(*short, -LONG_LIST), (*long, LONG_LIST)]


class MlaOps:
    _mix_split = MIX_SPLIT  # list entries per mla_mix partial: a size, the same for every t

    def kpool_compress(self, keys, gates, ape):
        """Pool keys [npool, Di] from keys, gates [npool, P, Di] and ape [P, Di]."""
        check(keys, cp.float32, "keys")
        check(gates, cp.float32, "gates")
        check(ape, cp.float32, "ape")
        npool, pool, di = keys.shape
        assert gates.shape == keys.shape, f"gates {gates.shape} != keys {keys.shape}"
        assert ape.shape == (pool, di), f"ape {ape.shape} != {(pool, di)}"
        out = cp.empty((npool, di), cp.float32)
        if npool * di:
            launch("kpool", "kpool_compress", (blocks_of(npool * di),), (BLOCK,),
                   (keys, gates, ape, out, i32(npool), i32(pool), i32(di)))
        return out

    def kpool_finalize(self, keys, gates, ape, pool_keys, at, t: int):
        """Write the pool keys of the pools that plane rows at..at+t-1 complete (see NumpyBackend);
        keys, gates [rows, Di] are the plane's own key and gate rows, pool_keys [rows // P + 1, Di]."""
        for name, a in (("keys", keys), ("gates", gates), ("ape", ape), ("pool_keys", pool_keys)):
            check(a, cp.float32, name)
        pool, di = ape.shape
        assert keys.shape == gates.shape and keys.shape[1] == di, f"keys {keys.shape}, gates {gates.shape}"
        assert pool_keys.shape == (keys.shape[0] // pool + 1, di), f"pool_keys {pool_keys.shape}"
        if t:
            launch("kpool", "kpool_finalize", (blocks_of((t // pool + 1) * di),), (BLOCK,),
                   (keys, gates, ape, pool_keys, position(at), i32(t), i32(pool), i32(di)))

    def kpool_select(self, q, w, pool_keys, pos0, pool: int, budget: int, width: int,
                     scale: float):
        """Attended positions [t, width] int32, ascending, -1 padded (see NumpyBackend). `pos0`
        is a host int or the walk's device position; every launch is sized by the pool keys the
        plane can hold, not by the position, so a captured walk stays valid as the cache grows."""
        check(q, cp.float32, "q")
        check(w, cp.float32, "w")
        check(pool_keys, cp.float32, "pool_keys")
        t, hi, di = q.shape
        assert w.shape == (t, hi), f"w {w.shape} != {(t, hi)}"
        assert pool_keys.ndim == 2 and pool_keys.shape[1] == di, f"pool_keys {pool_keys.shape}"
        assert pool >= 1 and budget >= 1, f"pool {pool} and budget {budget} must be >= 1"
        assert width >= (budget + 1) * pool - 1, (
            f"width {width} < budget*pool + pool - 1 = {(budget + 1) * pool - 1}")
        nmax = pool_keys.shape[0]
        if not isinstance(pos0, cp.ndarray):
            assert nmax >= (pos0 + t) // pool, f"pool_keys has {nmax} rows < {(pos0 + t) // pool}"
        out = cp.empty((t, width), cp.int32)
        if t == 0:
            return out
        at = position(pos0)
        if is_prime(t) and nmax:  # a prompt: float32 GEMMs (prime.py)
            scores = prime_pool_scores(q, w, pool_keys, scale)
        else:
            scores = cp.empty((t, max(nmax, 1)), cp.float32)
            staged = 4 * (hi * (di + 1) + KPOOL_POOLS * hi)  # the row's q, padded, and the pools' terms
            opt_in(kernel("kpool", "kpool_scores"), staged)
            launch("kpool", "kpool_scores", (blocks_of(max(nmax, 1), KPOOL_POOLS), t), (BLOCK,),
                   (q, w, pool_keys, scores, at, i32(pool), i32(budget), i32(hi), i32(di),
                    i32(max(nmax, 1)), f32(scale)), shared_mem=staged)
        launch("kpool", "kpool_select", (t,), (BLOCK,),
               (scores, out, at, i32(pool), i32(budget), i32(width), i32(max(nmax, 1))))
        return out

    def mla_attention(self, q, latent, positions, w_uk_t, w_uv, scale: float):
        """o [t, H, dv] = W_UV[h] mla_attend(W_UK[h]^T q[h]) for per-head queries q [t, H, dn],
        w_uk_t [H, R, dn], w_uv [H, dv, R]. A prompt whose per-head keys and values are narrower
        than the latent (dn + dv < 2 R) attends per head instead (prime_attend_heads): fewer products."""
        check(q, cp.float32, "q")
        t, h, dn = q.shape
        rank, dv = w_uk_t.shape[1], w_uv.shape[1]
        assert w_uk_t.shape == (h, rank, dn) and w_uv.shape == (h, dv, rank), \
            f"w_uk_t {w_uk_t.shape}, w_uv {w_uv.shape} for q {q.shape}"
        if is_prime(t) and dn + dv < 2 * rank and h * positions.shape[1]:
            check(latent, cp.float32, "latent")
            check(positions, cp.int32, "positions")
            out = prime_attend_heads(q, latent, positions, w_uk_t, w_uv, scale)
            if out is not None:
                return out
        return head_linear(self.mla_attend(head_linear(q, w_uk_t), latent, positions, scale), w_uv)

    def mla_attend(self, q_lat, latent, positions, scale: float):
        """o_lat [t, H, R] = sum_j softmax_j(scale q_lat . c_j) c_j over each row's positions."""
        check(q_lat, cp.float32, "q_lat")
        check(latent, cp.float32, "latent")
        check(positions, cp.int32, "positions")
        t, h, rank = q_lat.shape
        assert latent.ndim == 2 and latent.shape[1] == rank, f"latent {latent.shape}"
        assert positions.ndim == 2 and positions.shape[0] == t, f"positions {positions.shape}"
        width = positions.shape[1]
        if t * h * width == 0:  # an empty list attends nothing
            return cp.zeros((t, h, rank), cp.float32)
        if is_prime(t):  # a prompt: dense float32 GEMMs under the selection's mask (prime.py)
            return prime_attend(q_lat, latent, positions, scale)
        out = cp.empty((t, h, rank), cp.float32)
        probs = cp.empty((t * h, width), cp.float32)
        for th, tp, guard in score_launches(t, width, h):
            launch("mla", f"mla_scores_h{th}p{tp}", (blocks_of(width, 16 * tp), t, blocks_of(h, 16 * th)),
                   (BLOCK,),
                   (q_lat, latent, positions, probs, i32(h), i32(rank), i32(width), f32(scale), i32(guard)))
        launch("mla", "mla_softmax", (t * h,), (BLOCK,), (probs, positions, i32(h), i32(width)))
        split = self._mix_split
        assert 0 < split <= MIX_SPLIT and split % MIX_STEP == 0, f"mix split {split}"
        nsplit = blocks_of(width, split)
        part, filled = cp.empty((t, nsplit, h, rank), cp.float32), cp.empty((t, nsplit), cp.int32)
        launch("mla", "mla_mix", (blocks_of(rank, MIX_CHANNELS), nsplit, t), (BLOCK,),
               (probs, latent, positions, part, filled, i32(h), i32(rank), i32(width), i32(split)))
        launch("mla", "mla_mix_combine", (blocks_of(t * h * rank),), (BLOCK,),
               (part, filled, out, i32(t), i32(h), i32(rank), i32(nsplit)))
        return out
