"""bench_ops: memra's exact-class kernels against the hardware and against cuBLAS, in one run.

    python benchmarks/bench_ops.py --git-sha SHA [--out benchmarks/results/bench_ops.json]

Measures, on the current GPU: device copy bandwidth (the roof), the rows-exact projection
(`linear`, bf16 weights) at t = 1, 2, 4, 8, 15 against torch's cuBLAS bf16 matmul on the same
shapes (GLM-5-Next's real widths: 4096 -> 4096, 4096 -> 12288, the 154880-row lm head), the KDA
recurrence step and MLA decode attention at the real head counts. Projections are timed as CUDA
graphs of GRAPH_CALLS back-to-back calls on both sides (GPU time per call, as the engine's
replayed walks pay it), and also one call at a time between events (host launch included). Prints a readable card on
stderr and ONE JSON line on stdout (device, date, config, git sha, every number).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import cupy as cp

if __package__ in (None, ""):  # run as `python benchmarks/bench_ops.py`: `benchmarks` is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    bandwidth_fraction, copy_bandwidth_gbs, emit, gbs, record_header, time_ms,
)
from memra.backend.cuda import CudaBackend  # noqa: E402
from memra.safetensors_io import f32_to_bf16  # noqa: E402

ROWS = (1, 2, 4, 8, 15)
GRAPH_CALLS = 20  # calls per captured graph when timing a projection
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


def _per_call_ms(replay) -> float:
    """Median milliseconds per call of a graph of GRAPH_CALLS calls, replayed on the current stream."""
    return time_ms(replay, reps=10, warmup=1) / GRAPH_CALLS


def cupy_graph_ms(fn) -> float:
    fn()  # compiles and loads the kernels before the capture
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(GRAPH_CALLS):
            fn()
        graph = stream.end_capture()
    return _per_call_ms(graph.launch)


def torch_graph_ms(fn) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return _per_call_ms(graph.replay)


PEER_TOLERANCE = 1e-4  # max relative diff for memra and a peer to count as doing the same math


def _fla_or_reason():
    """(fla module, None), or (None, why not): bench_ops still runs on a host without the wheel."""
    try:
        import fla.ops.kda  # Triton compiles nothing until the first call
    except Exception as e:  # ImportError, or triton refusing this host at import
        return None, f"{type(e).__name__}: {e}"
    return fla, None


def bench_kda(be, rng, heads: int = 64, dk: int = 128) -> dict:
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
        peer = _kda_fla(fla, be, nbytes, q, k, v, g, beta, state) if fla else None
        ms = time_ms(lambda: be.kda_recurrence(q, k, v, g, beta, state))  # advances state in place
        entry = {"memra_ms": ms, "memra_gbs": gbs(nbytes, ms), "bytes": int(nbytes),
                 "state_bytes": int(state.nbytes), "fla": peer}
        if peer:
            entry["ratio"] = ms / peer["ms"]
        else:
            entry["fla_missing"] = missing
        out[f"kda_recurrence_t{t}"] = entry
    return out


def _kda_fla(fla, be, nbytes: int, q, k, v, g, beta, state) -> dict:
    """fla's time on memra's inputs, and how far its o and final state are from memra's."""
    import torch

    from benchmarks.peers import fla_inputs, kda_fla, max_rel_diff

    tv = lambda a: torch.as_tensor(a, device="cuda")  # noqa: E731  zero-copy view of a cupy array
    ours_state = state.copy()
    ours = be.kda_recurrence(q, k, v, g, beta, ours_state)
    ref, ref_state = kda_fla(tv(q), tv(k), tv(v), tv(g), tv(beta), tv(state))
    diff_o, diff_s = max_rel_diff(tv(ours), ref), max_rel_diff(tv(ours_state), ref_state)
    args = fla_inputs(tv(q), tv(k), tv(v), tv(g), tv(beta), tv(state))
    ms = time_ms(lambda: fla.ops.kda.fused_recurrent_kda(**args))  # reads state, never writes it
    return {"version": fla.__version__, "ms": ms, "gbs": gbs(nbytes, ms),
            "dtype": f"inputs float32, o {ref.dtype}, state {ref_state.dtype}",
            "max_rel_diff_o": diff_o, "max_rel_diff_state": diff_s,
            "agree": max(diff_o, diff_s) < PEER_TOLERANCE}


