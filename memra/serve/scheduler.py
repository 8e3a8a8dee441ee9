"""One worker thread owns the model and interleaves the live sessions at burst boundaries.

    scheduler = Scheduler(engine, metrics, burst_tokens=8, max_sessions=8, max_queue=64, timeout_s=600)
    scheduler.start()
    ticket = scheduler.submit(job, "completions", loop)     # ApiError 503 when the queue is full
    update = await ticket.updates.get()                     # Update(text, tokens, ..., finish_reason)
    scheduler.cancel(ticket)                                # the client left
    scheduler.stop()

Admission: a request becomes a live session (its own cache) while fewer than max_sessions are
live; otherwise it waits in a FIFO of at most max_queue, and past that it is refused (503). The
worker takes the live sessions round robin: a new session's first turn primes its prompt and
emits its first token; every later turn runs one burst of burst_tokens tokens. So a short request
is not stuck behind a long generation (a long prompt's prefill is one turn, though, and holds the
others up for its length), and the tokens never depend on the interleaving (each session owns its
cache and its Philox counters).

Cancellation and timeouts take effect at the next burst boundary: the session is dropped and its
cache freed (`open_caches()` counts the caches still alive). Handlers run on the event loop;
the worker hands them updates through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

from memra.errors import MemraError, describe
from memra.serve.metrics import EMPTY, ServeMetrics
from memra.serve.protocol import ApiError, Job
from memra.serve.runs import open_run, token_logprobs
from memra.serve.text import TextOutput

log = logging.getLogger("memra.serve")
IDLE_WAIT_S = 0.25       # how often an idle worker looks at the queued requests' deadlines


@dataclass
class Update:
    """What one turn produced for a request; the last one has a finish_reason (or an error)."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list | None = None    # [(token, logprob, [(id, logprob), ...])]
    finish_reason: str | None = None
    usage: dict | None = None
    error: ApiError | None = None


