"""Plain decoding as a session: the reference tape, resumable in bursts like SpecSession.

    session = PlainSession(model, prompt_ids, max_ctx, sampling=None)
    tokens = session.burst(target=32, eos=(eos_id,))

Greedy takes the argmax (lowest index on ties); sampled draws from the filtered distribution on
the session's own Philox stream, the stream a SpecSession with the same seed starts from. A token
is decoded only when it is asked for, so however the bursts are cut the tokens are the same and
the cache never runs past the last token returned.
"""

from __future__ import annotations

import numpy as np

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
        self.done = False

    def burst(self, target: int, eos=()) -> list[int]:
        """Up to `target` more tokens; stops after the first token in `eos` (kept)."""
        out: list[int] = []
        while len(out) < target and not self.done:
            if self.pending is None:
                self.pending = self._next()
            self.last, self.pending = self.pending, None
            out.append(self.last)
            self.done = self.last in eos
        return out

    def _next(self) -> int:
        """Decode the last token and choose the next (greedy: the argmax, taken on the device)."""
        if self.sampling is None:
            return self.model.decode_greedy(self.last, self.cache)
        return self._choose(self.model.decode_logits(self.last, self.cache))

    def _choose(self, logits) -> int:
        """The token after a logits row (host, or where the backend keeps it)."""
        if self.sampling is None:
            return int(np.argmax(logits))
        return self.streams.draw(filtered_rows(self.model.be, logits, self.sampling))
