"""bench_spec: end-to-end speculative decoding at forced acceptance rates, against plain decoding
and against the bound its realised acceptance allows.

    python benchmarks/bench_spec.py --preset bench --backend cuda --git-sha SHA \
        [--out F] [--steps 512] [--context 512] [--alphas 0.5,0.7,0.9,1.0] [--ks 1,3,5,7] [--reps 10]
        [--profile ACCEPT.json] [--trim N] [--draft-steps 128]

Greedy only. After a --context-token prompt: the plain greedy tape and plain tokens/s (a
PlainSession's burst, one step ahead of the host, timed by wall clock as the spec points are; its
tokens must be the tape; `ms_per_step` beside it is one synchronous step); for each K
the verify time of K+1 rows (median of --reps walks, each rewound) and, at each forced alpha, the
real per-round draft cost of native-mtp (when the preset has an MTP block) and of a dflash2
fixture drafter built for the preset: the median propose() time over a session of --draft-steps
tokens in which the source drafts every round but the round's drafts are TapeSource's
(`ForcedDrafter`), so the source keeps what a round at alpha keeps and its next propose pays for
it (native-mtp's first step feeds every kept row: K + 1 of them at alpha = 1); native-mtp's lm head
alone (one row, the part of each draft step an FR-Spec trim cuts; with --trim N also native-mtp
with its draft head trimmed to N token ids, costed as a source of its own), and per source one propose()
at its largest K under the kernel profiler (GPU kernel time against the call's span: what the
host holds up). Then for each (alpha, K)
a session drafted by `TapeSource` (the tape's next K tokens, each corrupted with
probability 1 - alpha: acceptance is forced, draft cost ~0): two untimed rounds (the session's
cache captures its verify walk), then --steps tokens timed. Its output must equal the plain tape
or the run fails. Reported: tokens/s, rounds, mean accepted per round, speedup vs plain, the graphs the session
captured inside its timed burst (0 unless a walk shape is first met there, whose eager walk and
capture are then timed: the card flags it); the bound
E / round time with E the tokens per round the timed rounds committed (so no point can read above
it but by timing noise; the analytic E = (1 - alpha^(K+1)) / (1 - alpha), K + 1 at alpha = 1, is
reported beside it) and round time = verify(K+1) + draft cost, and the fraction achieved; and, per real source, tokens/s
with its draft cost added per round: tokens / (spec time + rounds * draft_ms). With --profile (a
bench_accept record), each of its greedy (source, K) results runs too, the tape corrupted at
position j with 1 - the measured conditional acceptance there and costed with that source's own
draft cost: the speedup a model with that acceptance would see. Prints a card on stderr and ONE
JSON line on stdout.
"""

from __future__ import annotations

import json
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as `python benchmarks/bench_spec.py`: `benchmarks` is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    WARMUP_STEPS, card_head, emit, greedy_steps, model_args, model_config, model_from_args, prime_context, random_tokens,
    record_header, session_tokens, timed_call, verify_times,
)
from benchmarks.kernel_profile import kernel_profile  # noqa: E402
from memra.config import preset  # noqa: E402
from memra.drafters.dflash2 import DFlash2Source  # noqa: E402
from memra.drafters.dflash2.fixture import write_fixture_drafter  # noqa: E402
from memra.drafters.native_mtp import NativeMtpSource  # noqa: E402
from memra.errors import MemraError  # noqa: E402
from memra.limits import MAX_K  # noqa: E402
from memra.speculative.contract import Proposal  # noqa: E402
from memra.speculative.metrics import SpecMetrics  # noqa: E402
from memra.speculative.session import SpecSession  # noqa: E402

# the built-in sources, taken directly: a broken third-party plugin must not void their timing
GRAPH_ROUNDS = 2  # untimed rounds per session: its verify walk runs eagerly once, then is captured
DRAFT_SOURCES = {"native-mtp": NativeMtpSource, "dflash2": DFlash2Source}
HEAD_REPS = 20  # timed calls of native-mtp's lm head alone
PROFILED_PROPOSE = 4  # the propose() profiled per source: past the rounds whose walks capture graphs
PROFILE_FAMILIES = 8  # kernel families kept per draft profile


