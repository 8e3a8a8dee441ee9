"""The KDA ops of the numpy reference backend: the causal short conv with its ring, the per-channel
decay gate, and the delta-rule recurrence with its state (research/kda.md). A mixin of
NumpyBackend (numpy_ref.py), whose silu and sigmoid it uses; the CUDA twins are in
backend/cuda/kda.py. The stateful ops walk the rows in order and advance the ring / state in
place, so a t-row call is t one-row calls. For a verify walk's rollback or rewind, short_conv
leaves the ring before each row (`rows`) and kda_recurrence its state every KDA_MARK_ROWS rows
and each row's inputs (`marks`, `record`), which kda_replay walks again from the last mark up to
the rows kept.
"""

from __future__ import annotations

import numpy as np

from memra.kernels_cu.constants import KDA_CHUNK, KDA_MARK_ROWS

F32 = np.float32


def kda_record_width(dk: int, dv: int) -> int:
    """Floats of one (row, head) of a recorded walk: its k, g (before exp), v and beta, in that order."""
    return 2 * dk + dv + 1


def kda_mark_count(rows: int) -> int:
    """States a recorded walk of up to `rows` rows keeps: after 0, M, 2M, ... rows (M = KDA_MARK_ROWS)
    while rows remain after them (a rollback keeps fewer rows than the walk had)."""
    return (max(rows, 1) - 1) // KDA_MARK_ROWS + 1


