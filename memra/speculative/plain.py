"""Plain decoding as a session: the reference tape, resumable in bursts like SpecSession.

    session = PlainSession(model, prompt_ids, max_ctx, sampling=None)
    tokens = session.burst(target=32, eos=(eos_id,))

Greedy takes the argmax (lowest index on ties); sampled draws from the filtered distribution on
the session's own Philox stream, the stream a SpecSession with the same seed starts from. However
the bursts are cut the tokens are the same. A sampled token is decoded only when it is asked for.
Greedy runs one step ahead: step n + 1 is enqueued, fed step n's argmax where the backend keeps
it, before token n is read, so the device does not idle while the host reads a token and enqueues
the next step. The step ahead runs only where max_ctx leaves room for the token after it, so a
session made with max_ctx = prompt + max new tokens decodes nothing it will not return (but one
step past an EOS); the cache runs at most one step past the last token returned.
"""

from __future__ import annotations

import numpy as np

from memra.arguments import check_count, check_eos
from memra.speculative.metrics import SpecMetrics
from memra.speculative.sampling import SampleStreams, SamplingParams, filtered_rows, refuse_penalties


class PlainSession:
    def __init__(self, model, prompt_ids, max_ctx: int, sampling: SamplingParams | None = None):
        refuse_penalties(sampling)
        self.model = model
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.streams = SampleStreams(model.be, self.sampling.seed) if self.sampling is not None else None
        self.metrics = SpecMetrics()      # no drafts: zero counts, for callers that report them
        self.cache = model.new_cache(max_ctx)
        self.pending = self._choose(model.prime(prompt_ids, self.cache))  # chosen, not yet returned
        self.last = None                  # the last token returned: the next decode step's input
        self.ahead = None                 # greedy: the step after `last`, enqueued (a NextToken)
        self.done = False

    def burst(self, target: int, eos=()) -> list[int]:
        """Up to `target` more tokens; stops after the first token in `eos` (kept), or where the
        cache has no room for the next step (done, as SpecSession at its context guard)."""
        target = check_count(target, "target")
        eos = check_eos(eos, self.model.cfg.vocab_size)
        out: list[int] = []
        while len(out) < target and not self.done:
            if self.pending is None and self.ahead is None and self.cache.pos >= self.cache.max_ctx:
                self.done = True
                break
            if self.pending is None:
                self.pending = self._next()
            self.last, self.pending = self.pending, None
            out.append(self.last)
            self.done = self.last in eos
        return out

    def _next(self) -> int:
        """Decode the last token and choose the next (greedy: the argmax, taken on the device)."""
        if self.sampling is None:
            return self._greedy()
        return self._choose(self.model.decode_logits(self.last, self.cache))

    def _greedy(self) -> int:
        step, self.ahead = self.ahead or self.model.decode_next(self.last, self.cache), None
        if self.cache.pos + 2 <= self.cache.max_ctx:  # room for the step ahead and the token after it
            self.ahead = self.model.decode_next(step, self.cache)
        return step.wait()

    def _choose(self, logits) -> int:
        """The token after a logits row (host, or where the backend keeps it)."""
        if self.sampling is None:
            return int(np.argmax(logits))
        return self.streams.draw(filtered_rows(self.model.be, logits, self.sampling))