class TapeSource:
    """A forced-acceptance draft source (benchmark only, never registered): it drafts the next k
    tokens of the plain greedy tape, each replaced with probability 1 - alpha by another token, so
    a round accepts up to the first replaced draft. It is its own drafter and its own state.

        session = SpecSession(model, prompt, TapeSource(tape, 0.7, vocab, seed=0), max_ctx)
        tokens, drafted, accepted = session.burst(32, k=3)     # tokens == tape[:len(tokens)]
    """

    max_k = MAX_K
    tap_layers: tuple[int, ...] = ()

    def __init__(self, tape: list[int], alpha, vocab: int, seed: int):
        # alpha: one rate for every position, or a measured profile (the conditional acceptance
        # at positions 1, 2, ...: a draft survives at j given every draft before it did)
        scalar = np.isscalar(alpha)
        self.alphas = np.asarray([alpha] * MAX_K if scalar else list(alpha), dtype=np.float64)
        self.key = [round(alpha * 1000)] if scalar else [round(a * 1000) for a in alpha]
        self.tape, self.vocab, self.seed = tape, vocab, seed

    def begin(self, start):
        if start.anchor != self.tape[0]:
            raise MemraError(f"the session's first token {start.anchor} is not the tape's {self.tape[0]}: "
                             "prime the session on the tape's own prompt")
        self.pos, self.rng = 0, np.random.default_rng([self.seed, *self.key])
        return self

    def propose(self, k: int, sampling=None) -> Proposal:
        drafts = self.tape[self.pos + 1:self.pos + 1 + k]
        keep = self.rng.random(len(drafts)) < self.alphas[:len(drafts)]
        other = (np.asarray(drafts) + self.rng.integers(1, self.vocab, len(drafts))) % self.vocab
        return Proposal(tokens=[int(t) for t in np.where(keep, drafts, other)])

    def commit(self, outcome) -> None:
        self.pos += len(outcome.kept)


class TimedDrafter:
    """A loaded draft source whose sessions record the milliseconds of every propose(); with
    `profiled`, that call (0-based; past the first rounds, whose walks capture graphs) runs under
    the kernel profiler instead, untimed: its GPU kernel time against its span says how much of
    a draft round the host holds up."""

    def __init__(self, inner, be, profiled: int | None = None, profiler=None):
        self.inner, self.be, self.ms = inner, be, []
        self.max_k, self.tap_layers = inner.max_k, inner.tap_layers
        self.profiled = profiled if profiler is not None else None
        self.profiler, self.profile, self.calls = profiler, None, 0

    def begin(self, start):
        state = self.inner.begin(start)
        propose = state.propose

        def timed(k, sampling=None):
            self.calls += 1
            if self.calls - 1 == self.profiled:
                box = []
                self.profile = self.profiler(lambda: box.append(propose(k, sampling)), 1, [])
                return box[0]
            ms, proposal = timed_call(partial(propose, k, sampling), self.be)
            self.ms.append(ms)
            return proposal

        state.propose = timed
        return state


class ForcedDrafter:
    """A loaded draft source run at a forced acceptance: each round its own propose(k) runs (timed
    when it is a TimedDrafter) on its own state, then the round drafts what `TapeSource` would, so
    the verify accepts as at alpha and the source commits the rows a round at alpha keeps. Its
    cost follows the acceptance: native-mtp's next round feeds every kept row (K + 1 at alpha = 1)
    through its first step, which a round that kept one row does not.

        timed = TimedDrafter(source.load(model), model.be)
        spec_run(model, prompt, ForcedDrafter(timed, TapeSource(tape, 1.0, vocab, 0)), tape, 128, 7)
    """

    def __init__(self, inner, tape: TapeSource):
        self.inner, self.tape = inner, tape
        self.max_k, self.tap_layers = inner.max_k, inner.tap_layers

    def begin(self, start):
        return _ForcedState(self.inner.begin(start), self.tape.begin(start))


class _ForcedState:
    def __init__(self, state, tape: TapeSource):
        self.state, self.tape = state, tape

    def propose(self, k: int, sampling=None) -> Proposal:
        self.state.propose(k, sampling)  # the source's cost; its drafts are not the round's
        return self.tape.propose(k)

    def commit(self, outcome) -> None:
        self.state.commit(outcome)
        self.tape.commit(outcome)


def alpha_key(alpha) -> str:
    """The key of an acceptance in the record's draft costs: the rate ("0.7"), or "profile" for a
    bench_accept profile (costed for its own source only)."""
    return f"{alpha:g}" if np.isscalar(alpha) else "profile"