class Ticket:
    _ids = itertools.count()

    def __init__(self, job: Job, endpoint: str, loop, timeout_s: float):
        self.id = next(self._ids)
        self.job, self.endpoint, self.loop = job, endpoint, loop
        self.updates: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.deadline = self.arrival + timeout_s
        self.cancelled = False

    def post(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass


class _Live:
    """A ticket with a session: its run, its text, and what the metrics have seen of it."""

    def __init__(self, ticket: Ticket):
        self.ticket, self.run, self.text = ticket, None, None
        self.count, self.last, self.spec = 0, None, EMPTY


class Scheduler:
    def __init__(self, engine, metrics: ServeMetrics, burst_tokens: int = 8, max_sessions: int = 8,
                 max_queue: int = 64, timeout_s: float = 600.0):
        self.engine, self.metrics = engine, metrics
        self.burst_tokens, self.max_sessions, self.max_queue, self.timeout_s = \
            burst_tokens, max_sessions, max_queue, timeout_s
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._live: deque[_Live] = deque()
        self._stopping = False
        self._drain_at: float | None = None   # when draining: the moment what is left gets cancelled
        self._thread: threading.Thread | None = None
        self._caches: list[weakref.ref] = []   # the caches sessions opened, alive or not
        metrics.track(self.counts)

    # ---- the event loop's side ---------------------------------------------------------------
    def submit(self, job: Job, endpoint: str, loop) -> Ticket:
        with self._cond:
            if self._stopping or self._drain_at is not None:
                raise _shutting_down()
            if len(self._live) + len(self._waiting) >= self.max_sessions + self.max_queue:
                raise ApiError(503, f"the server is busy ({len(self._live)} live sessions, {len(self._waiting)} "
                                    "queued requests, the most it holds): retry later", code="queue_full")
            ticket = Ticket(job, endpoint, loop, self.timeout_s)
            self._waiting.append(ticket)
            self._cond.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Drop a request: at once if it is queued, at the next burst boundary if it is live."""
        with self._cond:
            if ticket.cancelled:
                return
            ticket.cancelled = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                self._count(ticket, "cancelled")

    def counts(self) -> dict:
        return {"running": len(self._live), "waiting": len(self._waiting)}

    def open_caches(self) -> int:
        """Caches of sessions still referenced anywhere (0 once every request has ended)."""
        return self._track()

    def _track(self, cache=None) -> int:
        """Forget the caches that are gone, remember `cache`; how many are still alive."""
        with self._cond:
            self._caches = [ref for ref in self._caches if ref() is not None]
            if cache is not None:
                self._caches.append(weakref.ref(cache))
            return len(self._caches)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="memra-worker", daemon=True)
        self._thread.start()

    def drain(self, grace_s: float) -> None:
        """Refuse new requests; in-flight ones get grace_s seconds to finish, then are cancelled
        (each client gets a 503 error, streamed or not)."""
        with self._cond:
            if self._drain_at is None:
                self._drain_at = time.monotonic() + grace_s
            self._cond.notify()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, end what is left (after the server has drained its connections)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---- the worker ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._drain_at is not None and time.monotonic() >= self._drain_at:
                        self._cancel_all()
                    self._expire_waiting()
                    while self._waiting and len(self._live) < self.max_sessions:
                        self._live.append(_Live(self._waiting.popleft()))
                    if self._stopping or self._live:
                        break
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping:
                    break
                entry = self._live[0]
            alive = self._turn(entry)
            with self._cond:  # only this thread changes _live, so entry is still its head
                if alive:
                    self._live.rotate(-1)
                else:
                    self._live.popleft()
        with self._cond:
            self._cancel_all()

    def _turn(self, entry: _Live) -> bool:
        ticket = entry.ticket
        if ticket.cancelled:
            self._end(entry, "cancelled")
            return False
        if time.monotonic() > ticket.deadline:
            self._fail(entry, self._timeout(), "timeout")
            return False
        try:
            if entry.run is None:
                job = ticket.job
                entry.run = open_run(self.engine.model, job, self.engine.drafters.get(job.draft))
                self._track(entry.run.cache)
                self.metrics.prompt_tokens.inc(len(job.prompt))
                tokens = entry.run.step(1)   # the first token comes with the prime: time to first token
            else:
                tokens = entry.run.step(self.burst_tokens)
            update = self._absorb(entry, tokens)
        except ApiError as exc:
            self._fail(entry, exc, "error")
            return False
        except MemraError as exc:
            self._fail(entry, ApiError(400, str(exc)), "error")
            return False
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # a bug (in this worker, no signal raises
            # these): the request fails, the worker, the server and the other sessions go on
            log.exception("request %d failed", ticket.id)
            self._fail(entry, ApiError(500, f"internal error ({describe(exc)}); see the server log"),
                       "error")
            return False
        if update.finish_reason is not None:  # account (and free the cache) before the client hears
            self._end(entry, update.finish_reason)
        ticket.post(update)
        return update.finish_reason is None

    def _absorb(self, entry: _Live, tokens: list[int]) -> Update:
        """Tokens -> the update: logprobs, stop strings on the text, EOS, the metrics."""
        job, run, now = entry.ticket.job, entry.run, time.monotonic()
        if entry.text is None:
            entry.text = TextOutput(self.engine.tokenizer, job.prompt, job.stops)
        kept, logprobs, finish = [], [] if job.logprobs is not None else None, None
        for token in tokens:
            kept.append(token)
            if logprobs is not None:
                logprobs.append((token, *token_logprobs(run.logits.popleft(), token, job.logprobs)))
            if token in job.eos or entry.text.push(token):
                finish = "stop"
                break
        if finish is None and run.done:
            finish = "length"
        if finish is not None:
            entry.text.finish()
        m = self.metrics
        if kept:
            if entry.count == 0:
                m.ttft.observe(now - entry.ticket.arrival)
            else:
                gap = (now - entry.last) / len(kept)
                for _ in kept:
                    m.itl.observe(gap)
            m.generation_tokens.inc(len(kept))
            entry.count += len(kept)
            entry.last = now
        entry.spec = m.spec(entry.spec, run.metrics)
        usage = self._usage(entry) if finish is not None else None
        return Update(entry.text.release(final=finish is not None), kept, logprobs, finish, usage)

    def _usage(self, entry: _Live) -> dict:
        job, spec = entry.ticket.job, entry.spec
        n = len(job.prompt)
        usage = {"prompt_tokens": n, "completion_tokens": entry.count, "total_tokens": n + entry.count,
                 "speculative": None}
        if job.draft is not None:
            drafts, accepted = spec["num_drafts"], spec["num_accepted_tokens"]
            usage["speculative"] = {
                "draft": job.draft, "k": job.num_draft_tokens, **spec,
                "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0}
        return usage

    def _timeout(self) -> ApiError:
        return ApiError(408, f"the request ran past the server's request timeout ({self.timeout_s:g} s): ask for "
                             "fewer tokens, or retry when the server is less busy", code="request_timeout",
                        type="timeout_error")

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for ticket in [t for t in self._waiting if now > t.deadline]:
            self._waiting.remove(ticket)
            self._count(ticket, "timeout")
            ticket.post(Update(error=self._timeout()))

    def _fail(self, entry: _Live, error: ApiError, outcome: str) -> None:
        self._end(entry, outcome)
        entry.ticket.post(Update(error=error))

    def _end(self, entry: _Live, outcome: str) -> None:
        if entry.run is not None:
            entry.run.close()
            entry.run = None
        self._count(entry.ticket, outcome)

    def _count(self, ticket: Ticket, outcome: str) -> None:
        self.metrics.requests.labels(endpoint=ticket.endpoint, outcome=outcome).inc()
        if outcome in ("stop", "length"):
            self.metrics.e2e.observe(time.monotonic() - ticket.arrival)

    def _cancel_all(self) -> None:
        """End every live and queued request with a 503 (the lock is held)."""
        live, waiting = list(self._live), list(self._waiting)
        self._live.clear()
        self._waiting.clear()
        for entry in live:
            self._fail(entry, _shutting_down(), "cancelled")
        for ticket in waiting:
            self._count(ticket, "cancelled")
            ticket.post(Update(error=_shutting_down()))


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down: retry on another replica", code="shutting_down")
