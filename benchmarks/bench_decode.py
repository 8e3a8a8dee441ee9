"""bench_decode: prefill and plain decode speed of the whole model, against the device's copy bandwidth.

    python benchmarks/bench_decode.py --preset bench --backend cuda --git-sha SHA \
        [--out F] [--steps 32] [--context 512] [--prompt-lens 512,4096]

Measures, in one run: device copy bandwidth (the roof; none for numpy's host arrays); prefill
tokens/s for each prompt length (model.prime on a fresh cache, random ids; one untimed prime of
each length first, so one-time costs such as kernel compilation are excluded) and, for the
shortest, how far its last logits are from the same prompt primed in exact-class walks of VERIFY_CAP rows (max difference over the
largest logit); plain greedy decode after a --context-token prime: ms/step, tokens/s, the weight
bytes a step reads (trunk arrays, the num_experts_per_tok routed experts each MoE layer reads
plus its shared expert, the lm head, one embedding row; not the MTP block) and its fraction of
the copy bandwidth, the state bytes it reads (reported apart), memra kernel launches per step
and the host's share of a step (its wall time minus the time blocked waiting for the step's
token: the greedy step's argmax, taken on the device, as PlainSession takes it).
Where the cache's walk runner captures graphs (cuda), the decode runs twice on one cache: eager
launches, then graph replay (the default; the headline numbers), and the host share of a
replayed step is the launch overhead left; `replay_gpu_ms` is then the captured step's GPU time
alone (back-to-back replays between CUDA events). `session` is greedy decode as a user gets it,
PlainSession.burst on a fresh --context-token prompt: its steps run one ahead of the token the host
reads (speculative/plain.py), so the host's share hides behind the device's; timed between two
tokens the running session returns, each with the step after it in flight, so the span holds
exactly one step per token.
Prints a card on stderr and ONE JSON line on stdout.
"""

from __future__ import annotations

import contextlib
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as `python benchmarks/bench_decode.py`: `benchmarks` is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    WARMUP_STEPS, bandwidth_fraction, card_head, counted_launches, emit, greedy_steps, int_list, model_args,
    model_config, model_from_args, prime_context, random_tokens, record_header, roof_gbs, session_tokens, time_ms,
    timed_call,
)
from benchmarks.kernel_profile import kernel_profile, profile_lines  # noqa: E402
from benchmarks.walk_bytes import moe_layer_count, state_bytes, weight_bytes  # noqa: E402
from memra.limits import VERIFY_CAP  # noqa: E402

COUNTED_STEPS = 4    # eager decode steps run again with launches counted (counting slows the host)
PROFILED_STEPS = 16  # steps run again under the kernel profiler (graph replay where captured)
PREFILL_REPS = 3     # timed primes per prompt length, median kept: one prime's wall time moved 13% between runs
REPLAY_SETS, REPLAY_REPS = 5, 40  # replay_gpu_ms: sets of back-to-back replays of the captured step


def prefill(model, lengths: list[int], seed: int) -> dict:
    """Prefill tokens/s per prompt length (the median of PREFILL_REPS timed primes); the longest
    prompt's prime is also run once with its launches counted (to name each kernel's module) and
    once under the kernel profiler."""
    for n in lengths:  # first calls: kernel compilation, module loading, cuBLAS's picks per shape
        model.prime(random_tokens(model.cfg, n, seed + 1), model.new_cache(n))
    out = {}
    for n in lengths:
        tokens = random_tokens(model.cfg, n, seed)
        each = [timed_call(partial(model.prime, tokens, model.new_cache(n)), model.be)[0] for _ in range(PREFILL_REPS)]
        ms = float(np.median(each))
        out[f"prompt_{n}"] = {"tokens": n, "ms": ms, "tokens_per_s": n / ms * 1e3, "ms_each": each}
    shortest = random_tokens(model.cfg, min(lengths), seed)
    out[f"prompt_{shortest.size}"]["logits_vs_exact_class"] = prime_vs_exact(model, shortest)
    longest = random_tokens(model.cfg, max(lengths), seed)
    with counted_launches() as launches:
        model.prime(longest, model.new_cache(longest.size))
    if launches:
        out[f"prompt_{longest.size}"]["kernel_profile"] = kernel_profile(
            lambda: model.prime(longest, model.new_cache(longest.size)), 1, list(launches))
    return out