def spec_run(model, prompt, drafter, tape: list[int], steps: int, k: int):
    """One greedy session: GRAPH_ROUNDS untimed rounds (the session's cache runs its verify walk
    eagerly once, then captures it), then a timed burst of at least `steps` tokens -> (ms of the
    burst, SpecMetrics of its rounds, graphs the cache captured inside the burst: a walk shape the
    warm-up rounds did not meet, whose eager walk and capture the burst then paid); raises unless
    the session's output is the plain tape."""
    session = SpecSession(model, prompt, drafter, max_ctx=len(prompt) + steps + (GRAPH_ROUNDS + 1) * (k + 1) + 8)
    out, _, _ = session.burst(1, k)  # the anchor: the prime's token
    while session.metrics.rounds < GRAPH_ROUNDS:
        out += session.burst(1, k)[0]
    session.metrics = SpecMetrics()
    walks = session.cache.walks
    captures = walks.captures
    ms, (more, _, _) = timed_call(partial(session.burst, steps, k), model.be)
    out += more
    if out != tape[:len(out)]:
        at = next((i for i, (a, b) in enumerate(zip(out, tape)) if a != b), len(tape))  # or ran past it
        raise MemraError(f"greedy speculative output left the plain tape at token {at} (k={k}, drafter "
                         f"{type(drafter).__name__}): spec decoding is broken; this benchmark is void")
    return ms, session.metrics, walks.captures - captures


def head_ms(model, drafter) -> float:
    """Median ms of native-mtp's lm head alone, one row through the drafter's head (full, or
    FR-Spec-trimmed): the part of every draft step a trim can cut. One call at a time, the host's
    launch included (the draft steps themselves replay graphs)."""
    row = model.be.zeros((1, model.cfg.hidden_size))
    call = partial(model.be.linear, row, drafter.head)
    return float(np.median([timed_call(call, model.be)[0] for _ in range(HEAD_REPS)]))


def draft_costs(model, prompt, tape: list[int], args, profile_rates: dict) -> tuple[dict, dict, dict, dict]:
    """Per source: {alpha key: {"K": median ms of one propose(K)}} at each --alphas rate, and under
    "profile" at each (source, K) acceptance profile of profile_rates (ForcedDrafter, a session of
    --draft-steps timed tokens; None where it cannot draft K), or None; the reason for each None
    source; native-mtp's lm head ms per draft step; and per source the kernel profile of one
    propose at its largest K and the largest alpha (None without a profiler)."""
    costs, reasons, heads, profiles = {}, {}, {}, {}
    sources = [(name, source, None) for name, source in DRAFT_SOURCES.items()]
    if args.trim:  # ranks 0..trim-1: on the preset's random weights any trim ids draft alike
        sources.append((f"native-mtp (d2t {args.trim})", NativeMtpSource, {"d2t": np.arange(args.trim)}))
    top = max(args.alphas)
    with tempfile.TemporaryDirectory() as tmp:
        for name, source, options in sources:
            try:
                if name == "dflash2":
                    options = {"path": write_fixture_drafter(tmp, preset(args.preset), seed=args.seed)}
                drafter = source().load(model, options)
            except MemraError as e:
                costs[name], reasons[name] = None, str(e)
                continue
            costs[name] = {}
            deepest = max((k for k in args.ks if k <= drafter.max_k), default=None)
            runs = [(alpha, k) for alpha in args.alphas for k in args.ks]
            runs += [(rates, k) for (src, k), rates in profile_rates.items() if src == name]
            for alpha, k in runs:
                profiled = k == deepest and np.isscalar(alpha) and alpha == top
                timed = TimedDrafter(drafter, model.be, PROFILED_PROPOSE if profiled else None, profiler_for(model.be))
                if k <= timed.max_k:
                    forced = TapeSource(tape, alpha, model.cfg.vocab_size, args.seed + k)
                    spec_run(model, prompt, ForcedDrafter(timed, forced), tape, args.draft_steps, k)
                costs[name].setdefault(alpha_key(alpha), {})[str(k)] = float(np.median(timed.ms)) if timed.ms else None
                if profiled:
                    profiles[name] = _profile_summary(timed.profile, k)
            if name.startswith("native-mtp"):
                heads[name] = head_ms(model, drafter)
    return costs, reasons, heads, profiles


def profiler_for(be):
    """The kernel profiler where the backend launches kernels (none on numpy's host arrays)."""
    return kernel_profile if be.compiles_on_first_use else None