def bench_mla(be, rng, heads: int = 64, rank: int = 512, ctx: int = 4096, width: int = 2048 + 15) -> dict:
    """memra's absorbed MLA decode attention against peers.mla_attend_torch (gather + einsum +
    softmax, fp32) on the same inputs. Bytes counted: each query row's selected latent rows, once."""
    import torch

    from benchmarks.peers import max_rel_diff, mla_attend_torch

    scale = 0.0625
    latent = cp.asarray(rng.standard_normal((ctx, rank)).astype(np.float32))
    out = {}
    for t in (1, 8):
        q = cp.asarray(rng.standard_normal((t, heads, rank)).astype(np.float32))
        rows = [np.sort(rng.choice(ctx, width, replace=False)) for _ in range(t)]
        pos = cp.asarray(np.stack(rows).astype(np.int32))
        tq, tlat, tpos = (torch.as_tensor(a, device="cuda") for a in (q, latent, pos))
        ours = be.mla_attend(q, latent, pos, scale)
        diff = max_rel_diff(torch.as_tensor(ours, device="cuda"), mla_attend_torch(tq, tlat, tpos, scale))
        ms = time_ms(lambda: be.mla_attend(q, latent, pos, scale))
        torch_ms = time_ms(lambda: mla_attend_torch(tq, tlat, tpos, scale))
        nbytes = t * width * rank * 4
        out[f"mla_attend_t{t}"] = {
            "memra_ms": ms, "memra_gbs": gbs(nbytes, ms), "latent_bytes_read": int(nbytes),
            "torch": {"ms": torch_ms, "gbs": gbs(nbytes, torch_ms), "max_rel_diff": diff,
                      "agree": diff < PEER_TOLERANCE},
            "ratio": ms / torch_ms}
    return out


def add_peer_fractions(v: dict, peer: str, roof: float) -> None:
    """Each side's fraction of the copy bandwidth, beside its GB/s in a KDA/MLA entry."""
    v["memra_bandwidth_fraction"] = v["memra_gbs"] / roof
    if v[peer] is not None:
        v[peer]["bandwidth_fraction"] = v[peer]["gbs"] / roof


def peer_card(name: str, v: dict, peer: str) -> str:
    """One card line for a KDA/MLA entry."""
    line = f"  {name:<20} memra {v['memra_ms']:8.3f} ms {100 * v['memra_bandwidth_fraction']:5.1f}% of copy bw"
    if v[peer] is None:
        return f"{line}  {peer}: unavailable ({v[f'{peer}_missing']})"
    p = v[peer]
    diffs = ", ".join(f"{p[k]:.1e}" for k in p if k.startswith("max_rel_diff"))
    return (f"{line}  {peer} {p['ms']:8.3f} ms {100 * p['bandwidth_fraction']:5.1f}%  ratio "
            f"{v['ratio']:6.2f}  {'agree' if p['agree'] else 'DISAGREE'} (max rel diff {diffs})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--git-sha", required=True)
    ap.add_argument("--out", help="also write the JSON record here")
    args = ap.parse_args(argv)
    be, rng = CudaBackend(), np.random.default_rng(0)
    roof = copy_bandwidth_gbs()
    config = {"rows": ROWS, "shapes": SHAPES, "weights": "bf16", "graph_calls": GRAPH_CALLS}
    record = record_header("bench_ops", args.git_sha, config, be) | {
        "copy_bandwidth_gbs": roof,
        "linear": bench_linear(be, rng), **bench_kda(be, rng), **bench_mla(be, rng),
    }
    for v in record["linear"].values():
        v["bandwidth_fraction"] = bandwidth_fraction(v["weight_bytes"], v["memra_ms"], roof)
    peers = {name: "fla" if name.startswith("kda") else "torch"
             for name in ("kda_recurrence_t1", "kda_recurrence_t8", "mla_attend_t1", "mla_attend_t8")}
    for name, peer in peers.items():
        add_peer_fractions(record[name], peer, roof)
    card = [f"bench_ops on {record['device']}  copy bandwidth {roof:.0f} GB/s"]
    for name, v in record["linear"].items():
        card.append(f"  linear {name:<28} memra {v['memra_ms']:8.3f} ms  cuBLAS {v['cublas_bf16_ms']:8.3f} ms  "
                    f"ratio {v['ratio']:6.2f}  {100 * v['bandwidth_fraction']:5.1f}% of copy bw  "
                    f"(one call at a time: ratio {v['call_ratio']:5.2f})")
    for name, peer in peers.items():
        card.append(peer_card(name, record[name], peer))
    emit(record, card, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
