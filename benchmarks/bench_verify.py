"""bench_verify: one verify walk of t rows against one plain decode step, and against the roof.

    python benchmarks/bench_verify.py --preset bench --backend cuda --git-sha SHA \
        [--out F] [--steps 32] [--context 512] [--rows 1-15] [--reps 10]

After a --context-token prime, for each t in --rows: the time of model.verify_greedy over t rows
(the anchor and its greedy continuation: the rows a fully accepted round verifies; each row's
argmax taken on the device, as the decode step it is compared with takes its own), beside it
model.verify_rows (the same walk with its [t, V] logits copied to the host), and apart from
them the time of model.rollback at keep=1 (every draft rejected), at the keep whose KDA replay
walks the most rows (from the walk's last state mark: keep 11 of 15) and at keep=t-1 (all but
the last); then the walk is undone from its checkpoint (model.rewind), so
every repetition starts from the same cache. Also: the ratio to a plain
decode step timed in the same run, the weight bytes the walk reads (trunk arrays once, the
distinct routed experts its rows picked, recorded in an untimed walk; exact on bench-dense too),
the state bytes it reads, and the fraction of the copy bandwidth (none on numpy). Prints a card on
stderr and ONE JSON line on stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as `python benchmarks/bench_verify.py`: `benchmarks` is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    WARMUP_STEPS, bandwidth_fraction, card_head, counted_launches, emit, greedy_steps, int_list, model_args,
    model_config, model_from_args, prime_context, record_header, roof_gbs, routed_experts, verify_times,
)
from benchmarks.kernel_profile import kernel_profile, profile_lines  # noqa: E402
from benchmarks.walk_bytes import state_bytes, weight_bytes  # noqa: E402
from memra.kernels_cu.constants import KDA_MARK_ROWS  # noqa: E402
from memra.limits import VERIFY_CAP  # noqa: E402

PROFILED_WALKS = 4  # walks of each row count run again under the kernel profiler, each rewound


def greedy_tape(model, cache, anchor: int, n: int) -> list[int]:
    """The anchor and its n - 1 greedy successors, each from a walk rewound at once (row r of a
    walk is the plain decode step). Runs every row count below n: the warmup."""
    tape = [anchor]
    while len(tape) < n:
        logits, _, ckpt = model.verify_rows(tape, cache)
        model.rewind(cache, ckpt)
        tape.append(int(np.argmax(logits[-1])))
    return tape


def longest_replay(t: int) -> int:
    """The keep (1..t-1) whose rollback replays the most KDA rows: the rows past its last mark."""
    return max(range(1, max(t, 2)), key=lambda keep: (keep % KDA_MARK_ROWS, keep))


def walk(model, cache, tokens: list[int], reps: int, roof: float | None) -> dict:
    graphs, cache.walks.enabled = cache.walks.enabled, False  # counted eagerly: routed_experts reads the experts back per layer
    with routed_experts(model.be) as picked, counted_launches() as launches:
        _, _, ckpt = model.verify_rows(tokens, cache)
    cache.walks.enabled = graphs
    model.rewind(cache, ckpt)
    verify, rollback = verify_times(model, cache, tokens, reps)
    with_logits, _ = verify_times(model, cache, tokens, reps, host_logits=True)
    _, rollback_last = verify_times(model, cache, tokens, reps, keep=max(len(tokens) - 1, 1))
    longest = longest_replay(len(tokens))
    _, rollback_longest = verify_times(model, cache, tokens, reps, keep=longest)
    profile = None if not launches else kernel_profile(
        lambda: verify_times(model, cache, tokens, PROFILED_WALKS), PROFILED_WALKS, list(launches))
    t, ms = len(tokens), float(np.median(verify))
    weights = weight_bytes(model, picked, rows=t)
    state = state_bytes(model, cache, rows=t, snapshot=True)
    return {
        "rows": t, "verify_ms": ms, "verify_rows_ms": float(np.median(with_logits)),
        "rollback_keep1_ms": float(np.median(rollback)),
        "rollback_keep_last_ms": float(np.median(rollback_last)),  # t - 1 rows kept
        "rollback_longest_keep": longest,
        "rollback_longest_ms": float(np.median(rollback_longest)),  # the keep that replays the most rows
        "weight_bytes": weights["total"], "weight_bytes_by_part": weights,
        "distinct_experts_per_moe_layer": picked,
        "bandwidth_fraction": bandwidth_fraction(weights["total"], ms, roof),
        "state_bytes": state["total"], "state_bytes_by_part": state,
        "launches": None if launches is None else sum(launches.values()),
        "kernel_profile": profile,  # a walk, its rollback(keep=1) and its rewind
    }


def card(record: dict) -> list[str]:
    roof = record["copy_bandwidth_gbs"]
    lines = [card_head(record)
             + (f"  copy bandwidth {roof:.0f} GB/s" if roof else "")
             + f"  decode step {record['decode_ms']:.3f} ms"]
    for w in record["verify"].values():
        frac = w["bandwidth_fraction"]
        lines.append(f"  t={w['rows']:<2} verify {w['verify_ms']:8.3f} ms  x{w['ratio_to_decode']:5.2f} decode  "
                     f"(logits to the host {w['verify_rows_ms']:8.3f} ms)  "
                     f"rollback {w['rollback_keep1_ms']:7.3f} / {w['rollback_longest_ms']:7.3f} / {w['rollback_keep_last_ms']:7.3f} ms (keep 1 / {w['rollback_longest_keep']} / t-1)  weights {w['weight_bytes'] / 1e9:6.2f} GB"
                     + (f"  {100 * frac:5.1f}% of copy bw" if frac is not None else ""))
    widest = max(record["verify"].values(), key=lambda w: w["rows"])
    return lines + profile_lines(widest.get("kernel_profile"), f"a {widest['rows']}-row walk with its rollback")


def main(argv=None) -> int:
    ap = model_args(__doc__)
    ap.add_argument("--rows", type=int_list, default=list(range(1, VERIFY_CAP + 1)),
                    help="row counts t, e.g. 1-15 (the default) or 1,8")
    ap.add_argument("--reps", type=int, default=10, help="timed walks per row count")
    args = ap.parse_args(argv)
    model = model_from_args(args)
    roof = roof_gbs(model.be)
    cache, anchor = prime_context(model, args.context, VERIFY_CAP + WARMUP_STEPS + args.steps, args.seed)
    tape = greedy_tape(model, cache, anchor, max(args.rows))
    walks = {f"t{t}": walk(model, cache, tape[:t], args.reps, roof) for t in args.rows}
    times, _ = greedy_steps(model, cache, anchor, WARMUP_STEPS + args.steps)
    decode_ms = float(np.median(times[WARMUP_STEPS:]))
    for w in walks.values():
        w["ratio_to_decode"] = w["verify_ms"] / decode_ms
    config = model_config(args, model, rows=args.rows, reps=args.reps)
    record = record_header("bench_verify", args.git_sha, config, model.be) | {
        "copy_bandwidth_gbs": roof, "decode_ms": decode_ms, "verify": walks,
    }
    emit(record, card(record), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