def _profile_summary(prof: dict | None, k: int) -> dict | None:
    """One profiled propose(k): GPU kernel time, span, idle share, the largest kernel families."""
    if prof is None:
        return None
    top = dict(list(prof["families"].items())[:PROFILE_FAMILIES])
    return {"k": k, "kernel_ms": prof["kernel_us_per_step"] / 1e3, "span_ms": prof["span_us_per_step"] / 1e3,
            "idle_share": prof["idle_share"], "families_us": {n: f["us_per_step"] for n, f in top.items()}}


def expected_tokens(alpha, k: int) -> float:
    """E[tokens per round] when each draft survives independently with probability alpha, or,
    for a profile, survives at position j with its conditional rate alpha[j]."""
    rates = [alpha] * k if np.isscalar(alpha) else list(alpha)[:k]
    return float(1 + sum(np.prod(rates[:j + 1]) for j in range(k)))


def profile_points(path: str, ks: list[int]) -> list[tuple[str, int, list[float]]]:
    """(source, K, conditional acceptance per position) for every greedy result of a bench_accept
    record whose source this benchmark can cost and whose K it runs."""
    with open(path, encoding="utf-8") as f:
        record = json.loads(f.readline())
    out = []
    for r in record["results"]:
        if r["mode"] == "greedy" and r["source"] in DRAFT_SOURCES and r["k"] in ks:
            out.append((r["source"], r["k"], [c if c is not None else 0.0 for c in r["conditional"]]))
    return out


def point(model, prompt, tape, alpha, k, verify_ms, costs, plain_tps, args) -> dict:
    source = TapeSource(tape, alpha, model.cfg.vocab_size, args.seed + k)
    ms, m, captured = spec_run(model, prompt, source, tape, args.steps, k)
    tokens = m.rounds + m.num_accepted_tokens  # what the timed rounds committed
    # the bound takes the tokens per round the timed rounds really committed: against the analytic
    # E a short run's luck could read above 100 %
    tps, e = tokens / ms * 1e3, tokens / m.rounds
    with_cost = {}
    for name, per_alpha in costs.items():
        per_k = None if per_alpha is None else per_alpha.get(alpha_key(alpha))
        draft_ms = None if per_k is None else per_k[str(k)]
        with_cost[name] = None if draft_ms is None else {
            "draft_ms": draft_ms, "tokens_per_s": tokens / (ms + m.rounds * draft_ms) * 1e3,
            "bound_tokens_per_s": e / (verify_ms + draft_ms) * 1e3}
        if draft_ms is not None:
            c = with_cost[name]
            c["speedup_vs_plain"] = c["tokens_per_s"] / plain_tps
            c["fraction_of_bound"] = c["tokens_per_s"] / c["bound_tokens_per_s"]
    bound = e / verify_ms * 1e3
    return {
        "alpha": alpha, "k": k, "tokens": tokens, "ms": ms, "tokens_per_s": tps, "rounds": m.rounds,
        "mean_accepted_per_round": m.num_accepted_tokens / m.rounds,
        "expected_tokens_per_round": expected_tokens(alpha, k), "realised_tokens_per_round": e,
        "speedup_vs_plain": tps / plain_tps, "verify_ms": verify_ms, "bound_tokens_per_s": bound,
        "fraction_of_bound": tps / bound,
        "ms_per_round_by_phase": {p: s * 1e3 / m.rounds for p, s in m.seconds.items()},
        "captures_in_timed_burst": captured,
        "with_draft_cost": with_cost,
    }


def card(record: dict) -> list[str]:
    p = record["plain"]
    lines = [card_head(record) + "  plain "
             f"{p['tokens_per_s']:.1f} tokens/s as a session ({p['ms_per_step']:.3f} ms a synchronous step)"]
    for name, reason in record["draft_unavailable"].items():
        lines.append(f"  {name}: not measured ({reason})")
    top = alpha_key(max(record["config"]["alphas"]))
    for name, ms in record["draft_head_ms_per_step"].items():
        per_step = {k: v / int(k) for k, v in record["draft_ms"][name][top].items() if v is not None}
        lines.append(f"  {name}: lm head {ms:.3f} ms of each draft step (at alpha {top}: "
                     + ", ".join(f"K={k}: {v:.3f} ms a step" for k, v in per_step.items()) + ")")
    for name, p in record["draft_profile"].items():
        if p is not None:
            lines.append(f"  {name}: propose(K={p['k']}) GPU kernels {p['kernel_ms']:.2f} ms of a {p['span_ms']:.2f} ms "
                         f"span ({100 * p['idle_share']:.0f}% idle)")
    for r in record["spec"]:
        costs = "".join(f"  {n} {c['tokens_per_s']:8.1f} tok/s x{c['speedup_vs_plain']:4.2f}"
                        for n, c in r["with_draft_cost"].items() if c is not None)
        alpha = f"{r['alpha']:.2f}" if np.isscalar(r["alpha"]) else f"{r['profile']} profile"
        lines.append(f"  alpha={alpha} K={r['k']}  {r['tokens_per_s']:8.1f} tok/s x{r['speedup_vs_plain']:4.2f} "
                     f"plain  accepted/round {r['mean_accepted_per_round']:4.2f}  bound {r['bound_tokens_per_s']:8.1f} "
                     f"({100 * r['fraction_of_bound']:5.1f}%){costs}"
                     + (f"  [{r['captures_in_timed_burst']} graph captures timed]" if r["captures_in_timed_burst"] else ""))
    return lines


