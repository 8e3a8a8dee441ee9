"""How bench_ops times one op against its peer: the same way on both sides, or not at all.

    memra = timed(lambda: be.rmsnorm(x, w, eps), cupy_graph_ms)       # {"ms", "call_ms"}
    peer = timed(lambda: torch_rmsnorm(tx, tw, eps), torch_graph_ms)
    entry = op_entry(nbytes, roof, memra, peer | {"name": "torch one-liner"})

A ratio compares GPU time inside CUDA graphs of GRAPH_CALLS back-to-back calls on both sides
(memra's kernels in a cupy graph, a torch or Triton peer in a torch graph): what a replayed walk
pays, with no host launch cost on either side. Each side's time per host call (between events,
launch included) is kept beside it as `call_ms` / `call_ratio`, never in place of it: one side's
launch overhead must not pass for the other side's kernel. A side whose graph capture is refused
gets `ms: None` and the reason in `graph_refused`, and its entry no graph ratio.
"""

from __future__ import annotations

from benchmarks.common import gbs, time_ms

GRAPH_CALLS = 20  # calls per captured graph
TIMING_NOTE = (f"GPU time per call inside CUDA graphs of {GRAPH_CALLS} calls on both sides (memra: cupy "
               "graph; torch and Triton peers: torch graph); *_call_ms: one host call at a time between "
               "events, launch included")


def _per_call_ms(replay) -> float:
    """Median milliseconds per call of a graph of GRAPH_CALLS calls, replayed on the current stream."""
    return time_ms(replay, reps=10, warmup=1) / GRAPH_CALLS


def cupy_graph_ms(fn) -> float:
    """fn's GPU time per call in a cupy graph. fn runs once first (kernels compile and load
    outside the capture); the capture allocates from a private pool, so the buffers the graph
    writes are never handed to other arrays while it is replayed."""
    import cupy as cp

    from memra.backend.cuda.dense import graph_counters, split_k_counters
    from memra.backend.cuda.graphs import capture

    fn()
    cp.cuda.Device().synchronize()
    counters = split_k_counters()  # kept past the capture: the replays count on them
    _, graph, pool = capture(lambda: [fn() for _ in range(GRAPH_CALLS)], graph_counters(counters))
    return _per_call_ms(graph.launch)


def torch_graph_ms(fn) -> float:
    """fn's GPU time per call in a torch CUDA graph, after warm-up calls on a side stream (Triton
    compiles and autotunes there, and torch's allocator sees the shapes before the capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return _per_call_ms(graph.replay)


def timed(fn, graph_ms, call_ms=time_ms) -> dict:
    """{"ms": GPU ms per call in a graph (graph_ms), "call_ms": ms per host call (call_ms)}; a
    refused capture leaves ms None and says why in "graph_refused"."""
    out = {"call_ms": call_ms(fn)}
    try:
        out["ms"] = graph_ms(fn)
    except Exception as e:  # a peer that syncs or allocates on the host mid-capture
        out["ms"], out["graph_refused"] = None, f"{type(e).__name__}: {e}"
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def op_entry(nbytes: int, roof_gbs: float, memra: dict, peer: dict | None = None,
             peer_missing: str | None = None, **extra) -> dict:
    """One op's record entry: memra's graph and per-call times (from `timed`), the bytes it
    moves and its achieved bandwidth (at graph time) against the copy roof; with a peer (a
    `timed` dict plus its name, version, agreement), the peer's numbers under "peer" and
    ratio = graph time / graph time, call_ratio = call time / call time. Without one, "peer" is
    None and peer_missing says why."""
    entry = {"memra_ms": memra["ms"], "memra_call_ms": memra["call_ms"], "bytes": int(nbytes)}
    if "graph_refused" in memra:
        entry["memra_graph_refused"] = memra["graph_refused"]
    entry |= _bandwidth("memra_", nbytes, memra["ms"], roof_gbs) | extra
    if peer is None:
        return entry | {"peer": None, "peer_missing": peer_missing}
    return entry | {"peer": peer | _bandwidth("", nbytes, peer["ms"], roof_gbs),
                    "ratio": _ratio(memra["ms"], peer["ms"]),
                    "call_ratio": _ratio(memra["call_ms"], peer["call_ms"])}


def _bandwidth(prefix: str, nbytes: int, ms: float | None, roof_gbs: float) -> dict:
    achieved = None if ms is None else gbs(nbytes, ms)
    return {f"{prefix}gbs": achieved,
            f"{prefix}bandwidth_fraction": None if achieved is None else achieved / roof_gbs}


def _us(ms: float | None) -> str:
    return "   n/a" if ms is None else f"{ms * 1e3:6.1f}"


def op_card(name: str, v: dict) -> str:
    """One card line: graph times and ratio first, per-call times and ratio beside."""
    frac = v["memra_bandwidth_fraction"]
    line = (f"  {name:<22} memra {_us(v['memra_ms'])} us graph ({_us(v['memra_call_ms'])} per call)  "
            + ("" if frac is None else f"{100 * frac:5.1f}% of copy bw"))
    p = v["peer"]
    if p is None:
        return f"{line}  no peer ({v['peer_missing']})"
    graph = (f"ratio {v['ratio']:5.2f}" if v["ratio"] is not None
             else f"no graph ratio ({p.get('graph_refused') or v.get('memra_graph_refused')})")
    agree = ""
    if "agree" in p:
        agree = f"  {'agree' if p['agree'] else 'DISAGREE'} (max rel diff {p['max_rel_diff']:.1e})"
    return (f"{line}  {p['name']} {_us(p['ms'])} us graph ({_us(p['call_ms'])} per call)  {graph}  "
            f"call ratio {v['call_ratio']:5.2f}{agree}")
