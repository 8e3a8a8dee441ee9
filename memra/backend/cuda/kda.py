"""The KDA family of the CUDA backend (kernels_cu/kda.cu): short conv, gate, delta-rule recurrence.

Mixin of CudaBackend mirroring NumpyBackend's short_conv / kda_gate / kda_recurrence on cupy
arrays. Exact class: the stateful ops walk the rows in order inside one launch and advance the
ring / state in place, so a t-row call equals t one-row calls bit for bit.

    o = KdaOps().kda_recurrence(q, k, v, g, beta, state)    # float32 cupy arrays
"""

from __future__ import annotations

import numpy as np

import cupy as cp

from memra.backend.cuda.kda_chunks import kda_shapes, prime_kda
from memra.backend.cuda.prime import is_prime, prompt_width
from memra.backend.cuda.runtime import BLOCK, blocks_of, check, columns_grid, device_input, f32, i32, launch
from memra.backend.numpy_kda import kda_mark_count, kda_record_width
from memra.kernels_cu.constants import (KDA_CHUNK_MAX_DK, KDA_COLS, KDA_CONV_LANES, KDA_CONV_SPAN, KDA_GATE_VECTOR,
                                        KDA_MARK_ROWS, KDA_MAX_CONV, KDA_MAX_DK)


def _rows(rows, t: int, shape: tuple, what: str):
    """(pointer or None, row stride in elements) of short_conv's snapshot buffer: rows[r]
    ([*shape], C-contiguous) takes the ring before row r < t; rows may be a strided view."""
    if rows is None:
        return None, np.int64(0)
    assert isinstance(rows, cp.ndarray) and rows.dtype == cp.float32, f"{what}: rows must be float32 cupy"
    assert rows.shape[1:] == shape and rows.shape[0] >= t, (
        f"{what}: rows {rows.shape}, expected [>= {t}, {', '.join(map(str, shape))}]")
    assert rows[0].flags.c_contiguous, f"{what}: each snapshot row must be C-contiguous"
    return rows, np.int64(rows.strides[0] // 4)


class KdaOps:
    def short_conv(self, x, ring, w, rows=None, groups: int = 1):
        """Causal depthwise conv + SiLU over t rows; ring [K-1, C] (oldest first) advances in
        place, so it must already be a C-contiguous float32 device array. rows: see _rows.
        Returns [t, C], or [groups, t, C / groups] (NumpyBackend.short_conv)."""
        x, w = device_input(x, "x"), device_input(w, "w")
        check(ring, cp.float32, "ring")
        t, c = x.shape
        k = w.shape[1]
        assert w.shape == (c, k) and 1 <= k <= KDA_MAX_CONV, f"short_conv: w {w.shape}, C={c}, K<={KDA_MAX_CONV}"
        assert ring.shape == (k - 1, c), f"short_conv: ring {ring.shape}, expected {(k - 1, c)}"
        assert groups >= 1 and c % groups == 0, f"short_conv: {c} channels in {groups} groups"
        out = cp.empty((t, c) if groups == 1 else (groups, t, c // groups), cp.float32)
        snap, stride = _rows(rows, t, (k - 1, c), "short_conv")
        if is_prime(t) and rows is None:  # a prompt: spans of rows in parallel, the same bits
            launch("kda", "short_conv_spans", (blocks_of(c), blocks_of(t, KDA_CONV_SPAN)), (BLOCK,),
                   (x, ring, w, out, i32(t), i32(c), i32(k), i32(c // groups)))
            ring[...] = x[t - (k - 1):]  # t > VERIFY_CAP >= K - 1 rows
        elif t:
            launch("kda", "short_conv", (blocks_of(c, KDA_CONV_LANES),), (BLOCK,),
                   (x, ring, w, out, i32(t), i32(c), i32(k), i32(c // groups), snap, stride))
        return out

    def kda_gate(self, f, a_log, dt_bias, lower_bound):
        """Per-channel log-decay g [t, Hk, dk]; lower_bound None selects the softplus form."""
        f, a_log, dt_bias = device_input(f, "f"), device_input(a_log, "a_log"), device_input(dt_bias, "dt_bias")
        t, hk, dk = f.shape
        assert a_log.shape == (hk,) and dt_bias.shape == (hk, dk), (a_log.shape, dt_bias.shape)
        out = cp.empty((t, hk, dk), cp.float32)
        has_lb = lower_bound is not None
        if t:
            width = prompt_width(t, dk, KDA_GATE_VECTOR, f, dt_bias, out)
            launch("kda", "kda_gate", columns_grid(t, hk * dk // width), (BLOCK,),
                   (f, a_log, dt_bias, out, i32(t), i32(hk), i32(dk), i32(has_lb),
                    f32(lower_bound if has_lb else 0.0), i32(width)))
        return out

    def kda_recurrence(self, q, k, v, g, beta, state, marks=None, record=None):
        """Delta rule over the rows in order; state [Hk, dk, dv] float32 advances in place;
        returns o [t, Hk, dv]. Parallel over (head, value column), never over rows. A verify
        walk also writes marks and record (NumpyBackend.kda_recurrence; C-contiguous float32).
        A prompt (prime class, nothing recorded) takes the chunked scan instead (kda_chunks.py)."""
        q, k, v = device_input(q, "q"), device_input(k, "k"), device_input(v, "v")
        g, beta = device_input(g, "g"), device_input(beta, "beta")
        t, hk, dk, dv = kda_shapes("kda_recurrence", q, k, v, g, beta, state)
        assert dk <= KDA_MAX_DK, f"kda_recurrence: dk={dk}, at most {KDA_MAX_DK} (raise KDA_MAX_DK)"
        if is_prime(t) and marks is None and dk <= KDA_CHUNK_MAX_DK:  # a prompt: the chunked scan
            return prime_kda(q, k, v, g, beta, state)
        out = cp.empty((t, hk, dv), cp.float32)
        width = kda_record_width(dk, dv)
        assert (marks is None) == (record is None), "kda_recurrence: marks and record go together"
        if marks is not None:
            _buffer(marks, "marks", None, hk, dk, dv)
            _buffer(record, "record", None, hk, width)
            assert marks.shape[0] >= kda_mark_count(t) and record.shape[0] >= t, (
                f"marks, record: {marks.shape[0]}, {record.shape[0]} rows for a walk of {t}")
        if t:  # a walk that records is its own kernel, so the decode step's carries none of it
            name, recorded = ((_recurrence(dk), ()) if marks is None else
                              (_recurrence(dk) + "_record", (marks, record, i32(width))))
            launch("kda", name, (hk, blocks_of(dv, KDA_COLS)), (BLOCK,),
                   (q, k, v, g, beta, state, out, i32(t), i32(hk), i32(dk), i32(dv), *recorded))
        return out

    def kda_replay(self, record, marks, state, keep: int) -> None:
        """state[j] = layer j's last mark at or before `keep` rows walked again through record[j]
        up to `keep`, every layer j in one launch (NumpyBackend.kda_replay): the walk's own kernel
        and arithmetic, so its bits."""
        check(state, cp.float32, "state")
        n, hk, dk, dv = state.shape
        width = kda_record_width(dk, dv)
        _buffer(marks, "marks", n, None, hk, dk, dv)
        _buffer(record, "record", n, None, hk, width)
        assert 0 <= keep <= record.shape[1] and keep // KDA_MARK_ROWS < marks.shape[1], (
            f"kda_replay: keep={keep} of {record.shape[1]} recorded rows, {marks.shape[1]} marks")
        if n:
            launch("kda", _recurrence(dk) + "_replay", (hk, blocks_of(dv, KDA_COLS), n), (BLOCK,),
                   (record, marks, state, i32(keep), i32(hk), i32(dk), i32(dv), i32(width), i32(record.shape[1]),
                    i32(marks.shape[1])))


def _recurrence(dk: int) -> str:
    """The recurrence kernel for key dim dk: the keys a thread holds."""
    return "kda_recurrence_k16" if dk <= 128 else "kda_recurrence_k32"


def _buffer(a, what: str, *shape) -> None:
    """A rollback buffer: check()'s C-contiguous float32 array, of `shape` (None: any length there)."""
    check(a, cp.float32, what)
    assert a.ndim == len(shape) and all(want is None or want == got for want, got in zip(shape, a.shape)), (
        f"{what}: {a.shape}, expected {shape}")
