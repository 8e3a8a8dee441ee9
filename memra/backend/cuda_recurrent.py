"""The recurrent op family of the CUDA backend: mHC stream mixing and the KDA mixer.

Mixin of CudaBackend (see cuda.py); the methods mirror NumpyBackend's hc_* / stream_mean /
short_conv / kda_gate / kda_recurrence (same names, signatures and meaning, on cupy arrays),
launching kernels_cu/hyper.cu and kernels_cu/kda.cu. Self-sufficient: it calls no other mixin.

Exact class. The stateful ops (short_conv, kda_recurrence) walk the rows in order inside one
launch and advance the ring / state in place, so a t-row call equals t one-row calls bit for bit.
Usage: `RecurrentOps().kda_recurrence(q, k, v, g, beta, state)` with float32 cupy arrays.
"""

from __future__ import annotations

import cupy as cp

from memra.backend.cuda_runtime import BLOCK, check, f32, i32, launch

WARPS = BLOCK // 32
HC_MAX_N = 8  # hyper.cu HC_MAX_N
HC_CHUNK = BLOCK * 8  # hyper.cu HC_CHUNK: flattened stream elements per hc_partials block
CONV_MAX_K = 16  # kda.cu KDA_MAX_CONV
KDA_MAX_DK = 256  # kda.cu KDA_MAX_DK


def _input(a, name: str):
    """A read-only float32 input. Strided views (v is sliced out of the conv output) are copied
    to C order, which changes no value; host arrays and other dtypes are refused."""
    assert isinstance(a, cp.ndarray), f"{name}: expected a cupy array, got {type(a).__name__}"
    return check(cp.ascontiguousarray(a), cp.float32, name)


