"""The mHC family of the CUDA backend (kernels_cu/hyper.cu): the hyper-connection site.

Mixin of CudaBackend mirroring NumpyBackend's hc_weights / hc_collapse / hc_combine /
stream_mean on cupy arrays. Exact class: each output's sums run in a fixed order per row.

    pre, post, comb = HyperOps().hc_weights(streams, fn, base, scale, rms_eps, hc_eps, iters)
"""

from __future__ import annotations

import cupy as cp

from memra.backend.cuda.prime import is_prime, prime_hc_partials
from memra.backend.cuda.runtime import BLOCK, columns_grid, device_input, f32, i32, launch
from memra.kernels_cu.constants import HC_CHUNK, HC_MAX_N, HC_SLOTS


class HyperOps:
    def hc_weights(self, streams, fn, base, scale, rms_eps: float, hc_eps: float, iters: int):
        """(pre [t, n], post [t, n], comb [t, n, n]): fixed chunks of the flattened streams
        spread the fn matvec over blocks, then one small block per row adds them up in order."""
        streams = device_input(streams, "streams")
        t, n, d = streams.shape
        assert 1 <= n <= HC_MAX_N, f"hc_weights: n={n} streams, at most {HC_MAX_N}"
        assert iters >= 1, f"hc_weights: iters={iters}, at least 1"
        fn, base, scale = device_input(fn, "fn"), device_input(base, "base"), device_input(scale, "scale")
        assert fn.shape == ((2 + n) * n, n * d), f"hc_weights: fn {fn.shape}, n={n}, D={d}"
        assert base.shape == ((2 + n) * n,) and scale.shape == (3,), (base.shape, scale.shape)
        pre, post = cp.empty((t, n), cp.float32), cp.empty((t, n), cp.float32)
        comb = cp.empty((t, n, n), cp.float32)
        if t:
            if is_prime(t):  # a prompt: the matvec as one float32 GEMM, one chunk (prime.py)
                part = prime_hc_partials(streams, fn)
            else:
                part = cp.empty((t, (n * d + HC_CHUNK - 1) // HC_CHUNK, (2 + n) * n + 1), cp.float32)
                slots = ((2 + n) * n + 1 + HC_SLOTS - 1) // HC_SLOTS
                launch("hyper", "hc_partials", (part.shape[1], t, slots), (BLOCK,),
                       (streams, fn, part, i32(n), i32(d)))
            chunks = part.shape[1]
            launch("hyper", "hc_weights", (t,), (HC_MAX_N * HC_MAX_N,),
                   (part, base, scale, pre, post, comb, i32(n), i32(d), i32(chunks), f32(rms_eps),
                    f32(hc_eps), i32(iters)))
        return pre, post, comb

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
            launch("hyper", "hc_combine", columns_grid(t, d), (BLOCK,),
                   (streams, f, post, comb, out, i32(t), i32(n), i32(d)))
        return out

    def stream_mean(self, streams):
        streams = device_input(streams, "streams")
        t, n, d = streams.shape
        out = cp.empty((t, d), cp.float32)
        if t:
            launch("hyper", "stream_mean", columns_grid(t, d), (BLOCK,), (streams, out, i32(t), i32(n), i32(d)))
        return out