class NumpyKdaOps:
    def short_conv(self, x: np.ndarray, ring: np.ndarray, w: np.ndarray, rows=None, groups: int = 1) -> np.ndarray:
        """Causal depthwise conv + SiLU over t rows; ring [K-1, C] holds the previous inputs
        (oldest first) and is advanced in place. w [C, K]; tap K-1 meets the current row.
        rows [>= t, K-1, C] (optional): rows[r] = the ring before row r, for r < t.
        Returns [t, C], or with groups g > 1 [g, t, C / g]: each group of channels' rows on
        their own (KDA's q, k and v, each then contiguous)."""
        k = w.shape[1]
        out = np.empty_like(x)
        for r in range(x.shape[0]):
            if rows is not None:
                rows[r] = ring
            acc = w[:, 0] * (ring[0] if k > 1 else x[r])
            for j in range(1, k):
                src = ring[j] if j < k - 1 else x[r]
                acc = acc + w[:, j] * src
            out[r] = self.silu(acc)
            if k > 1:
                ring[:-1] = ring[1:]
                ring[-1] = x[r]
        if groups == 1:
            return out
        return np.ascontiguousarray(out.reshape(x.shape[0], groups, -1).transpose(1, 0, 2))

    def kda_gate(self, f: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray, lower_bound) -> np.ndarray:
        """Per-channel log-decay g: f [t, Hk, dk], a_log [Hk], dt_bias [Hk, dk]."""
        z = f + dt_bias
        rate = np.exp(a_log)[:, None]
        if lower_bound is not None:
            return (F32(lower_bound) * self.sigmoid(rate * z)).astype(F32)
        soft = np.where(z > 20, z, np.log1p(np.exp(np.minimum(z, 20))))
        return (-rate * soft).astype(F32)

    def kda_recurrence(self, q, k, v, g, beta, state: np.ndarray, marks=None, record=None) -> np.ndarray:
        """Delta rule, rows in order, state [Hk, dk, dv] advanced in place; returns o [t, Hk, dv].
        A verify walk (marks and record, or neither) also leaves its state after m KDA_MARK_ROWS
        rows in marks[m] [>= kda_mark_count(t), Hk, dk, dv] (marks[0]: the state it found) and
        each row's k | g | v | beta in record [>= t, Hk, kda_record_width] (rows past t, and
        marks past kda_mark_count(t), untouched): what kda_replay needs for a rollback.

        S <- S * exp(g)[:, None]; S += k (x) beta (v - S^T k); o = S^T q.
        """
        t, hk, dk = q.shape
        if marks is not None:
            marks[0] = state
            record[:t] = np.concatenate((k, g, v, beta[..., None]), axis=2)
        out = np.empty((t, hk, v.shape[2]), F32)
        for r in range(t):
            for h in range(hk):
                s = state[h] * np.exp(g[r, h])[:, None]
                delta = (v[r, h] - k[r, h] @ s) * beta[r, h]
                s = s + np.outer(k[r, h], delta)
                state[h] = s
                out[r, h] = q[r, h] @ s
            if marks is not None and (r + 1) % KDA_MARK_ROWS == 0 and r + 1 < t:
                marks[(r + 1) // KDA_MARK_ROWS] = state
        return out

    def kda_replay(self, record, marks, state: np.ndarray, keep: int) -> None:
        """Layers side by side (marks [n, >= 1 + keep // M, Hk, dk, dv], M = KDA_MARK_ROWS; state
        [n, Hk, dk, dv]; record [n, >= keep, Hk, width]): state[j] = layer j's last mark at or
        before `keep` rows walked again through the recorded rows from there to `keep`, the state
        the recorded walk left after them, bit for bit (fewer than M rows walked)."""
        dk, dv = marks.shape[3], marks.shape[4]
        mark = keep // KDA_MARK_ROWS
        for j in range(marks.shape[0]):
            rows = np.ascontiguousarray(record[j, mark * KDA_MARK_ROWS:keep])
            k, g, v = rows[..., :dk], rows[..., dk:2 * dk], rows[..., 2 * dk:2 * dk + dv]
            s = marks[j, mark].copy()
            self.kda_recurrence(k, k, v, g, rows[..., 2 * dk + dv], s)
            state[j] = s

    def kda_chunks(self, q, k, v, g, beta, state: np.ndarray, chunk: int = KDA_CHUNK) -> np.ndarray:
        """kda_recurrence for a prompt (prime class) in chunks of `chunk` rows, the chunked
        scan's math in float32 (the CUDA twin: backend/cuda/kda_chunks.py). Same contract;
        equal to the row walk up to rounding, not bit for bit."""
        t, hk, _ = q.shape
        out = np.empty((t, hk, v.shape[2]), F32)
        heads = lambda a: np.ascontiguousarray(np.moveaxis(a, 0, 1))  # [n, Hk, ...] -> [Hk, n, ...]
        for r0 in range(0, t, chunk):
            rows = slice(r0, r0 + chunk)
            pieces = chunk_pieces(*(heads(a[rows]) for a in (q, k, v, g, beta)))
            out[rows] = np.moveaxis(chunk_step(pieces, state), 1, 0)
        return out


def chunk_pieces(q, k, v, g, beta) -> dict:
    """The S0-free pieces of one chunk, per head (kda_chunks.cu's prep kernel): q, k, g [Hk, n, dk],
    v [Hk, n, dv], beta [Hk, n]. With G the in-chunk cumulative sum of g, every exponent is a
    difference G_r - G_j (r >= j) or -G, so no factor exceeds 1.

      A[r, j] = beta_r sum_d k_r k_j exp(G_r - G_j) (j < r);  (I + A) X = diag(beta) B
      W = X for B = exp(G) k;  U0 = X for B = v      (so the chunk's u = U0 - W S0)
      Qm[r, j] = sum_d q_r k_j exp(G_r - G_j) (j <= r);  Qtil = exp(G) q
      Khat_j = exp(G_last - G_j) k_j;  decay = exp(G_last)
    """
    hi, lo = cumulative_log_decay(g)
    diff = (hi[:, :, None, :] - hi[:, None, :, :]) + (lo[:, :, None, :] - lo[:, None, :, :])  # [Hk, r, j, dk]
    lower = np.tril(np.ones(diff.shape[1:3], bool))
    kj = np.where(lower[..., None], np.exp(np.minimum(diff, F32(0))), F32(0)) * k[:, None, :, :]
    a = np.einsum("hrd,hrjd->hrj", k, kj) * beta[:, :, None] * ~np.eye(lower.shape[0], dtype=bool)
    qm = np.einsum("hrd,hrjd->hrj", q, kj)
    decayed = np.exp(hi) * (F32(1) + lo)  # exp(G): exp(hi) is accurate for any |hi|, lo tiny
    w = chunk_solve(a.astype(F32), beta, decayed * k)
    u0 = chunk_solve(a.astype(F32), beta, v)
    last = diff[:, -1]                       # G_last - G_j
    return {"w": w, "u0": u0, "qm": qm.astype(F32), "qtil": (decayed * q).astype(F32),
            "khat": (np.exp(last) * k).astype(F32), "decay": decayed[:, -1]}


def cumulative_log_decay(g):
    """G = the cumulative sum of g [Hk, n, dk] over the rows as hi + lo (Knuth's two-sum): a
    difference G_r - G_j then keeps float32 accuracy relative to itself, not to |G| (a row of
    strong decay followed by weak ones would otherwise lose ulp(|G|) in every later factor)."""
    hi, lo = np.empty_like(g), np.empty_like(g)
    acc, err = np.zeros_like(g[:, 0]), np.zeros_like(g[:, 0])
    for r in range(g.shape[1]):
        total = acc + g[:, r]
        back = total - acc
        err = err + ((acc - (total - back)) + (g[:, r] - back))
        acc = total
        hi[:, r], lo[:, r] = acc, err
    return hi, lo


def chunk_solve(a, beta, b):
    """X with (I + A) X = diag(beta) B, A strictly lower [Hk, n, n]: forward substitution,
    X_r = beta_r B_r - sum_{j<r} A[r, j] X_j."""
    x = np.zeros(b.shape, F32)
    for r in range(b.shape[1]):
        x[:, r] = beta[:, r, None] * b[:, r] - np.einsum("hj,hjc->hc", a[:, r, :r], x[:, :r])
    return x


def chunk_step(p: dict, state: np.ndarray) -> np.ndarray:
    """One chunk of the scan (kda_chunks.cu's scan kernel): o [Hk, n, dv] from the state S0 at the
    chunk's start; state [Hk, dk, dv] advances to its end in place."""
    u = p["u0"] - p["w"] @ state
    o = p["qtil"] @ state + p["qm"] @ u
    state[...] = p["decay"][:, :, None] * state + np.swapaxes(p["khat"], 1, 2) @ u
    return o