def main(argv=None) -> int:
    ap = model_args(__doc__)
    ap.set_defaults(steps=512)  # timed tokens per point: fewer let one lucky run pass its bound
    ap.add_argument("--alphas", type=lambda s: [float(a) for a in s.split(",")], default=[0.5, 0.7, 0.9, 1.0],
                    help="forced acceptance rates, e.g. 0.5,1.0")
    ap.add_argument("--ks", type=lambda s: [int(k) for k in s.split(",")], default=[1, 3, 5, 7],
                    help=f"drafts per round, each in 1..{MAX_K}")
    ap.add_argument("--reps", type=int, default=10, help="timed verify walks per K")
    ap.add_argument("--draft-steps", type=int, default=128,
                    help="timed tokens of each session that costs a source's propose at one (alpha, K)")
    ap.add_argument("--trim", type=int, default=0,
                    help="also cost native-mtp with an FR-Spec trim of its draft head to this many token ids")
    ap.add_argument("--profile", help="a bench_accept JSON record: also run each of its greedy (source, K) "
                    "acceptance profiles, costed with that source's own draft cost")
    args = ap.parse_args(argv)
    model = model_from_args(args)
    # the tape covers a burst's overshoot (up to K tokens past --steps) so drafts never run out
    room = WARMUP_STEPS + max(args.steps, args.draft_steps) + (GRAPH_ROUNDS + 1) * (max(args.ks) + 1)
    cache, anchor = prime_context(model, args.context, room, args.seed)
    tape: list[int] = []
    times, last = greedy_steps(model, cache, anchor, room, tape)
    tape.append(last)
    prompt = random_tokens(model.cfg, args.context, args.seed)
    session_ms, session = session_tokens(model, prompt, args.steps)
    if session != tape[:len(session)]:
        raise MemraError("a plain session left the plain greedy tape: the benchmark's reference is broken")
    plain = {"ms_per_step": float(np.median(times[WARMUP_STEPS:])), "session_ms_per_token": session_ms,
             "tokens_per_s": 1e3 / session_ms}
    cache, _ = prime_context(model, args.context, max(args.ks) + 1, args.seed)
    verify = {k: float(np.median(verify_times(model, cache, tape[:k + 1], args.reps)[0])) for k in args.ks}
    profiled = profile_points(args.profile, args.ks) if args.profile else []
    costs, reasons, heads, profiles = draft_costs(model, prompt, tape, args,
                                                  {(source, k): rates for source, k, rates in profiled})
    spec = [point(model, prompt, tape, a, k, verify[k], costs, plain["tokens_per_s"], args)
            for k in args.ks for a in args.alphas]
    for source, k, rates in profiled:
        measured = point(model, prompt, tape, rates, k, verify[k], {source: costs.get(source)},
                         plain["tokens_per_s"], args)
        spec.append(measured | {"profile": source})
    config = model_config(args, model, alphas=args.alphas, ks=args.ks, reps=args.reps, profile=args.profile,
                          trim=args.trim, draft_steps=args.draft_steps,
                          dflash2_drafter="write_fixture_drafter defaults (2 layers, block 8) for the preset")
    record = record_header("bench_spec", args.git_sha, config, model.be) | {
        "plain": plain, "verify_ms": {str(k): v for k, v in verify.items()}, "draft_ms": costs,
        "draft_head_ms_per_step": heads, "draft_profile": profiles, "draft_unavailable": reasons, "spec": spec,
    }
    emit(record, card(record), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
