"""Plain greedy generation: the reference every speculative tape must equal byte for byte."""

from __future__ import annotations

import numpy as np

from memra.errors import InputError


def greedy(model, prompt_ids, max_new_tokens: int, eos_ids=(), max_ctx: int | None = None) -> list[int]:
    """Prime on the prompt, then take the argmax (lowest index on ties) step by step.

    Stops after max_new_tokens or at the first token in eos_ids (which is kept).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    prompt = list(prompt_ids)
    cache = model.new_cache(max_ctx or len(prompt) + max_new_tokens)
    logits = model.prime(prompt, cache)
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = int(np.argmax(logits))
        out.append(token)
        if token in eos_ids or len(out) == max_new_tokens:
            break
        logits = model.decode_step(token, cache)
    return out
