"""Statistics for the sampling tests: an exact chi-square tail, goodness of fit, its power, and
the Philox streams of many seeds computed at once (checked equal to memra's per-call streams)."""

from __future__ import annotations

import math

import numpy as np

from memra.backend.numpy_ref import NumpyBackend
from memra.backend.philox import MASK32, TAG_ACCEPT, TAG_DRAW, philox4x32_10, to_unit
from memra.speculative.sampling import SampleStreams

ALPHA = 1e-4  # per test; at most three tests per test function, so a correct build fails < 1e-3
V = 8


# ---- chi-square, exactly ---------------------------------------------------------------------------
def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, x/2)
    (series below a + 1, Lentz continued fraction above)."""
    if x <= 0:
        return 1.0
    a, x = df / 2.0, x / 2.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= x / (a + n)
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def wilson_hilferty(df: int, z: float) -> float:
    """The Wilson-Hilferty approximation of the chi-square quantile at standard-normal z."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2_power(df: int, lam: float, alpha: float = ALPHA) -> float:
    """P(noncentral chi-square(df, lam) > critical): the Poisson(lam / 2) mixture of central ones."""
    crit = chi2_critical(df, alpha)
    total, weight = 0.0, math.exp(-lam / 2)
    for j in range(int(lam) + 200):
        total += weight * chi2_sf(crit, df + 2 * j)
        weight *= (lam / 2) / (j + 1)
    return total


def gof(counts, probs) -> tuple[float, int]:
    """(chi-square statistic, df) of counts against probs. A count on a zero-probability cell is
    a hard failure; cells with an expected count below 5 are pooled (smallest first)."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    stray = np.flatnonzero((probs <= 0) & (counts > 0))
    assert stray.size == 0, f"tokens {stray.tolist()} have probability 0 but were emitted {counts[stray]}"
    n = counts.sum()
    support = probs > 0
    exp, obs = n * probs[support] / probs[support].sum(), counts[support]
    order = np.argsort(exp, kind="stable")
    exp, obs = exp[order], obs[order]
    cut = int(np.sum(exp < 5))                         # pool every small cell, then grow the
    while 0 < cut < exp.size and exp[:cut].sum() < 5:  # pool until it is not small itself
        cut += 1
    cells_e = ([exp[:cut].sum()] if cut else []) + list(exp[cut:])
    cells_o = ([obs[:cut].sum()] if cut else []) + list(obs[cut:])
    e, o = np.asarray(cells_e), np.asarray(cells_o)
    return float(np.sum((o - e) ** 2 / e)), len(e) - 1


def assert_fits(counts, probs, what: str) -> None:
    stat, df = gof(counts, probs)
    assert_chi2(stat, df, f"{what}: counts {np.asarray(counts).tolist()} vs p {np.round(probs, 4).tolist()}")


def assert_chi2(stat: float, df: int, what: str) -> None:
    if df == 0:
        return
    p_value = chi2_sf(stat, df)
    assert p_value > ALPHA, f"{what}: chi2 = {stat:.1f} on {df} df, p = {p_value:.2e} < {ALPHA}"


def grouped_fit(groups: dict, rows_of, what: str) -> None:
    """Pooled chi-square of several conditional samples: sum of the per-group statistics."""
    stat, df = 0.0, 0
    for key, counts in groups.items():
        s, d = gof(counts, rows_of(key))
        stat, df = stat + s, df + d
    assert_chi2(stat, df, what)


# ---- the Philox streams of many seeds at once -------------------------------------------------------
class StreamTable:
    """uniforms(seed, counter, tag, n) for every seed in `seeds` and counter < `counters`, computed
    in one vectorised Philox call (key varies along the array); entry [s, c] equals memra's
    per-call stream exactly (test_stream_table_is_memras_stream)."""

    def __init__(self, seeds, counters: int, tag: int, n: int):
        seeds = np.asarray(seeds, dtype=np.uint64)
        blocks = (n + 3) // 4
        s, c, b = np.meshgrid(np.arange(seeds.size), np.arange(counters), np.arange(blocks), indexing="ij")
        key, zero = seeds[s], np.zeros(b.shape, np.uint64)
        ctr = (b.astype(np.uint64), c.astype(np.uint64), zero + np.uint64(tag & MASK32), zero)
        out = philox4x32_10(ctr, (key & np.uint64(MASK32), key >> np.uint64(32)))
        w = np.stack(out, axis=-1).reshape(seeds.size, counters, blocks * 4)[..., :n].astype(np.uint32)
        self.u = to_unit(w)
        self.row = {int(v): i for i, v in enumerate(seeds.tolist())}

    def get(self, seed: int, counter: int) -> np.ndarray:
        return self.u[self.row[seed], counter]


class ReplayBackend(NumpyBackend):
    """NumpyBackend with race_draw over a StreamTable: the same numbers through the same race."""

    def __init__(self, draws: StreamTable):
        super().__init__()
        self.draws = draws

    def race_draw(self, probs, seed: int, counter: int, tag: int = TAG_DRAW) -> int:
        p = np.asarray(probs, dtype=np.float64)
        return int(np.argmax(p / -np.log(self.draws.get(seed, counter)[: p.size])))


class ReplayStreams(SampleStreams):
    """SampleStreams whose accept uniforms come from a StreamTable (same numbers as host_u01)."""

    def __init__(self, backend: ReplayBackend, seed: int, accepts: StreamTable):
        super().__init__(backend, seed)
        self.accepts = accepts

    def accept_uniform(self) -> float:
        u = float(self.accepts.get(self.seed, self.uctr)[0])
        self.uctr += 1
        return u


def replay(seeds, draw_counters: int, accept_counters: int, n: int = V):
    """(backend, accepts) replaying the streams of `seeds` on counters below the given bounds."""
    draws = StreamTable(seeds, draw_counters, TAG_DRAW, n)
    return ReplayBackend(draws), StreamTable(seeds, accept_counters, TAG_ACCEPT, 1)