def prime_vs_exact(model, tokens) -> float:
    """max |logits| difference, over the largest logit, between one prime of `tokens` (prime
    class past VERIFY_CAP rows: cuBLAS) and the same prompt primed in exact-class walks."""
    cache = model.new_cache(tokens.size)
    for start in range(0, tokens.size, VERIFY_CAP):
        exact = model.prime(tokens[start:start + VERIFY_CAP], cache)
    got = model.prime(tokens, model.new_cache(tokens.size))
    return float(np.abs(got - exact).max() / np.abs(exact).max())


@contextlib.contextmanager
def blocked_on_result(be):
    """Seconds the host spends inside be.to_host: waiting for the device to finish the step,
    then copying its result (the argmax) back. A step's wall time minus this is the host's own work."""
    inner, spent = be.to_host, [0.0]

    def timed(a):
        start = time.perf_counter()
        out = inner(a)
        spent[0] += time.perf_counter() - start
        return out

    be.to_host = timed
    try:
        yield spent
    finally:
        del be.to_host


def timed_steps(model, cache, token: int, steps: int):
    """Greedy steps after WARMUP_STEPS untimed ones (with graphs: the eager first walk and the
    capture) -> (timing dict, next token)."""
    _, token = greedy_steps(model, cache, token, WARMUP_STEPS)
    with blocked_on_result(model.be) as blocked:
        wall = time.perf_counter()
        times, token = greedy_steps(model, cache, token, steps)
        wall = time.perf_counter() - wall
    ms = float(np.median(times))
    host_ms = (wall - blocked[0]) * 1e3 / steps
    return {"ms_per_step": ms, "ms_per_step_mean": float(np.mean(times)),
            "tokens_per_s": steps / sum(times) * 1e3, "host_ms_per_step": host_ms,
            "host_share": host_ms / ms}, token


def decode(model, args, roof: float | None) -> dict:
    room = 2 * (WARMUP_STEPS + args.steps) + COUNTED_STEPS + PROFILED_STEPS
    cache, token = prime_context(model, args.context, room, args.seed)
    modes = ("eager", "graph") if cache.walks.enabled else ("eager",)  # a runner that captures graphs
    runs = {}
    for mode in modes:
        cache.walks.enabled = mode == "graph"
        runs[mode], token = timed_steps(model, cache, token, args.steps)
    state = state_bytes(model, cache, rows=1)
    cache.walks.enabled = False  # a replayed graph launches nothing through `launch`
    with counted_launches() as launches:
        _, token = greedy_steps(model, cache, token, COUNTED_STEPS)
    cache.walks.enabled = modes[-1] == "graph"
    profile = None if not launches else kernel_profile(
        lambda: greedy_steps(model, cache, token, PROFILED_STEPS), PROFILED_STEPS, list(launches))
    replay_gpu = replay_gpu_ms(cache)  # last: its replays rewrite the step's state rows
    # t = 1: the k experts a row picks are distinct, so k per MoE layer is exact
    weights = weight_bytes(model, [model.cfg.num_experts_per_tok] * moe_layer_count(model), rows=1)
    head = runs[modes[-1]]
    for run in runs.values():
        run["bandwidth_fraction"] = bandwidth_fraction(weights["total"], run["ms_per_step"], roof)
    return head | {
        "mode": modes[-1], "context": args.context, "steps": args.steps,
        "weight_bytes_per_step": weights["total"], "weight_bytes": weights,
        "state_bytes_per_step": state["total"], "state_bytes": state,
        "state_bytes_at_position": cache.pos,
        "launches_per_step": None if launches is None else sum(launches.values()) / COUNTED_STEPS,
        "launches_by_kernel": None if launches is None else {
            k: v / COUNTED_STEPS for k, v in sorted(launches.items())},
        "eager": runs["eager"], "graph_replay": runs.get("graph"), "replay_gpu_ms": replay_gpu,
        "session": session_decode(model, args, weights["total"], roof),
        "kernel_profile": profile,
    }


