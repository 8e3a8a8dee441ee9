"""memra-ngram: a prompt-lookup (n-gram) draft source, registered as `ngram`.

It keeps the committed context plus the anchor, finds the most recent earlier occurrence of the
last n tokens (n from `n` down to `min_n`) and drafts the up-to-k tokens that followed it:

    context = [1, 2, 3, 4, 2, 3], n=3, min_n=1, k=4
    [4, 2, 3] occurs nowhere earlier; [2, 3] occurs at 1..2 -> propose [4, 2, 3]

No match is an empty proposal (the core then verifies just the anchor). Drafts are copied from
the context, so they are always valid vocab ids. They are point masses (q=None, exact in sampled
sessions too) without confidences (the p_min gate stays off); no weights, no target taps.

    generate(model, prompt, 64, draft="ngram", num_draft_tokens=4, draft_options={"n": 3, "min_n": 1})
"""

from __future__ import annotations

import memra
from memra.errors import InputError
from memra.speculative.contract import Proposal, RoundOutcome, SessionStart

__version__ = "0.1.0"

DEFAULTS = {"n": 3, "min_n": 1}


def lookup(context: list[int], k: int, n: int, min_n: int = 1) -> list[int]:
    """The up-to-k tokens after the most recent earlier occurrence of the context's last
    `size` tokens, trying size = n down to min_n; [] when none of them occurs earlier."""
    for size in range(min(n, len(context) - 1), min_n - 1, -1):
        key = context[-size:]
        for start in range(len(context) - size - 1, -1, -1):
            if context[start:start + size] == key:
                return context[start + size:start + size + k]
    return []


class NgramSource:
    def load(self, model, options: dict | None = None) -> "NgramDrafter":
        options = {**DEFAULTS, **(options or {})}
        unknown = sorted(set(options) - set(DEFAULTS))
        if unknown:
            raise InputError(f"ngram: unknown options {unknown}; it takes only {sorted(DEFAULTS)}")
        n, min_n = options["n"], options["min_n"]
        for key, value in (("n", n), ("min_n", min_n)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"ngram: {key} must be a positive integer, got {value!r}")
        if min_n > n:
            raise InputError(f"ngram: min_n={min_n} is above n={n}: choose 1 <= min_n <= n")
        return NgramDrafter(n, min_n)


class NgramDrafter:
    max_k = 14
    tap_layers: tuple[int, ...] = ()

    def __init__(self, n: int, min_n: int):
        self.n, self.min_n = n, min_n

    def begin(self, start: SessionStart) -> "NgramState":
        return NgramState(self, [int(t) for t in start.prompt] + [int(start.anchor)])


class NgramState:
    def __init__(self, drafter: NgramDrafter, context: list[int]):
        self.drafter = drafter
        self.context = context      # committed tokens, then the anchor (the next verify row 0)

    def propose(self, k: int, sampling=None) -> Proposal:
        return Proposal(tokens=lookup(self.context, k, self.drafter.n, self.drafter.min_n))

    def commit(self, outcome: RoundOutcome) -> None:
        # kept starts with the old anchor; the bonus is the next one
        self.context[-1:] = [int(t) for t in outcome.kept] + [int(outcome.bonus)]


@memra.hookimpl
def memra_register_draft_sources(register):
    register("ngram", NgramSource())
