"""step_blocks: a replayed decode step cut into its blocks, each held against the copy time of its weights.

    python benchmarks/step_blocks.py --preset bench --backend cuda --git-sha SHA [--dtype fp8] [--context 512] [--out F]
    python benchmarks/step_blocks.py --preset bench --backend cuda --git-sha SHA --prompt 4096   # a prefill instead

bench_decode's kernel table adds up each kernel's own GPU time, so a kernel beside the step's
path (each mHC site's Sinkhorn mix, on a side stream) shows time the step never waits for. This
asks what the step does wait for: after a --context-token prime it replays the captured decode
step REPLAYS times under the kernel profiler (CUPTI through torch.profiler), cuts each replay's
kernel timeline where each mHC site's combine ends, and holds each block's wall time against the
time its weight bytes take at the copy bandwidth measured in the same run. A block is one site
with its attention mixer (kda / mla attention; the first also holds the embedding) or with its FFN
(dense / moe ffn: the num_experts_per_tok routed experts a row reads and the shared expert); the
last, "head", is the stream mean, final norm and lm head (walk_bytes.block_bytes). What a block
spends past its copy time is what a faster step could win there. Cache state (KDA states, latent
rows) is not counted: 4.2 MB a `bench` KDA layer beside 275 MB of weights. CUPTI lengthens the
kernels a little, so the blocks add up to a bit more than `replay_ms`, the step's GPU time
unprofiled (bench_decode's replay_gpu_ms), reported beside them.
With --prompt N it cuts one prime of N random tokens (the prime class: cuBLAS GEMMs, a chunked
KDA scan) the same way, after an untimed one, and gives each kind of block its wall time, its
share of the prime's span and its busy time (covered by at least one kernel): what is not busy
inside a block is the GPU waiting for the host (a launch, a host read). The prime's wall time
unprofiled, the median of PRIME_REPS, stands beside them.
Where no step is captured or torch's profiler is missing (the numpy backend) the record says why
and holds no blocks. Prints a card on stderr and ONE JSON line on stdout.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/step_blocks.py`: `benchmarks` is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_decode import captured_step, replay_gpu_ms  # noqa: E402
from benchmarks.common import (  # noqa: E402
    WARMUP_STEPS, card_head, emit, greedy_steps, model_args, model_config, model_from_args, prime_context,
    random_tokens, record_header, roof_gbs, timed_call,
)
from benchmarks.kernel_profile import busy_us, kernel_spans  # noqa: E402
from benchmarks.walk_bytes import block_bytes  # noqa: E402
from memra.limits import PRIME_CHUNK  # noqa: E402

REPLAYS = 5             # back-to-back replays profiled; each block's median over them is kept
PRIME_REPS = 3          # timed primes (--prompt), median kept
SITE_END = "hc_combine"  # the kernel that ends every mHC site, so every block but the head


def block_edges(one: list[tuple[str, float, float]]) -> list[float]:
    """Where the blocks of one walk's kernels (name, start, end; sorted by start) begin and end:
    the first kernel's start, each site combine's end, the last end."""
    ends = [end for name, _, end in one if name.startswith(SITE_END)]
    return [one[0][1], *ends, max(end for _, _, end in one)]


def block_us(kernels: list[tuple[str, float, float]], replays: int) -> list[list[float]]:
    """Wall microseconds of each block of each replay: kernels (name, start, end) sorted by start,
    `replays` replays of one graph (each the same kernels); a block ends where a site's combine
    ends, the first starts with the replay's first kernel, the last ends with its last."""
    assert len(kernels) % replays == 0, f"{len(kernels)} kernels do not split into {replays} replays"
    n = len(kernels) // replays
    out = []
    for i in range(replays):
        edges = block_edges(kernels[i * n:(i + 1) * n])
        out.append([b - a for a, b in zip(edges, edges[1:])])
    return out


def block_busy_us(kernels: list[tuple[str, float, float]], edges: list[float]) -> list[float]:
    """Microseconds of each block [edges[i], edges[i + 1]) covered by at least one kernel."""
    return [busy_us([(max(s, a), min(e, b)) for _, s, e in kernels if e > a and s < b])
            for a, b in zip(edges, edges[1:])]


def summed_by_kind(kinds: list[str], **columns: list) -> dict:
    """Per kind of block (first seen first): how many, and each column's values summed over them."""
    out = {}
    for i, kind in enumerate(kinds):
        k = out.setdefault(kind, {"count": 0, **{name: 0 for name in columns}})
        k["count"] += 1
        for name, values in columns.items():
            k[name] += values[i]
    return out


def by_kind(blocks: list[tuple[str, int]], us: list[float], roof_gbs: float) -> dict:
    """Per kind of block: how many, their mean wall us, weight bytes and copy us each, the copy
    time's share of the wall time, and the us they spend past their copy time, all of them."""
    out = {}
    kinds = summed_by_kind([kind for kind, _ in blocks], us=us, bytes=[nbytes for _, nbytes in blocks])
    for kind, k in kinds.items():
        copy_us = k["bytes"] / roof_gbs / 1e3
        out[kind] = {"count": k["count"], "us_each": k["us"] / k["count"], "bytes_each": k["bytes"] // k["count"],
                     "copy_us_each": copy_us / k["count"], "of_copy_bw": copy_us / k["us"],
                     "us_past_copy": k["us"] - copy_us}
    return out