def session_decode(model, args, weights: int, roof: float | None) -> dict:
    """Greedy tokens/s of PlainSession.burst on a fresh --context-token prompt (common.session_tokens)."""
    ms, tokens = session_tokens(model, random_tokens(model.cfg, args.context, args.seed + 2), args.steps)
    return {"ms_per_token": ms, "tokens_per_s": 1e3 / ms, "tokens": args.steps,
            "bandwidth_fraction": bandwidth_fraction(weights, ms, roof)}


def replay_gpu_ms(cache) -> float | None:
    """GPU milliseconds of one replay of the captured decode step, the median over REPLAY_SETS
    sets of REPLAY_REPS back-to-back replays between CUDA events: the step's device time with no
    host work and no profiler (CUPTI lengthens the kernels it records). None where no decode step
    was captured (numpy's runner, or graphs turned off)."""
    captured = captured_step(cache)
    if captured is None:
        return None

    def replays():
        for _ in range(REPLAY_REPS):
            captured.graph.launch()

    return time_ms(replays, reps=REPLAY_SETS, warmup=1) / REPLAY_REPS


def captured_step(cache):
    """The cache's captured decode step (a CapturedWalk), or None where none was captured."""
    graphs = getattr(cache.walks, "graphs", None)
    if not graphs:
        return None
    steps = [walk for key, walk in graphs.items() if key[:3] == (1, False, ())]  # one row, no snapshots, no taps
    assert len(steps) == 1, f"one captured decode step expected, the runner holds {list(graphs)}"
    return steps[0]


def card(record: dict) -> list[str]:
    d, roof = record["decode"], record["copy_bandwidth_gbs"]
    lines = [card_head(record)
             + (f"  copy bandwidth {roof:.0f} GB/s" if roof else "")]
    for name, p in record["prefill"].items():
        lines.append(f"  prefill {name:<12} {p['ms']:10.2f} ms  {p['tokens_per_s']:10.0f} tokens/s"
                     + (f"  logits vs exact class {p['logits_vs_exact_class']:.2e}" if "logits_vs_exact_class" in p else ""))
    frac = d["bandwidth_fraction"]
    lines.append(f"  decode  {d['ms_per_step']:8.3f} ms/step  {d['tokens_per_s']:8.1f} tokens/s  "
                 f"weights {d['weight_bytes_per_step'] / 1e9:6.2f} GB/step"
                 + (f"  {100 * frac:5.1f}% of copy bw" if frac is not None else "")
                 + f"  state {d['state_bytes_per_step'] / 1e6:7.1f} MB/step")
    launches = d["launches_per_step"]
    for mode in ("eager", "graph_replay"):
        run = d[mode]
        if run is not None:
            lines.append(f"  {mode:<12} {run['ms_per_step']:8.3f} ms/step  host {run['host_ms_per_step']:7.3f} ms/step "
                         f"({100 * run['host_share']:5.1f}% of a step)")
    if d.get("replay_gpu_ms") is not None:
        lines.append(f"  replay GPU   {d['replay_gpu_ms']:8.3f} ms/step  (the captured step alone, no host work)")
    run = d["session"]
    lines.append(f"  session      {run['ms_per_token']:8.3f} ms/token {run['tokens_per_s']:8.1f} tokens/s"
                 + (f"  {100 * run['bandwidth_fraction']:5.1f}% of copy bw" if run["bandwidth_fraction"] else "")
                 + "  (PlainSession, a step ahead of the host)")
    if launches is not None:
        lines.append(f"  {launches:.0f} memra launches per eager step")
    lines += profile_lines(d.get("kernel_profile"), "a decode step")
    for name, p in record["prefill"].items():
        lines += profile_lines(p.get("kernel_profile"), f"the {name} prime")
    return lines


def main(argv=None) -> int:
    ap = model_args(__doc__)
    ap.add_argument("--prompt-lens", type=int_list, default=[512, 4096], help="prefill lengths, e.g. 512,4096")
    args = ap.parse_args(argv)
    model = model_from_args(args)
    roof = roof_gbs(model.be)
    config = model_config(args, model, prompt_lens=args.prompt_lens)
    record = record_header("bench_decode", args.git_sha, config, model.be) | {
        "copy_bandwidth_gbs": roof,
        "prefill": prefill(model, args.prompt_lens, args.seed),
        "decode": decode(model, args, roof),
    }
    emit(record, card(record), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
