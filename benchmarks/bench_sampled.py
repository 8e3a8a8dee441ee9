"""bench_sampled: what sampling costs a token, with the filter where the logits are against the host.

    python benchmarks/bench_sampled.py --preset bench --backend cuda --git-sha SHA \
        [--out F] [--steps 64] [--context 512] [--rows 8] [--reps 20] \
        [--temperature 0.8] [--top-k 0] [--top-p 0.95] [--min-p 0]

Plain sessions on one prompt: greedy ms a token, sampled ms a token (be.filtered_rows, the race
drawn where the row is), and sampled with the host filter (the row copied over, filtered_probs,
the draw uploaded: the path before the filter moved to the device). Then the accept phase of a
sampled round over --rows verify rows of random logits, every draft rejected at the last row:
filtered_rows + accept_walk with the rows on the device, against the [t, V] copy and the host
filter. Medians; on numpy both arms are the host's. Prints a card on stderr and ONE JSON line.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as `python benchmarks/bench_sampled.py`: `benchmarks` is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    WARMUP_STEPS, card_head, emit, model_args, model_config, model_from_args, random_tokens, record_header,
    timed_call,
)
from memra.speculative.plain import PlainSession  # noqa: E402
from memra.speculative.sampling import (  # noqa: E402
    SampleStreams, SamplingParams, accept_walk, filtered_probs, filtered_rows,
)


def plain_ms(model, prompt, steps: int, sp: SamplingParams | None, host_filter: bool = False) -> float:
    """Median ms of a plain session's tokens (each burst of one token timed on its own)."""
    session = PlainSession(model, prompt, len(prompt) + WARMUP_STEPS + steps + 2, sampling=sp)
    if host_filter:
        be = model.be
        session._choose = lambda logits: session.streams.draw(filtered_probs(be.to_host(logits), sp))
    session.burst(WARMUP_STEPS)
    return float(np.median([timed_call(partial(session.burst, 1), model.be)[0] for _ in range(steps)]))


def accept_ms(model, sp: SamplingParams, rows: int, reps: int, seed: int) -> dict:
    """Median ms of one sampled accept over `rows` verify rows, rows on the device vs on the host."""
    be, vocab = model.be, model.cfg.vocab_size
    rng = np.random.default_rng(seed)
    logits = be.asarray((rng.standard_normal((rows, vocab)) * 3).astype(np.float32))
    drafts = rng.integers(0, vocab, rows - 1).tolist()

    def device():
        return accept_walk(filtered_rows(be, logits, sp), drafts, None, SampleStreams(be, seed), be)

    def host():
        p_rows = np.stack([filtered_probs(r, sp) for r in np.asarray(be.to_host(logits))])
        return accept_walk(p_rows, drafts, None, SampleStreams(be, seed))

    out = {}
    for name, fn in (("device", device), ("host", host)):
        fn()  # warm: kernels compile on their first launch
        out[name] = float(np.median([timed_call(fn, be)[0] for _ in range(reps)]))
    return out


def card(record: dict) -> list[str]:
    p, a = record["plain_ms_per_token"], record["accept_ms"]
    return [card_head(record) + f"  {record['config']['sampling']}",
            f"  plain: greedy {p['greedy']:.3f} ms a token, sampled {p['sampled']:.3f} (filter on the host: "
            f"{p['sampled_host_filter']:.3f})",
            f"  accept of {record['config']['rows']} rows: {a['device']:.3f} ms with the rows where the logits are, "
            f"{a['host']:.3f} ms through the host"]


def main(argv=None) -> int:
    ap = model_args(__doc__)
    ap.set_defaults(steps=64)
    ap.add_argument("--rows", type=int, default=8, help="verify rows of the timed accept (K + 1)")
    ap.add_argument("--reps", type=int, default=20, help="timed accepts per arm")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--min-p", type=float, default=0.0)
    args = ap.parse_args(argv)
    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        seed=args.seed)
    model = model_from_args(args)
    prompt = random_tokens(model.cfg, args.context, args.seed)
    plain = {"greedy": plain_ms(model, prompt, args.steps, None), "sampled": plain_ms(model, prompt, args.steps, sp),
             "sampled_host_filter": plain_ms(model, prompt, args.steps, sp, host_filter=True)}
    config = model_config(args, model, rows=args.rows, reps=args.reps, sampling={
        "temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p, "min_p": sp.min_p})
    record = record_header("bench_sampled", args.git_sha, config, model.be) | {
        "plain_ms_per_token": plain, "accept_ms": accept_ms(model, sp, args.rows, args.reps, args.seed)}
    emit(record, card(record), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