def _grid(total: int) -> tuple[int]:
    return ((total + BLOCK - 1) // BLOCK,)


class RecurrentOps:
    # ---- mHC ----------------------------------------------------------------------------------
    def hc_weights(self, streams, fn, base, scale, rms_eps: float, hc_eps: float, iters: int):
        """(pre [t, n], post [t, n], comb [t, n, n]): fixed chunks of the flattened streams
        spread the fn matvec over blocks, then one small block per row adds them up in order."""
        streams = _input(streams, "streams")
        t, n, d = streams.shape
        assert 1 <= n <= HC_MAX_N, f"hc_weights: n={n} streams, at most {HC_MAX_N}"
        assert iters >= 1, f"hc_weights: iters={iters}, at least 1"
        fn, base, scale = _input(fn, "fn"), _input(base, "base"), _input(scale, "scale")
        assert fn.shape == ((2 + n) * n, n * d), f"hc_weights: fn {fn.shape}, n={n}, D={d}"
        assert base.shape == ((2 + n) * n,) and scale.shape == (3,), (base.shape, scale.shape)
        pre, post = cp.empty((t, n), cp.float32), cp.empty((t, n), cp.float32)
        comb = cp.empty((t, n, n), cp.float32)
        if t:
            chunks = (n * d + HC_CHUNK - 1) // HC_CHUNK
            part = cp.empty((t, chunks, (2 + n) * n + 1), cp.float32)
            launch("hyper", "hc_partials", (chunks, t), (BLOCK,), (streams, fn, part, i32(n), i32(d)))
            launch("hyper", "hc_weights", (t,), (HC_MAX_N * HC_MAX_N,),
                   (part, base, scale, pre, post, comb, i32(n), i32(d), i32(chunks), f32(rms_eps),
                    f32(hc_eps), i32(iters)))
        return pre, post, comb

    def hc_collapse(self, streams, pre):
        """sum_i pre_i X_i in stream order: [t, n, D] -> [t, D]."""
        streams, pre = _input(streams, "streams"), _input(pre, "pre")
        t, n, d = streams.shape
        assert pre.shape == (t, n), f"hc_collapse: pre {pre.shape}, expected {(t, n)}"
        out = cp.empty((t, d), cp.float32)
        if t:
            launch("hyper", "hc_collapse", _grid(t * d), (BLOCK,),
                   (streams, pre, out, i32(t), i32(n), i32(d)))
        return out

    def hc_combine(self, streams, f, post, comb):
        """X'_b = post_b f + sum_a C[a, b] X_a (C transposed), a ascending."""
        streams, f = _input(streams, "streams"), _input(f, "f")
        post, comb = _input(post, "post"), _input(comb, "comb")
        t, n, d = streams.shape
        assert f.shape == (t, d) and post.shape == (t, n) and comb.shape == (t, n, n), (
            f"hc_combine: f {f.shape}, post {post.shape}, comb {comb.shape} for streams {streams.shape}")
        out = cp.empty((t, n, d), cp.float32)
        if t:
            launch("hyper", "hc_combine", _grid(t * n * d), (BLOCK,),
                   (streams, f, post, comb, out, i32(t), i32(n), i32(d)))
        return out

    def stream_mean(self, streams):
        streams = _input(streams, "streams")
        t, n, d = streams.shape
        out = cp.empty((t, d), cp.float32)
        if t:
            launch("hyper", "stream_mean", _grid(t * d), (BLOCK,), (streams, out, i32(t), i32(n), i32(d)))
        return out

    # ---- KDA ------------------------------------------------------------------------------------
    def short_conv(self, x, ring, w):
        """Causal depthwise conv + SiLU over t rows; ring [K-1, C] (oldest first) advances in
        place, so it must already be a C-contiguous float32 device array."""
        x, w = _input(x, "x"), _input(w, "w")
        check(ring, cp.float32, "ring")
        t, c = x.shape
        k = w.shape[1]
        assert w.shape == (c, k) and 1 <= k <= CONV_MAX_K, f"short_conv: w {w.shape}, C={c}, K<={CONV_MAX_K}"
        assert ring.shape == (k - 1, c), f"short_conv: ring {ring.shape}, expected {(k - 1, c)}"
        out = cp.empty((t, c), cp.float32)
        if t:
            launch("kda", "short_conv", _grid(c), (BLOCK,), (x, ring, w, out, i32(t), i32(c), i32(k)))
        return out

    def kda_gate(self, f, a_log, dt_bias, lower_bound):
        """Per-channel log-decay g [t, Hk, dk]; lower_bound None selects the softplus form."""
        f, a_log, dt_bias = _input(f, "f"), _input(a_log, "a_log"), _input(dt_bias, "dt_bias")
        t, hk, dk = f.shape
        assert a_log.shape == (hk,) and dt_bias.shape == (hk, dk), (a_log.shape, dt_bias.shape)
        out = cp.empty((t, hk, dk), cp.float32)
        has_lb = lower_bound is not None
        if t:
            launch("kda", "kda_gate", _grid(t * hk * dk), (BLOCK,),
                   (f, a_log, dt_bias, out, i32(t), i32(hk), i32(dk), i32(has_lb),
                    f32(lower_bound if has_lb else 0.0)))
        return out

    def kda_recurrence(self, q, k, v, g, beta, state):
        """Delta rule over the rows in order; state [Hk, dk, dv] float32 advances in place;
        returns o [t, Hk, dv]. Parallel over (head, value column), never over rows."""
        q, k, v = _input(q, "q"), _input(k, "k"), _input(v, "v")
        g, beta = _input(g, "g"), _input(beta, "beta")
        check(state, cp.float32, "state")
        t, hk, dk = q.shape
        dv = v.shape[2]
        assert k.shape == g.shape == (t, hk, dk) and v.shape == (t, hk, dv) and beta.shape == (t, hk), (
            f"kda_recurrence: q {q.shape} k {k.shape} v {v.shape} g {g.shape} beta {beta.shape}")
        assert state.shape == (hk, dk, dv), f"kda_recurrence: state {state.shape}, expected {(hk, dk, dv)}"
        assert dk <= KDA_MAX_DK, f"kda_recurrence: dk={dk}, at most {KDA_MAX_DK} (raise KDA_MAX_DK)"
        out = cp.empty((t, hk, dv), cp.float32)
        if t:
            launch("kda", "kda_recurrence", (hk, (dv + WARPS - 1) // WARPS), (BLOCK,),
                   (q, k, v, g, beta, state, out, i32(t), i32(hk), i32(dk), i32(dv)))
        return out

