"""Shared helpers for the speculative exactness battery.

Backend-agnostic: every helper takes a loaded model and compares host copies, so the GPU twin
runs the same checks with `model_fixture("cuda")`. The battery's one claim: greedy speculative
output is the plain greedy tape byte for byte, for every draft source, K and acceptance pattern.

    model = model_fixture("numpy")            # in a test module: mini (seed 0) and small (seed 13)
    tape = plain_tape(model, prompt_ids(model), 64)
    oracle = Oracle(tape, model.cfg.vocab_size, reject_at=lambda r: r % (k + 1))
    session = open_session(model, prompt_ids(model), oracle=oracle)
    tokens = run_bursts(session, 40, k)        # == tape[:len(tokens)]
"""

from __future__ import annotations

import numpy as np
import pytest

import memra
from memra.drafters.registry import load_drafter
from memra.errors import MemraError
from memra.generate import generate
from memra.model.tokens import NextToken
from memra.speculative.sampling import SampleStreams, filtered_probs
from memra.speculative.session import GateInstruments, SpecSession

MODELS = (("mini", 0), ("small", 13))
PROMPT_LEN = 24   # past the kpool dense threshold (11 tokens): verify walks run sparse
MAX_CTX = 192
POOL = 4          # index_kpool of both presets


def model_fixture(backend: str = "numpy"):
    """A module-scoped `model` fixture over MODELS on `backend`."""

    @pytest.fixture(scope="module", params=MODELS, ids=[name for name, _ in MODELS])
    def model(request, fixture_dir):
        name, seed = request.param
        return memra.load_model(fixture_dir(name, seed=seed), backend=backend)

    return model


def prompt_ids(model, n: int = PROMPT_LEN, seed: int = 7) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, model.cfg.vocab_size, n)]


def host(model, a) -> np.ndarray:
    return np.asarray(model.be.to_host(a))


def primed(model, prompt, max_ctx: int = MAX_CTX):
    """(cache, logits) after the prompt."""
    cache = model.new_cache(max_ctx)
    return cache, host(model, model.prime(prompt, cache))


def plain_tape(model, prompt, n: int) -> list[int]:
    return generate(model, prompt, n).tokens


def hand_tape(model, prompt, n: int, sampling=None) -> list[int]:
    """The plain tape by definition: prime, then one decode_step per token, the argmax on the
    host or a draw on the session's stream (no PlainSession, no step ahead)."""
    cache = model.new_cache(len(prompt) + n)
    streams = SampleStreams(model.be, sampling.seed) if sampling else None
    choose = (lambda z: int(np.argmax(z))) if sampling is None else \
        (lambda z: streams.draw(filtered_probs(z, sampling)))
    out = [choose(model.prime(prompt, cache))]
    while len(out) < n:
        out.append(choose(model.decode_step(out[-1], cache)))
    return out


def feed_next_id_over(monkeypatch, model) -> None:
    """Red arm of the greedy step ahead: every device-fed decode_next gets the next id over
    instead of the argmax."""
    decode_next = type(model).decode_next

    def shifted(self, token, cache):
        if isinstance(token, NextToken):
            token = NextToken((token.ids + 1) % self.cfg.vocab_size, token.read)
        return decode_next(self, token, cache)

    monkeypatch.setattr(type(model), "decode_next", shifted)


# ---- plain chains: the never-drafted reference --------------------------------------------------
def decode_chain(model, cache, tokens) -> np.ndarray:
    """decode_step each token in order; logits rows [n, V] (host)."""
    rows = [host(model, model.decode_step(t, cache)) for t in tokens]
    return np.stack(rows) if rows else np.zeros((0, model.cfg.vocab_size), np.float32)


def collapsed_chain(model, cache, tokens) -> np.ndarray:
    """The decode step's own one-row walk per token, keeping its collapsed row; [n, D] (host)."""
    rows = []
    for t in tokens:
        _, collapsed = model.forward_rows(np.asarray([t], dtype=np.int64), cache)
        cache.pos += 1
        rows.append(host(model, collapsed)[0])
    return np.stack(rows)


# ---- cache state -------------------------------------------------------------------------------
def live_state(model, cache) -> dict:
    """Host copies of everything a later step can read: KDA rings and states, each latent plane's
    rows below its length, and its finalized pool keys. Two caches that agree here decode alike."""
    out = _kda_state(model, cache)
    for i, plane in sorted(cache.mla.items()):
        n = plane.length
        out[f"mla{i}.length"] = n
        out[f"mla{i}.latent"] = host(model, plane.latent)[:n].copy()
        if plane.pool_keys is not None:
            out[f"mla{i}.pools_ready"] = plane.pools_ready
            out[f"mla{i}.index_keys"] = host(model, plane.index_keys)[:n].copy()
            out[f"mla{i}.index_gates"] = host(model, plane.index_gates)[:n].copy()
            out[f"mla{i}.pool_keys"] = host(model, plane.pool_keys)[:plane.pools_ready].copy()
    return out


