"""bench_ops: memra's exact-class kernels against the hardware and against their peers, in one run.

    python benchmarks/bench_ops.py --git-sha SHA [--out benchmarks/results/bench_ops.json]

Measures, on the current GPU: device copy bandwidth (the roof); the rows-exact projection
(`linear`, bf16 weights) at t = 1, 2, 4, 8, 15 against torch's cuBLAS bf16 matmul on the same
shapes (GLM-5-Next's real widths: 4096 -> 4096, 4096 -> 12288, the 154880-row lm head); the KDA
recurrence step against fla's fused_recurrent_kda and MLA decode attention against a torch
reference at the real head counts; and the decode ops of one `bench` layer (rmsnorm, the mHC
site's hc_weights / hc_collapse / hc_combine, routing, the routed experts: bench_ops_decode.py),
each with its bytes and achieved bandwidth, against a torch form where one is short.

Every ratio is GPU time against GPU time, both sides inside CUDA graphs of GRAPH_CALLS calls
(op_timing.py); each side's time per host call (launch included) is kept beside it, with its own
call_ratio. fla is optional: without it, or if its capture is refused, the record says why in
place of the number. Prints a readable card on stderr and ONE JSON line on stdout (device,
date, config, git sha, every number).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import cupy as cp

if __package__ in (None, ""):  # run as `python benchmarks/bench_ops.py`: `benchmarks` is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_ops_decode import DECODE_ROWS, bench_decode_ops, bench_layer  # noqa: E402
from benchmarks.common import bandwidth_fraction, copy_bandwidth_gbs, emit, record_header, time_ms  # noqa: E402
from benchmarks.op_timing import (  # noqa: E402
    GRAPH_CALLS, TIMING_NOTE, cupy_graph_ms, op_card, op_entry, timed, torch_graph_ms,
)
from memra.backend.cuda import CudaBackend  # noqa: E402
from memra.config import ModelConfig, preset  # noqa: E402
from memra.safetensors_io import f32_to_bf16  # noqa: E402

ROWS = (1, 2, 4, 8, 15)
SHAPES = {"proj_4096x4096": (4096, 4096), "ffn_4096x12288": (4096, 12288), "lm_head_4096x154880": (4096, 154880)}


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
            ours, cublas = cupy_graph_ms(lambda: be.linear(x, w)), torch_graph_ms(lambda: torch.matmul(x_torch, w_torch.T))
            ours_call = time_ms(lambda: be.linear(x, w))
            cublas_call = time_ms(lambda: torch.matmul(x_torch, w_torch.T))
            out[f"{name}_t{t}"] = {"memra_ms": ours, "cublas_bf16_ms": cublas, "ratio": ours / cublas,
                                   "memra_call_ms": ours_call, "cublas_bf16_call_ms": cublas_call,
                                   "call_ratio": ours_call / cublas_call, "weight_bytes": int(w_host.nbytes)}
    return out


PEER_TOLERANCE = 1e-4  # max relative diff for memra and a peer to count as doing the same math
KDA_STATE_NOTE = ("memra advances its fp32 state in place on every call, in and out of graphs (kept bounded: "
                  "g < 0, unit-norm k, beta in (0, 1)); fla reads the same initial state and writes a fresh "
                  "final state on every call. Both read and write the state once per call, so each replay "
                  "does the same work")


def as_torch(a):
    """A zero-copy torch view of a cupy array."""
    import torch

    return torch.as_tensor(a, device="cuda")


def _fla_or_reason():
    """(fla module, None), or (None, why not): bench_ops still runs on a host without the wheel."""
    try:
        import fla.ops.kda  # Triton compiles nothing until the first call
    except Exception as e:  # ImportError, or triton refusing this host at import
        return None, f"{type(e).__name__}: {e}"
    return fla, None


def bench_kda(be, rng, roof: float, heads: int = 64, dk: int = 128) -> dict:
    """memra's KDA recurrence against fla's fused_recurrent_kda on the same fp32 inputs
    (peers.fla_inputs maps the conventions). Bytes: the fp32 state read and written once per call,
    plus q, k, v, g, beta read and o written."""
    fla, missing = _fla_or_reason()
    f = lambda *s: cp.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    out = {}
    for t in (1, 8):
        q, k, v = be.l2norm(f(t, heads, dk), 1e-6), be.l2norm(f(t, heads, dk), 1e-6), f(t, heads, dk)
        g = -cp.abs(f(t, heads, dk)) * np.float32(0.1)
        beta = be.sigmoid(f(t, heads))
        state = f(heads, dk, dk)
        nbytes = 2 * state.nbytes + sum(a.nbytes for a in (q, k, v, g, beta)) + v.nbytes  # + o
        peer = None
        if fla:
            try:
                peer = _kda_fla(fla, be, q, k, v, g, beta, state)
            except Exception as e:  # a Triton build or launch failing on this host: say so, time memra anyway
                missing = f"fla failed: {type(e).__name__}: {e}"
        memra = timed(lambda: be.kda_recurrence(q, k, v, g, beta, state), cupy_graph_ms)
        out[f"kda_recurrence_t{t}"] = op_entry(nbytes, roof, memra, peer, missing, state_bytes=int(state.nbytes))
    return out


def _kda_fla(fla, be, q, k, v, g, beta, state) -> dict:
    """fla's times on memra's inputs, and how far its o and final state are from memra's."""
    from benchmarks.peers import fla_inputs, kda_fla, max_rel_diff

    tv = as_torch
    ours_state = state.copy()
    ours = be.kda_recurrence(q, k, v, g, beta, ours_state)
    ref, ref_state = kda_fla(tv(q), tv(k), tv(v), tv(g), tv(beta), tv(state))
    diff_o, diff_s = max_rel_diff(tv(ours), ref), max_rel_diff(tv(ours_state), ref_state)
    args = fla_inputs(tv(q), tv(k), tv(v), tv(g), tv(beta), tv(state))
    # reads the initial state and writes a fresh final state on every call: each replay does the same work
    times = timed(lambda: fla.ops.kda.fused_recurrent_kda(**args), torch_graph_ms)
    return times | {"name": "fla fused_recurrent_kda", "version": fla.__version__,
                    "dtype": f"inputs float32, o {ref.dtype}, state {ref_state.dtype}",
                    "max_rel_diff": max(diff_o, diff_s), "max_rel_diff_o": diff_o, "max_rel_diff_state": diff_s,
                    "agree": max(diff_o, diff_s) < PEER_TOLERANCE}


