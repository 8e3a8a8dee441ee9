"""Generation: plain greedy decoding (the reference tape) and speculative greedy decoding.

    result = generate(model, prompt_ids, 64, draft="native-mtp", num_draft_tokens=4)
    result.tokens, result.stats["mean_acceptance_length"]

With any draft source the tokens equal the plain greedy tokens byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memra.errors import InputError
from memra.spec.metrics import SpecMetrics
from memra.spec.sampling import SampleStreams, SamplingParams, filtered_probs


@dataclass
class GenerateResult:
    tokens: list[int]
    stats: dict = field(default_factory=dict)


def greedy(model, prompt_ids, max_new_tokens: int, eos_ids=(), max_ctx: int | None = None) -> list[int]:
    """Prime on the prompt, then take the argmax (lowest index on ties) step by step.

    Stops after max_new_tokens or at the first token in eos_ids (which is kept).
    """
    _check_count(max_new_tokens)
    prompt = list(prompt_ids)
    out: list[int] = []
    if max_new_tokens == 0:
        return out
    cache = model.new_cache(max_ctx or len(prompt) + max_new_tokens)
    logits = model.prime(prompt, cache)
    while True:
        token = int(np.argmax(logits))
        out.append(token)
        if token in eos_ids or len(out) == max_new_tokens:
            return out
        logits = model.decode_step(token, cache)


def sampled(model, prompt_ids, max_new_tokens: int, sampling: SamplingParams, eos_ids=()) -> list[int]:
    """Plain sampled decoding: each token drawn from the filtered target distribution, on the
    same Philox draw stream (counter sctr) a speculative session uses."""
    _check_count(max_new_tokens)
    if sampling.penalised:
        raise InputError("repetition/presence/frequency penalties are not supported: drop them")
    prompt = list(prompt_ids)
    out: list[int] = []
    if max_new_tokens == 0:
        return out
    streams = SampleStreams(model.be, sampling.seed)
    cache = model.new_cache(len(prompt) + max_new_tokens)
    logits = model.prime(prompt, cache)
    while True:
        token = streams.draw(filtered_probs(logits, sampling))
        out.append(token)
        if token in eos_ids or len(out) == max_new_tokens:
            return out
        logits = model.decode_step(token, cache)


def generate(model, prompt_ids, max_new_tokens: int, draft: str | None = None, num_draft_tokens: int = 4,
             draft_options: dict | None = None, sampling=None, eos=(), p_min: float = 0.0,
             pmin0: bool = False) -> GenerateResult:
    """Generation, plain (draft=None) or speculative through a named draft source; greedy
    (sampling None or temperature 0) or sampled (exact in distribution)."""
    from memra.drafters.registry import load_drafter
    from memra.spec.session import SpecSession

    _check_count(max_new_tokens)
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise InputError("sampling must be a memra.SamplingParams (or None for greedy)")
    if sampling is not None and sampling.greedy:
        sampling = None
    eos = tuple(int(e) for e in eos)
    if draft is None:
        tokens = greedy(model, prompt_ids, max_new_tokens, eos) if sampling is None else \
            sampled(model, prompt_ids, max_new_tokens, sampling, eos)
        return GenerateResult(tokens, SpecMetrics().as_dict())
    drafter = load_drafter(draft, model, draft_options)
    prompt = [int(t) for t in prompt_ids]
    out: list[int] = []
    if max_new_tokens == 0:
        return GenerateResult(out, SpecMetrics().as_dict())
    max_ctx = len(prompt) + max_new_tokens + num_draft_tokens + 8
    session = SpecSession(model, prompt, drafter, max_ctx, p_min=p_min, pmin0=pmin0, sampling=sampling)
    while len(out) < max_new_tokens and not session.done:
        tokens, _, _ = session.burst(max_new_tokens - len(out), num_draft_tokens, eos)
        if not tokens:
            break
        out.extend(tokens)
    return GenerateResult(_clip(out, max_new_tokens, eos), session.metrics.as_dict())


def _clip(tokens: list[int], limit: int, eos) -> list[int]:
    tokens = tokens[:limit]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def _check_count(n) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise InputError(f"max_new_tokens must be a non-negative integer, got {n!r}")
