"""The mHC family of the CUDA backend (kernels_cu/hyper.cu): the hyper-connection site.

Mixin of CudaBackend mirroring NumpyBackend's hc_weights / hc_collapse / hc_combine / hc_site /
stream_mean on cupy arrays. Exact class: each output's sums run in a fixed order per row.

    pre, post, comb = HyperOps().hc_weights(streams, fn, base, scale, rms_eps, hc_eps, iters)
    new_streams = HyperOps().hc_site(streams, fn, base, scale, rms_eps, hc_eps, iters, block)
"""

from __future__ import annotations

import cupy as cp

from memra.backend.cuda.prime import is_prime, prime_hc_partials, prompt_width
from memra.backend.cuda.runtime import BLOCK, columns_grid, device_input, f32, i32, launch
from memra.backend.cuda.streams import fork, join
from memra.kernels_cu.constants import HC_CHUNK, HC_MAX_N, HC_ROWS, HC_SLOTS, HC_VECTOR


class HyperOps:
    def hc_weights(self, streams, fn, base, scale, rms_eps: float, hc_eps: float, iters: int):
        """(pre [t, n], post [t, n], comb [t, n, n]): fixed chunks of the flattened streams
        spread the fn matvec over blocks, then one small block per row adds them up in order."""
        streams, fn, base, scale, (t, n, d) = _site_inputs(streams, fn, base, scale, iters)
        pre, post, comb = _site_weights(t, n)
        if t:
            _mix(_partials(streams, fn), base, scale, pre, post, comb, d, rms_eps, hc_eps, iters)
        return pre, post, comb

    def hc_site(self, streams, fn, base, scale, rms_eps: float, hc_eps: float, iters: int, block):
        """hc_combine(streams, block(hc_collapse(streams, pre)), post, comb) with (pre, post,
        comb) = hc_weights(...), the same bits. The Sinkhorn mix (hc_weights' kernel, a chain of
        2 iters dependent normalisations in one block: ~10 us) runs on a side stream beside
        `block`, whose collapse makes pre from the same partials; hc_combine waits for it. In a
        captured walk the fork and the join are graph edges."""
        streams, fn, base, scale, (t, n, d) = _site_inputs(streams, fn, base, scale, iters)
        if not t:
            pre, post, comb = self.hc_weights(streams, fn, base, scale, rms_eps, hc_eps, iters)
            return self.hc_combine(streams, block(self.hc_collapse(streams, pre)), post, comb)
        part = _partials(streams, fn)  # read by the side stream: alive until the join below
        pre, post, comb = _site_weights(t, n)
        main, side = fork("mix")
        with side:
            _mix(part, base, scale, pre, post, comb, d, rms_eps, hc_eps, iters)
        try:
            collapsed = cp.empty((t, d), cp.float32)
            width = prompt_width(t, d, HC_VECTOR, streams, collapsed)
            launch("hyper", "hc_collapse_site", columns_grid(t, d // width), (BLOCK,),
                   (streams, part, base, scale, collapsed, i32(t), i32(n), i32(d), i32(part.shape[1]),
                    f32(rms_eps), f32(hc_eps), i32(width)))
            f = block(collapsed)
        finally:  # joined even when block raises: a capture must not end with the side stream forked
            join(main, side)  # hc_combine reads the mix's comb and post next
        return self.hc_combine(streams, f, post, comb)

    def hc_collapse(self, streams, pre):
        """sum_i pre_i X_i in stream order: [t, n, D] -> [t, D]."""
        streams, pre = device_input(streams, "streams"), device_input(pre, "pre")
        t, n, d = streams.shape
        assert pre.shape == (t, n), f"hc_collapse: pre {pre.shape}, expected {(t, n)}"
        out = cp.empty((t, d), cp.float32)
        if t:
            launch("hyper", "hc_collapse", columns_grid(t, d), (BLOCK,),
                   (streams, pre, out, i32(t), i32(n), i32(d)))
        return out

    def hc_combine(self, streams, f, post, comb):
        """X'_b = post_b f + sum_a C[a, b] X_a (C transposed), a ascending."""
        streams, f = device_input(streams, "streams"), device_input(f, "f")
        post, comb = device_input(post, "post"), device_input(comb, "comb")
        t, n, d = streams.shape
        assert f.shape == (t, d) and post.shape == (t, n) and comb.shape == (t, n, n), (
            f"hc_combine: f {f.shape}, post {post.shape}, comb {comb.shape} for streams {streams.shape}")
        out = cp.empty((t, n, d), cp.float32)
        if t:
            width = prompt_width(t, d, HC_VECTOR, streams, f, out)
            launch("hyper", "hc_combine", columns_grid(t, d // width), (BLOCK,),
                   (streams, f, post, comb, out, i32(t), i32(n), i32(d), i32(width)))
        return out

    def stream_mean(self, streams):
        streams = device_input(streams, "streams")
        t, n, d = streams.shape
        out = cp.empty((t, d), cp.float32)
        if t:
            launch("hyper", "stream_mean", columns_grid(t, d), (BLOCK,), (streams, out, i32(t), i32(n), i32(d)))
        return out


def _site_inputs(streams, fn, base, scale, iters: int):
    streams = device_input(streams, "streams")
    t, n, d = streams.shape
    assert 1 <= n <= HC_MAX_N, f"hc_weights: n={n} streams, at most {HC_MAX_N}"
    assert iters >= 1, f"hc_weights: iters={iters}, at least 1"
    fn, base, scale = device_input(fn, "fn"), device_input(base, "base"), device_input(scale, "scale")
    assert fn.shape == ((2 + n) * n, n * d), f"hc_weights: fn {fn.shape}, n={n}, D={d}"
    assert base.shape == ((2 + n) * n,) and scale.shape == (3,), (base.shape, scale.shape)
    return streams, fn, base, scale, (t, n, d)


def _site_weights(t: int, n: int):
    """Empty (pre [t, n], post [t, n], comb [t, n, n])."""
    return cp.empty((t, n), cp.float32), cp.empty((t, n), cp.float32), cp.empty((t, n, n), cp.float32)


def _partials(streams, fn):
    """hc_weights' partials [t, chunks, (2+n)n + 1]: each chunk's dots with fn and its sum of squares."""
    t, n, d = streams.shape
    if is_prime(t):  # a prompt: the matvec as one float32 GEMM, one chunk (prime.py)
        return prime_hc_partials(streams, fn)
    part = cp.empty((t, (n * d + HC_CHUNK - 1) // HC_CHUNK, (2 + n) * n + 1), cp.float32)
    slots = ((2 + n) * n + 1 + HC_SLOTS - 1) // HC_SLOTS
    rows = 1 if t == 1 else HC_ROWS  # rows a block: the bits do not depend on it
    launch("hyper", f"hc_partials_r{rows}", (part.shape[1], (t + rows - 1) // rows, slots), (BLOCK,),
           (streams, fn, part, i32(t), i32(n), i32(d)))
    return part


def _mix(part, base, scale, pre, post, comb, d: int, rms_eps: float, hc_eps: float, iters: int) -> None:
    """pre, post and the Sinkhorn mix comb from the partials, a block per row."""
    t, n = pre.shape
    launch("hyper", "hc_weights", (t,), (HC_MAX_N * HC_MAX_N,),
           (part, base, scale, pre, post, comb, i32(n), i32(d), i32(part.shape[1]), f32(rms_eps),
            f32(hc_eps), i32(iters)))
