"""A request's decoding, resumable at burst boundaries: the server's unit of work.

    run = open_run(engine.model, job, drafter)      # primes the prompt: the first token is ready
    new = run.step(8)                               # up to 8 more tokens (clipped to max_tokens, EOS)
    run.done, run.metrics, run.logits.popleft()     # the target's logits row of each emitted token
    run.close()                                     # drops the cache

A run drives the sessions `memra.generate` drives: `SpecSession` for a draft source (its state and
Philox counters carry across bursts), `PlainSession` for plain decoding, on a cache of the size
generate gives it. So a request's tokens equal `generate(...)`'s for the same arguments, however
its bursts are cut and whatever runs between them.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from memra.generate import clip_tokens
from memra.limits import spec_context
from memra.model.tokens import NextToken, host_id
from memra.speculative.plain import PlainSession
from memra.speculative.session import SpecSession


def open_run(model, job, drafter=None) -> "Run":
    tap = LogitTap(model) if job.logprobs is not None else None
    target = tap or model
    if job.draft is None:
        session = PlainSession(target, job.prompt, len(job.prompt) + job.max_tokens, job.sampling)
        burst = lambda n: session.burst(n, job.eos)  # noqa: E731
    else:
        max_ctx = spec_context(len(job.prompt), job.max_tokens, job.num_draft_tokens)
        session = SpecSession(target, job.prompt, drafter, max_ctx, p_min=job.p_min, pmin0=job.pmin0,
                              sampling=job.sampling)
        burst = lambda n: session.burst(n, job.num_draft_tokens, job.eos)[0]  # noqa: E731
    return Run(session, burst, job, tap)


class Run:
    def __init__(self, session, burst, job, tap):
        self.session, self._burst = session, burst
        self.eos, self.max_new = job.eos, job.max_tokens
        self.cache, self.metrics = session.cache, session.metrics
        self.logits = tap.rows if tap is not None else None
        self.count = 0
        self.done = False

    def step(self, n: int) -> list[int]:
        if self.done:
            return []
        left = self.max_new - self.count
        tokens = clip_tokens(self._burst(min(n, left)), left, self.eos)
        self.count += len(tokens)
        self.done = not tokens or self.session.done or self.count >= self.max_new or tokens[-1] in self.eos
        return tokens

    def close(self) -> None:
        self.session = self._burst = self.cache = self.logits = None


class LogitTap:
    """The model as a session sees it, plus a record of the target's logits row behind each
    token the session emits: the prime's last row (the first token), then for every round the
    rows of its verify walk that the rollback keeps (j accepted drafts and the bonus)."""

    def __init__(self, model):
        self._model = model
        self._verified = None
        self.rows = deque()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def prime_rows(self, token_ids, cache, tap_layers=()):
        out = self._model.prime_rows(token_ids, cache, tap_layers)
        self.rows.append(out[0])
        return out

    def prime(self, token_ids, cache):
        logits = self._model.prime(token_ids, cache)
        self.rows.append(logits)
        return logits

    def decode_step(self, token, cache):
        logits = self._model.decode_step(token, cache)
        self.rows.append(logits)
        return logits

    def decode_logits(self, token, cache):
        """The logprobs need the row on the host anyway."""
        return self.decode_step(token, cache)

    def decode_greedy(self, token, cache) -> int:
        """The logprobs need the row on the host anyway: take the argmax there."""
        return int(np.argmax(self.decode_step(token, cache)))

    def decode_next(self, token, cache) -> NextToken:
        """decode_greedy, at once: nothing is left in flight."""
        ids = np.array([self.decode_greedy(host_id(token), cache)])
        return NextToken(ids, lambda: ids)

    def verify_rows(self, token_ids, cache, tap_layers=()):
        out = self._model.verify_rows(token_ids, cache, tap_layers)
        self._verified = out[0]
        return out

    def verify_logits(self, token_ids, cache, tap_layers=()):
        """The logprobs need every row on the host anyway."""
        return self.verify_rows(token_ids, cache, tap_layers)

    def verify_greedy(self, token_ids, cache, tap_layers=()):
        """The logprobs need every row on the host anyway: take the argmaxes there."""
        logits, collapsed, ckpt = self.verify_rows(token_ids, cache, tap_layers)
        return np.argmax(logits, axis=-1).tolist(), collapsed, ckpt

    def rollback(self, cache, ckpt, keep: int) -> None:
        self._model.rollback(cache, ckpt, keep)
        self.rows.extend(self._verified[:keep])
        self._verified = None


def token_logprobs(logits, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) under the target's raw distribution (log-softmax of the logits, before
    temperature and filters) and the `top` most likely ids with theirs (ties: lowest id first)."""
    z = np.asarray(logits, dtype=np.float64)
    m = z.max()
    lp = z - (m + np.log(np.exp(z - m).sum()))
    best = np.lexsort((np.arange(z.size), -z))[:top] if top else []
    return float(lp[token]), [(int(i), float(lp[i])) for i in best]
