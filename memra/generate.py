"""Generation, plain (the reference tape) or speculative, greedy or sampled.

    result = generate(model, prompt_ids, 64, draft="native-mtp", num_draft_tokens=4)
    result.tokens, result.stats["mean_acceptance_length"], result.stats["decode_s"]
    plain = generate(model, prompt_ids, 64).tokens      # the tape every draft source must match

With any draft source the tokens equal the plain greedy tokens byte for byte. `on_tokens`
streams: it is called as tokens are committed, which never changes which tokens come.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memra.arguments import check_draft_k, check_fits_context, check_request
from memra.limits import spec_context
from memra.memory import context_limit
from memra.speculative.contract import check_drafter
from memra.speculative.metrics import SpecMetrics
from memra.speculative.plain import PlainSession
from memra.speculative.session import SpecSession


@dataclass
class GenerateResult:
    tokens: list[int]
    stats: dict = field(default_factory=dict)


def generate(model, prompt_ids, max_new_tokens: int, draft: str | None = None, num_draft_tokens: int = 4,
             draft_options: dict | None = None, sampling=None, eos=(), p_min: float = 0.0,
             pmin0: bool = False, on_tokens=None) -> GenerateResult:
    """Generation, plain (draft=None) or speculative through a named draft source; greedy
    (sampling None or temperature 0: the argmax, lowest index on ties) or sampled (exact in
    distribution; plain draws use the Philox stream a session uses). Stops after
    max_new_tokens or at the first token in `eos` (which is kept).

    on_tokens(new_ids, metrics), if given, is called with each run of newly committed tokens
    (already clipped to max_new_tokens and the first EOS) and the live SpecMetrics (zero
    counts when plain). stats adds prefill_s (prompt to first token, draft warm-up included)
    and decode_s (the rest; time spent inside on_tokens is left out of both).
    """
    from memra.drafters.registry import load_drafter

    # one validation path for plain and speculative alike, before anything loads or allocates
    req = check_request(model, prompt_ids, max_new_tokens, draft, num_draft_tokens, draft_options, sampling, eos,
                        p_min, pmin0, on_tokens)
    prompt, max_new_tokens, sampling, eos, k = req.prompt, req.max_new_tokens, req.sampling, req.eos, req.k
    drafter = None if req.draft is None else load_drafter(req.draft, model, req.draft_options)
    if drafter is not None:  # its declared max_k read once, guarded and checked, before K is judged by it
        check_draft_k(k, check_drafter(drafter, req.draft)[0], req.draft)
    # a speculative round may run k + slack positions past the last token
    check_fits_context(req, *context_limit(model.cfg, model.be), 0 if drafter is None else spec_context(0, 0, k))
    out: list[int] = []
    if max_new_tokens == 0:
        return GenerateResult(out, _stats(SpecMetrics(), 0.0, 0.0))
    clock = _Clock(on_tokens)
    if drafter is None:
        session = PlainSession(model, prompt, len(prompt) + max_new_tokens, sampling)
        step = lambda n: session.burst(n, eos)  # noqa: E731
    else:
        max_ctx = spec_context(len(prompt), max_new_tokens, k)
        session = SpecSession(model, prompt, drafter, max_ctx, p_min=req.p_min, pmin0=req.pmin0, sampling=sampling)
        step = lambda n: session.burst(n, k, eos)[0]  # noqa: E731
    prefill_s = clock.lap()
    delivered = 0
    while len(out) < max_new_tokens and not session.done:
        # streaming asks for one token (plain) or one round (speculative) per burst; the tokens
        # are the same however the bursts are cut
        target = 1 if on_tokens is not None else max_new_tokens - len(out)
        tokens = step(target)
        if not tokens:
            break
        out.extend(tokens)
        if on_tokens is not None:
            new = clip_tokens(out, max_new_tokens, eos)[delivered:]
            delivered += len(new)
            clock.emit(new, session.metrics)
    return GenerateResult(clip_tokens(out, max_new_tokens, eos), _stats(session.metrics, prefill_s, clock.lap()))


class _Clock:
    """Lap times that leave out the time spent in the caller's on_tokens callback."""

    def __init__(self, on_tokens):
        self.on_tokens = on_tokens
        self.mark = time.perf_counter()
        self.excluded = 0.0

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.mark, self.excluded = now - self.mark - self.excluded, now, 0.0
        return max(seconds, 0.0)

    def emit(self, new: list[int], metrics: SpecMetrics) -> None:
        if self.on_tokens is None or not new:
            return
        t0 = time.perf_counter()
        try:
            self.on_tokens(list(new), metrics)
        finally:
            self.excluded += time.perf_counter() - t0


def _stats(metrics: SpecMetrics, prefill_s: float, decode_s: float) -> dict:
    return {**metrics.as_dict(), "prefill_s": prefill_s, "decode_s": decode_s}


def clip_tokens(tokens: list[int], limit: int, eos) -> list[int]:
    """The first `limit` tokens, cut after the first one in `eos` (kept)."""
    tokens = tokens[:limit]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


