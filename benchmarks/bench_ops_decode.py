"""bench_ops' decode ops: the norm, the mHC site, routing and the routed experts of one real layer.

    layer = bench_layer(cfg, be)                       # the `bench` preset's first MoE layer
    ops = decode_ops(be, cfg, layer, 1, rng)           # name -> DecodeOp, at 1 row
    entries = bench_decode_ops(be, cfg, layer, rng, roof, cupy_graph_ms, torch_graph_ms, as_torch=view)

The layer is built as the engine builds it (TrunkLayer on `bench_weights`: bf16 projection and
expert stacks, float32 norms, mHC weights and router), so each op runs on the shapes and dtypes a
decode step gives it. Each op is timed by op_timing: memra's in a cupy graph, a torch peer (where
the op has a short torch form, peers.py) in a torch graph, and both per host call. An op's bytes
are what it must move: its inputs read once and its outputs written once (a kernel's own
scratch, such as hc_weights' partial sums, not counted), and for the routed experts only the
experts the rows picked. The graph timers are arguments, so the CPU tests run every op on the
numpy backend with stand-in timers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from benchmarks.common import bench_weights
from benchmarks.op_timing import op_entry, timed
from memra.config import ModelConfig
from memra.model.trunk import TrunkLayer

DECODE_ROWS = (1, 8)  # a decode step, and a verify walk of 8 rows


@dataclass
class DecodeOp:
    """One op on fixed inputs: `run` is memra's call, `peer` the torch form on the same inputs
    (torch views made by `peer(as_torch)`), or None with `peer_missing` saying why."""
    run: Callable
    nbytes: int
    peer: Callable | None = None
    peer_missing: str | None = None


def bench_layer(cfg: ModelConfig, be, seed: int = 0) -> TrunkLayer:
    """The preset's first MoE layer with the bench weights (benchmarks/common.py)."""
    return TrunkLayer(be, bench_weights(cfg, seed), cfg, cfg.mlp_layer_types.index("sparse"))


def io_bytes(*arrays) -> int:
    """Bytes of the arrays, tuples of arrays counted element by element."""
    return int(sum(io_bytes(*a) if isinstance(a, tuple) else a.nbytes for a in arrays))


def _peer(name: str, *arrays, extra: tuple = ()):
    """peers.<name> on torch views of `arrays`, then `extra`; peers (and torch) are imported only
    when it runs, so the ops run where torch is missing."""
    def run(as_torch):
        from benchmarks import peers

        return getattr(peers, name)(*map(as_torch, arrays), *extra)
    return run


def decode_ops(be, cfg: ModelConfig, layer: TrunkLayer, rows: int, rng) -> dict[str, DecodeOp]:
    """The layer's decode ops at `rows` rows, on random inputs of the trunk's scale. Runs each op
    once (to count its outputs' bytes; on CUDA this also compiles it)."""
    n, d = cfg.hc_mult, cfg.hidden_size
    site, moe, eps = layer.ffn_site, layer.ffn, cfg.rms_norm_eps
    f = lambda *shape: be.xp.asarray(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    x, streams = f(rows, d), f(rows, n, d)
    pre, post, comb = be.hc_weights(streams, site.fn, site.base, site.scale, site.rms_eps, site.hc_eps, site.iters)
    route = (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    idx, wts = be.moe_route(x, moe.router, moe.bias, *route)
    stacks = (moe.gate_w, moe.up_w, moe.down_w)
    picked = int(np.unique(be.to_host(idx)).size) * sum(s.nbytes // s.shape[0] for s in stacks)

    def op(run, inputs, peer=None, peer_missing=None, weights_read=0):
        return DecodeOp(run, io_bytes(*inputs, run()) + weights_read, peer, peer_missing)

    return {
        "rmsnorm": op(lambda: be.rmsnorm(x, layer.post_norm, eps), (x, layer.post_norm),
                      _peer("rmsnorm_torch", x, layer.post_norm, extra=(eps,))),
        "hc_weights": op(lambda: be.hc_weights(streams, site.fn, site.base, site.scale, site.rms_eps,
                                               site.hc_eps, site.iters),
                         (streams, site.fn, site.base, site.scale),
                         peer_missing=f"no short torch form: {site.iters} Sinkhorn iterations"),
        "hc_collapse": op(lambda: be.hc_collapse(streams, pre), (streams, pre),
                          _peer("hc_collapse_torch", streams, pre)),
        "hc_combine": op(lambda: be.hc_combine(streams, x, post, comb), (streams, x, post, comb),
                         _peer("hc_combine_torch", streams, x, post, comb)),
        "moe_route": op(lambda: be.moe_route(x, moe.router, moe.bias, *route), (x, moe.router, moe.bias),
                        _peer("moe_route_torch", x, moe.router, moe.bias, extra=route)),
        "moe_experts": op(lambda: be.moe_experts(x, idx, wts, *stacks, cfg.swiglu_limit), (x, idx, wts),
                          peer_missing="no short torch form that reads only the picked experts in a graph",
                          weights_read=picked),
    }


def output_diff(ours, ref, as_torch) -> float:
    """max_rel_diff of memra's outputs against the peer's, the worst over a tuple of outputs."""
    from benchmarks.peers import max_rel_diff

    if isinstance(ours, tuple):
        return max(output_diff(a, b, as_torch) for a, b in zip(ours, ref))
    return max_rel_diff(as_torch(ours).double(), ref.double())


def bench_decode_ops(be, cfg: ModelConfig, layer: TrunkLayer, rng, roof_gbs: float, memra_graph_ms,
                     peer_graph_ms=None, call_ms=None, as_torch=None, tolerance: float = 1e-4) -> dict:
    """Every decode op at DECODE_ROWS rows -> {"<op>_t<rows>": op_entry}. Peers are timed only
    when `peer_graph_ms` and `as_torch` (array -> torch tensor view) are given."""
    times = {} if call_ms is None else {"call_ms": call_ms}
    out = {}
    for rows in DECODE_ROWS:
        for name, op in decode_ops(be, cfg, layer, rows, rng).items():
            memra = timed(op.run, memra_graph_ms, **times)
            peer, missing = None, op.peer_missing
            if op.peer is not None and peer_graph_ms is None:
                missing = "torch not available"
            elif op.peer is not None:
                run_peer = lambda p=op.peer: p(as_torch)  # noqa: E731
                diff = output_diff(op.run(), run_peer(), as_torch)
                peer = timed(run_peer, peer_graph_ms, **times) | {
                    "name": "torch", "max_rel_diff": diff, "agree": diff < tolerance}
            out[f"{name}_t{rows}"] = op_entry(op.nbytes, roof_gbs, memra, peer, missing)
    return out