def full_state(model, cache) -> dict:
    """Host copies of every array and counter of the cache (dead rows included): for 'untouched'."""
    out = _kda_state(model, cache)
    for i, plane in sorted(cache.mla.items()):
        out[f"mla{i}.length"], out[f"mla{i}.pools_ready"] = plane.length, plane.pools_ready
        for name in ("latent", "index_keys", "index_gates", "pool_keys"):
            arr = getattr(plane, name)
            if arr is not None:
                out[f"mla{i}.{name}"] = host(model, arr).copy()
    return out


def _kda_state(model, cache) -> dict:
    out = {"pos": cache.pos}
    for i, st in sorted(cache.kda.items()):
        out[f"kda{i}.ring"] = host(model, st.ring).copy()
        out[f"kda{i}.state"] = host(model, st.state).copy()
    return out


def state_diff(a: dict, b: dict, ignore=()) -> list[str]:
    """Keys whose values differ (bitwise for arrays)."""
    keys = (set(a) | set(b)) - set(ignore)
    bad = []
    for key in sorted(keys):
        x, y = a.get(key), b.get(key)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            same = x is not None and y is not None and x.shape == y.shape and np.array_equal(x, y)
        else:
            same = x == y
        if not same:
            bad.append(key)
    return bad


def indexer_planes(cache) -> dict:
    """The latent planes that own pool keys (layers with their own kpool indexer)."""
    return {i: p for i, p in cache.mla.items() if p.pool_keys is not None}


# ---- sessions ----------------------------------------------------------------------------------
class Oracle:
    """A `draft_override` that knows the plain tape: every slot gets the true greedy token,
    except the slot `reject_at(round)` names, which gets a wrong one (so the round accepts
    exactly that many drafts). Bind it to its session before the first burst."""

    def __init__(self, tape, vocab: int, reject_at=lambda rnd: None):
        self.tape, self.vocab, self.reject_at = list(tape), vocab, reject_at
        self.session = None
        self.plen = 0

    def bind(self, session) -> None:
        self.session, self.plen = session, len(session.committed)

    def true_token(self, slot: int, default: int) -> int:
        # the anchor is tape[len(committed) - plen]; slot i drafts the token after it
        idx = len(self.session.committed) - self.plen + 1 + slot
        return self.tape[idx] if idx < len(self.tape) else default

    def __call__(self, rnd: int, slot: int, draft: int) -> int:
        true = self.true_token(slot, draft)
        return (true + 1) % self.vocab if slot == self.reject_at(rnd) else true


def open_session(model, prompt, max_ctx: int = MAX_CTX, drafter=None, oracle: Oracle | None = None,
                 instruments: GateInstruments | None = None, **kwargs) -> SpecSession:
    """A SpecSession over native-mtp (or `drafter`), with the oracle wired in as draft_override."""
    drafter = drafter or load_drafter("native-mtp", model)
    instruments = instruments or GateInstruments()
    if oracle is not None:
        instruments.draft_override = oracle
    session = SpecSession(model, prompt, drafter, max_ctx, instruments=instruments, **kwargs)
    if oracle is not None:
        oracle.bind(session)
    return session


def run_bursts(session, n: int, k: int, sizes=None, eos=()) -> list[int]:
    """Burst until n tokens are out (unclamped), the session ends, or a burst comes back empty.
    `sizes` cycles the burst targets; None asks for everything left in one burst."""
    out: list[int] = []
    i = 0
    while len(out) < n and not session.done:
        target = n - len(out) if sizes is None else sizes[i % len(sizes)]
        tokens, _, _ = session.burst(target, k, eos)
        if not tokens:
            break
        out.extend(tokens)
        i += 1
    return out


def round_log(session) -> list[tuple[int, int]]:
    """Record (drafted, accepted) per round, as the draft source sees it in commit()."""
    log: list[tuple[int, int]] = []
    state = session.state
    commit = state.commit

    def wrapped(outcome):
        log.append((len(outcome.drafted), len(outcome.kept) - 1))
        return commit(outcome)

    state.commit = wrapped
    return log


def proposal_log(session) -> list:
    """Record every Proposal the draft state makes (tokens and confidences)."""
    log: list = []
    state = session.state
    propose = state.propose

    def wrapped(k, sampling):
        prop = propose(k, sampling)
        log.append(prop)
        return prop

    state.propose = wrapped
    return log


def tape_or_error(fn):
    """('tape', tokens) or ('error', the MemraError): for red arms that may fail either way."""
    try:
        return "tape", fn()
    except MemraError as exc:
        return "error", exc


def first_new_token_index(tape, start: int = 5) -> int:
    """The first index >= start whose token has not occurred earlier in the tape."""
    for i in range(start, len(tape)):
        if tape[i] not in tape[:i]:
            return i
    raise AssertionError("the plain tape repeats itself: no fresh token to use as EOS")
