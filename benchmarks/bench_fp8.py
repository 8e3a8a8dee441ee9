"""bench_fp8: the FP8 exact tiles against the copy roof and against the bf16 tiles, in one run.

    python benchmarks/bench_fp8.py --git-sha SHA [--out F]

GPU time per call inside CUDA graphs (op_timing.cupy_graph_ms) of be.linear at GLM-5-Next's
projection widths and of be.moe_experts on `bench`'s expert stacks (64 experts, 8 a row), each at
t = 1 and 8, with FP8 weights (e4m3, 128 x 128 block scales) and with the same shapes in bf16.
A graph's calls read weight copies (projections) or other experts (each call routed afresh) that
together pass PAST_L2 bytes, so the weights come from HBM as in a decode step. Reported per op:
ms, the bytes read, the copy roof's time for those bytes and the ratio (issue goal: an FP8
projection at t = 1 within 1.1x of it), and FP8 / bf16. Prints a card on stderr and ONE JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

import cupy as cp

if __package__ in (None, ""):  # run as `python benchmarks/bench_fp8.py`: `benchmarks` is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import copy_bandwidth_gbs, emit, record_header  # noqa: E402
from benchmarks.op_timing import GRAPH_CALLS, TIMING_NOTE, cupy_graph_ms  # noqa: E402
from memra.backend.cuda import CudaBackend  # noqa: E402
from memra.backend.cuda.fp8 import DeviceFp8  # noqa: E402
from memra.backend.fp8 import f32_to_e4m3, scale_grid  # noqa: E402
from memra.safetensors_io import f32_to_bf16  # noqa: E402

ROWS = (1, 8)
PAST_L2 = 256 << 20  # bytes a graph's calls read together: about five times the H200's L2
SIZES = {  # (projections in x out, experts (E, I, D, k)); o_proj: KDA's, 512 blocks at t = 1 (bf16 at four an SM)
    "bench": ({"proj_4096x4096": (4096, 4096), "ffn_4096x12288": (4096, 12288), "down_12288x4096": (12288, 4096),
               "o_proj_8192x4096": (8192, 4096)},
              (64, 2048, 4096, 8)),
    "small": ({"proj_384x256": (384, 256)}, (8, 256, 384, 2)),  # the tests' shapes
}
POOL = 1 << 24  # values drawn once, then rolled per matrix: building 1.5 GB of experts stays fast


def _pool(rng, dtype: str):
    values = rng.standard_normal(POOL, dtype=np.float32)
    return cp.asarray(f32_to_e4m3(values) if dtype == "fp8" else f32_to_bf16(values * np.float32(0.02)))


def _matrix(pool, shape, rng, dtype: str, scale: float):
    """[*shape] values from the pool at a random roll (FP8: with every block scale `scale`)."""
    n = int(np.prod(shape))
    reps = -(-n // POOL)
    data = cp.roll(cp.tile(pool, reps), int(rng.integers(POOL)))[:n].reshape(shape)
    if dtype == "bf16":
        return data
    return DeviceFp8(data, cp.full(scale_grid(shape), scale, cp.float32))


def _entry(ms: float, nbytes: int, roof_gbs: float) -> dict:
    roof_ms = nbytes / roof_gbs / 1e6
    return {"ms": ms, "bytes": int(nbytes), "roof_ms": roof_ms, "of_roof": ms / roof_ms}


def bench_projections(be, rng, shapes: dict, roof: float) -> dict:
    pools = {d: _pool(rng, d) for d in ("fp8", "bf16")}
    out = {}
    for name, (d_in, d_out) in shapes.items():
        for dtype, pool in pools.items():
            first = _matrix(pool, (d_out, d_in), rng, dtype, d_in ** -0.5)
            copies = [first] + [_matrix(pool, (d_out, d_in), rng, dtype, d_in ** -0.5)
                                for _ in range(min(GRAPH_CALLS, -(-PAST_L2 // first.nbytes)) - 1)]
            for t in ROWS:
                x = cp.asarray(rng.standard_normal((t, d_in), dtype=np.float32))
                for w in copies:  # each copy's launch table is built (uploaded) outside the capture
                    be.linear(x, w)
                weights = itertools.cycle(copies)
                ms = cupy_graph_ms(lambda: be.linear(x, next(weights)))
                out[f"{name}_t{t}_{dtype}"] = _entry(ms, first.nbytes, roof)
    return out


def bench_experts(be, rng, shape: tuple, roof: float) -> dict:
    e, inter, d, k = shape
    out = {}
    for dtype in ("fp8", "bf16"):
        pool = _pool(rng, dtype)
        gate, up = (_matrix(pool, (e, inter, d), rng, dtype, d ** -0.5) for _ in range(2))
        down = _matrix(pool, (e, d, inter), rng, dtype, inter ** -0.5)
        per_expert = (gate.nbytes + up.nbytes + down.nbytes) // e
        for t in ROWS:
            x = cp.asarray(rng.standard_normal((t, d), dtype=np.float32))
            routes = [np.stack([rng.choice(e, k, replace=False) for _ in range(t)]) for _ in range(GRAPH_CALLS)]
            listed = np.mean([len(np.unique(r)) for r in routes])
            sets = itertools.cycle([(cp.asarray(r.astype(np.int64)), cp.full((t, k), 1.0 / k, cp.float32))
                                    for r in routes])

            def call():
                idx, wts = next(sets)
                return be.moe_experts(x, idx, wts, gate, up, down, 10.0)
            ms = cupy_graph_ms(call)
            out[f"moe_experts_t{t}_{dtype}"] = _entry(ms, int(listed * per_expert), roof) | {"experts_read": listed}
    return out


def card(record: dict) -> list[str]:
    lines = [f"bench_fp8 on {record['device']}  copy bandwidth {record['copy_bandwidth_gbs']:.0f} GB/s"]
    for name, v in record["ops"].items():
        lines.append(f"  {name:26s} {v['ms'] * 1e3:8.1f} us  {v['bytes'] / 1e6:8.1f} MB  {v['of_roof']:5.2f}x roof"
                     + (f"  fp8/bf16 {v['fp8_over_bf16']:.2f}" if "fp8_over_bf16" in v else ""))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--git-sha", required=True)
    ap.add_argument("--out", help="also write the JSON record here")
    ap.add_argument("--sizes", choices=sorted(SIZES), default="bench")
    args = ap.parse_args(argv)
    be, rng = CudaBackend(), np.random.default_rng(0)
    shapes, experts = SIZES[args.sizes]
    roof = copy_bandwidth_gbs()
    ops = bench_projections(be, rng, shapes, roof) | bench_experts(be, rng, experts, roof)
    for name, v in ops.items():
        if name.endswith("_fp8"):
            v["fp8_over_bf16"] = v["ms"] / ops[name[:-len("fp8")] + "bf16"]["ms"]
    config = {"sizes": args.sizes, "projections": shapes, "experts": dict(zip(("E", "I", "D", "k"), experts)),
              "rows": ROWS, "graph_calls": GRAPH_CALLS, "past_l2_bytes": PAST_L2}
    record = record_header("bench_fp8", args.git_sha, config, be) | {
        "timing": TIMING_NOTE, "copy_bandwidth_gbs": roof, "ops": ops}
    emit(record, card(record), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
