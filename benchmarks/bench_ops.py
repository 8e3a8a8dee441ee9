"""bench_ops: memra's exact-class kernels against the hardware and against cuBLAS, in one run.

    python benchmarks/bench_ops.py --git-sha SHA [--out benchmarks/results/bench_ops.json]

Measures, on the current GPU: device copy bandwidth (the roof), the rows-exact projection
(`linear`, bf16 weights) at t = 1, 2, 4, 8, 15 against torch's cuBLAS bf16 matmul on the same
shapes (GLM-5-Next's real widths: 4096 -> 4096, 4096 -> 12288, the 154880-row lm head), the KDA
recurrence step and MLA decode attention at the real head counts. Prints a readable card on
stderr and ONE JSON line on stdout (device, date, config, git sha, every number).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import numpy as np

import cupy as cp

from memra.backend.cuda import CudaBackend
from memra.safetensors_io import f32_to_bf16

ROWS = (1, 2, 4, 8, 15)
SHAPES = {"proj_4096x4096": (4096, 4096), "ffn_4096x12288": (4096, 12288), "lm_head_4096x154880": (4096, 154880)}


def time_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of fn() over reps, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    src = cp.ones(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    ms = time_ms(lambda: cp.copyto(dst, src), reps=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9  # read + write


def bench_linear(be, rng) -> dict:
    import torch

    out = {}
    for name, (d_in, d_out) in SHAPES.items():
        w_host = f32_to_bf16((rng.standard_normal((d_out, d_in)) * d_in ** -0.5).astype(np.float32))
        w = cp.asarray(w_host)
        w_torch = torch.as_tensor(w_host.view(np.int16), device="cuda").view(torch.bfloat16)
        for t in ROWS:
            x = cp.asarray(rng.standard_normal((t, d_in)).astype(np.float32))
            x_torch = torch.as_tensor(cp.asnumpy(x), device="cuda").to(torch.bfloat16)
            ours = time_ms(lambda: be.linear(x, w))
            cublas = time_ms(lambda: torch.matmul(x_torch, w_torch.T))
            out[f"{name}_t{t}"] = {"memra_ms": ours, "cublas_bf16_ms": cublas, "ratio": ours / cublas,
                                   "weight_bytes": int(w_host.nbytes)}
    return out


def bench_kda(be, rng, heads: int = 64, dk: int = 128) -> dict:
    f = lambda *s: cp.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    out = {}
    for t in (1, 8):
        q, k, v = be.l2norm(f(t, heads, dk), 1e-6), be.l2norm(f(t, heads, dk), 1e-6), f(t, heads, dk)
        g = -cp.abs(f(t, heads, dk)) * np.float32(0.1)
        beta = be.sigmoid(f(t, heads))
        state = f(heads, dk, dk)
        ms = time_ms(lambda: be.kda_recurrence(q, k, v, g, beta, state))
        out[f"kda_recurrence_t{t}"] = {"ms": ms, "state_bytes": int(state.nbytes)}
    return out


def bench_mla(be, rng, heads: int = 64, rank: int = 512, ctx: int = 4096, width: int = 2048 + 15) -> dict:
    latent = cp.asarray(rng.standard_normal((ctx, rank)).astype(np.float32))
    out = {}
    for t in (1, 8):
        q = cp.asarray(rng.standard_normal((t, heads, rank)).astype(np.float32))
        rows = [np.sort(rng.choice(ctx, width, replace=False)) for _ in range(t)]
        pos = cp.asarray(np.stack(rows).astype(np.int32))
        ms = time_ms(lambda: be.mla_attend(q, latent, pos, 0.0625))
        out[f"mla_attend_t{t}"] = {"ms": ms, "latent_bytes_read": int(t * width * rank * 4)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--git-sha", required=True)
    ap.add_argument("--out", help="also write the JSON record here")
    args = ap.parse_args(argv)
    be, rng = CudaBackend(), np.random.default_rng(0)
    props = cp.cuda.runtime.getDeviceProperties(0)
    roof = copy_bandwidth_gbs()
    record = {
        "bench": "bench_ops", "git_sha": args.git_sha, "date": datetime.date.today().isoformat(),
        "device": props["name"].decode(), "config": {"rows": ROWS, "shapes": SHAPES, "weights": "bf16"},
        "copy_bandwidth_gbs": roof,
        "linear": bench_linear(be, rng), **bench_kda(be, rng), **bench_mla(be, rng),
    }
    for v in record["linear"].values():
        v["bandwidth_fraction"] = v["weight_bytes"] / (v["memra_ms"] * 1e-3) / 1e9 / roof
    print(f"bench_ops on {record['device']}  copy bandwidth {roof:.0f} GB/s", file=sys.stderr)
    for name, v in record["linear"].items():
        print(f"  linear {name:<28} memra {v['memra_ms']:8.3f} ms  cuBLAS {v['cublas_bf16_ms']:8.3f} ms  "
              f"ratio {v['ratio']:6.2f}  {100 * v['bandwidth_fraction']:5.1f}% of copy bw", file=sys.stderr)
    for name in ("kda_recurrence_t1", "kda_recurrence_t8", "mla_attend_t1", "mla_attend_t8"):
        print(f"  {name:<35} {record[name]['ms']:8.3f} ms", file=sys.stderr)
    line = json.dumps(record)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
