"""Shared pieces of the server tests: a server in a thread on an ephemeral port, an oracle draft
source (acceptance that is neither none nor all, so the counters have something to count), and
the solo `generate` runs a served request must equal."""

import time

import pytest

from memra import generate, hookimpl, load_model
from memra.speculative.contract import Proposal

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from memra.serve.app import ServeSettings, create_app  # noqa: E402
from memra.serve.engine import Engine, EngineOptions  # noqa: E402
from memra.serve.inprocess import InProcessServer  # noqa: E402

class Server(InProcessServer):
    """create_app(engine) in a daemon thread of the test process, on 127.0.0.1:0, plus the test
    conveniences: an httpx client and a wait for the scheduler to go idle."""

    def __init__(self, engine, **settings):
        super().__init__(create_app(engine, ServeSettings(**settings)))
        self.scheduler = self.app.state.scheduler

    def client(self, **kw) -> "httpx.Client":
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60.0), **kw)

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """Poll until no session is live or queued; returns the last counts."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = self.scheduler.counts()
            if counts["running"] == counts["waiting"] == 0 or time.monotonic() > deadline:
                return counts
            time.sleep(0.02)


def make_engine(checkpoint, drafter_dir=None, **options) -> Engine:
    draft_options = {"dflash2": {"path": str(drafter_dir)}} if drafter_dir else {}
    options.setdefault("served_model_name", "small")
    return Engine(EngineOptions(checkpoint=str(checkpoint), backend="numpy", draft_options=draft_options, **options))


class OracleSource:
    """Drafts the plain greedy continuation of a known prompt (from `tapes`, prompt tuple ->
    tokens), spoiling the last draft of every other round. Greedy requests only."""

    name, max_k, tap_layers = "oracle", 14, ()

    def __init__(self, tapes: dict, vocab: int):
        self.tapes, self.vocab = tapes, vocab

    def load(self, model, options):
        return self

    def begin(self, start):
        return _OracleState(self.tapes.get(tuple(start.prompt), []), self.vocab)


class _OracleState:
    def __init__(self, tape, vocab):
        self.tape, self.vocab, self.n, self.rounds = tape, vocab, 1, 0  # the anchor is tape[0]

    def propose(self, k, sampling):
        drafts = list(self.tape[self.n:self.n + k])
        if self.rounds % 2 and drafts:
            drafts[-1] = (drafts[-1] + 1) % self.vocab
        self.rounds += 1
        return Proposal(tokens=drafts)

    def commit(self, outcome):
        self.n += len(outcome.kept)  # the accepted drafts and the bonus


class OraclePlugin:
    def __init__(self, source):
        self.source = source

    @hookimpl
    def memra_register_draft_sources(self, register):
        register("oracle", self.source)


class Solo:
    """The solo runs served requests are compared with, on a model of their own (never the one the
    server's worker is using)."""

    def __init__(self, checkpoint, drafter_dir=None, eos=()):
        self.model = load_model(str(checkpoint), backend="numpy")
        self.drafter_dir, self.eos = drafter_dir, eos

    def tokens(self, prompt, max_tokens, draft=None, k=4, sampling=None, eos=None):
        options = {"path": str(self.drafter_dir)} if draft == "dflash2" else None
        return generate(self.model, prompt, max_tokens, draft=draft, num_draft_tokens=k, draft_options=options,
                        sampling=sampling, eos=self.eos if eos is None else eos)


def sse_events(response) -> list:
    """The JSON payloads of an SSE response, up to [DONE] (which must come)."""
    import json

    events = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return events
        events.append(json.loads(line[len("data: "):]))
    raise AssertionError(f"the stream ended without [DONE] after {len(events)} events")