def measure(model, args, roof: float | None) -> dict:
    cache, token = prime_context(model, args.context, WARMUP_STEPS + 2, args.seed)
    greedy_steps(model, cache, token, WARMUP_STEPS + 1)  # the eager first walk, the capture, a replay
    captured = captured_step(cache)
    if captured is None:
        return {"blocks": None, "why": "no captured decode step (a backend without CUDA graphs)"}
    replay_ms = replay_gpu_ms(cache)

    def replays():
        for _ in range(REPLAYS):
            captured.graph.launch()
        model.be.synchronize()

    kernels = kernel_spans(replays)
    if kernels is None:
        return {"blocks": None, "why": "no kernel profiler (torch.profiler) in this environment"}
    blocks = block_bytes(model, model.cfg.num_experts_per_tok)
    walls = block_us(kernels, REPLAYS)
    assert all(len(w) == len(blocks) for w in walls), f"{len(walls[0])} blocks timed, {len(blocks)} expected"
    us = [statistics.median(w[b] for w in walls) for b in range(len(blocks))]
    step_us, weights = sum(us), sum(nbytes for _, nbytes in blocks)
    return {"replay_ms": replay_ms, "profiled_step_us": step_us, "weight_bytes": weights,
            "weights_copy_us": weights / roof / 1e3, "of_copy_bw": weights / roof / 1e3 / step_us,
            "kinds": by_kind(blocks, us, roof),
            "blocks": [{"kind": kind, "us": wall, "bytes": nbytes} for (kind, nbytes), wall in zip(blocks, us)]}


def measure_prime(model, args) -> dict:
    """One prime of args.prompt random tokens cut into blocks: wall and busy us of each, per kind
    their sum's share of the span."""
    n = args.prompt
    tokens = random_tokens(model.cfg, n, args.seed)
    model.prime(tokens, model.new_cache(n))  # kernel compilation, cuBLAS's picks per shape
    prime_ms = statistics.median(timed_call(lambda: model.prime(tokens, model.new_cache(n)), model.be)[0]
                                 for _ in range(PRIME_REPS))
    kernels = kernel_spans(lambda: model.prime(tokens, model.new_cache(n)))
    if kernels is None:
        return {"blocks": None, "why": "no GPU kernels recorded (no CUDA, no torch.profiler, or a host backend)"}
    edges = block_edges(kernels)
    walls = [b - a for a, b in zip(edges, edges[1:])]
    busy = block_busy_us(kernels, edges)
    kinds = [kind for kind, _ in block_bytes(model, model.cfg.num_experts_per_tok)]
    assert len(walls) == len(kinds), f"{len(walls)} blocks timed, {len(kinds)} expected"
    span = edges[-1] - edges[0]
    per = summed_by_kind(kinds, us=walls, busy_us=busy)
    return {"prompt": n, "prime_ms": prime_ms, "profiled_span_us": span, "busy_us": sum(busy),
            "kinds": {kind: {"count": k["count"], "us_each": k["us"] / k["count"],
                             "busy_us_each": k["busy_us"] / k["count"], "share": k["us"] / span}
                      for kind, k in per.items()},
            "blocks": [{"kind": kind, "us": wall, "busy_us": b} for kind, wall, b in zip(kinds, walls, busy)]}


def card(record: dict) -> list[str]:
    lines = [card_head(record)]
    if record["blocks"] is None:
        return lines + [f"  no blocks: {record['why']}"]
    if "prompt" in record:
        lines.append(f"  a {record['prompt']}-token prime: {record['prime_ms']:.1f} ms unprofiled, "
                     f"{record['profiled_span_us'] / 1e3:.1f} ms profiled, busy {record['busy_us'] / 1e3:.1f} ms")
        for kind, k in record["kinds"].items():
            lines.append(f"  {kind:<14} x{k['count']:<3} {k['us_each'] / 1e3:8.2f} ms each  "
                         f"busy {k['busy_us_each'] / 1e3:8.2f} ms  {100 * k['share']:5.1f}% of the span")
        return lines
    lines.append(f"  copy bandwidth {record['copy_bandwidth_gbs']:.0f} GB/s  step {record['replay_ms']:.3f} ms "
                 f"unprofiled, {record['profiled_step_us'] / 1e3:.3f} ms profiled, "
                 f"{100 * record['of_copy_bw']:.1f}% of copy bw")
    for kind, k in record["kinds"].items():
        lines.append(f"  {kind:<14} x{k['count']:<3} {k['us_each']:8.1f} us each  {k['bytes_each'] / 1e6:8.1f} MB  "
                     f"copy {k['copy_us_each']:7.1f} us  {100 * k['of_copy_bw']:5.1f}% of copy bw  "
                     f"{k['us_past_copy']:7.1f} us past copy in all")
    return lines


def main(argv=None) -> int:
    ap = model_args(__doc__)
    ap.add_argument("--prompt", type=int, help="cut a prime of this many random tokens instead of a decode step")
    args = ap.parse_args(argv)
    if args.gpus != 1 or args.stage_layers:
        ap.error("step_blocks times one model on one GPU: a pipeline's stages are not cut into blocks")
    if args.prompt is not None and not 1 <= args.prompt <= PRIME_CHUNK:
        ap.error(f"--prompt {args.prompt}: a prime of 1 to {PRIME_CHUNK} tokens (one walk; a longer prompt "
                 "walks in chunks)")
    model = model_from_args(args)
    extra = {} if args.prompt is None else {"prompt": args.prompt}
    header = record_header("step_blocks", args.git_sha, model_config(args, model, **extra), model.be)
    if args.prompt is not None:
        record = header | measure_prime(model, args)
    else:
        roof = roof_gbs(model.be)
        record = header | {"copy_bandwidth_gbs": roof} | measure(model, args, roof)
    emit(record, card(record), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