def bench_mla(be, rng, roof: float, heads: int = 64, rank: int = 512, ctx: int = 4096,
              width: int = 2048 + 15) -> dict:
    """memra's absorbed MLA decode attention against peers.mla_attend_torch (gather + einsum +
    softmax, fp32) on the same inputs: every row's list full (a row past index_topk), so memra
    scores on its long-list tile (the short-list one is launched too and returns at once, as in
    a walk). Bytes counted: each query row's selected latent rows, once."""
    from benchmarks.peers import max_rel_diff, mla_attend_torch

    scale = 0.0625
    latent = cp.asarray(rng.standard_normal((ctx, rank)).astype(np.float32))
    out = {}
    for t in (1, 8):
        q = cp.asarray(rng.standard_normal((t, heads, rank)).astype(np.float32))
        rows = [np.sort(rng.choice(ctx, width, replace=False)) for _ in range(t)]
        pos = cp.asarray(np.stack(rows).astype(np.int32))
        tq, tlat, tpos = (as_torch(a) for a in (q, latent, pos))
        diff = max_rel_diff(as_torch(be.mla_attend(q, latent, pos, scale)), mla_attend_torch(tq, tlat, tpos, scale))
        memra = timed(lambda: be.mla_attend(q, latent, pos, scale), cupy_graph_ms)
        peer = timed(lambda: mla_attend_torch(tq, tlat, tpos, scale), torch_graph_ms) | {
            "name": "torch reference", "max_rel_diff": diff, "agree": diff < PEER_TOLERANCE}
        nbytes = t * width * rank * 4
        out[f"mla_attend_t{t}"] = op_entry(nbytes, roof, memra, peer, latent_bytes_read=int(nbytes))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--git-sha", required=True)
    ap.add_argument("--out", help="also write the JSON record here")
    args = ap.parse_args(argv)
    be, rng = CudaBackend(), np.random.default_rng(0)
    cfg = ModelConfig.from_dict(preset("bench"))
    roof = copy_bandwidth_gbs()
    config = {"rows": ROWS, "shapes": SHAPES, "weights": "bf16", "graph_calls": GRAPH_CALLS,
              "decode_ops": {"preset": "bench", "rows": DECODE_ROWS}}
    linear = bench_linear(be, rng)
    for v in linear.values():
        v["bandwidth_fraction"] = bandwidth_fraction(v["weight_bytes"], v["memra_ms"], roof)
    decode = bench_decode_ops(be, cfg, bench_layer(cfg, be), rng, roof, cupy_graph_ms, torch_graph_ms,
                              as_torch=as_torch)
    record = record_header("bench_ops", args.git_sha, config, be) | {
        "timing": TIMING_NOTE, "kda_state_in_graphs": KDA_STATE_NOTE, "copy_bandwidth_gbs": roof,
        "linear": linear, "ops": bench_kda(be, rng, roof) | bench_mla(be, rng, roof) | decode,
    }
    card = [f"bench_ops on {record['device']}  copy bandwidth {roof:.0f} GB/s  (ratios: graph time on both "
            "sides; per host call beside)"]
    for name, v in linear.items():
        card.append(f"  linear {name:<28} memra {v['memra_ms']:8.3f} ms  cuBLAS {v['cublas_bf16_ms']:8.3f} ms  "
                    f"ratio {v['ratio']:6.2f}  {100 * v['bandwidth_fraction']:5.1f}% of copy bw  "
                    f"(call ratio {v['call_ratio']:5.2f})")
    card += [op_card(name, v) for name, v in record["ops"].items()]
    emit(record, card, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
