"""The source-blind speculative session: draft -> verify -> accept -> rollback -> commit.

    session = SpecSession(model, prompt_ids, drafter, max_ctx)
    tokens, drafted, accepted = session.burst(target=32, k=4, eos=(eos_id,))

Invariant at every round boundary: `cache.pos == len(committed)`, plus one emitted but not
yet committed token, the anchor (the next round's verify row 0). A round commits j accepted
drafts and emits the target's bonus token, so greedy output is the plain greedy tape for any
draft source, any K and any acceptance pattern.

A round is a transaction: the cache, the session (committed tokens, anchor, random counters)
and the source move together or not at all. A round that fails before the source's commit is
undone and refused (the next burst retries it); a commit that fails leaves the source out of
step, so the round is undone and the session refuses further bursts until `demote()`
(greedy) or a new session. Whatever a source hands in is checked first (contract.check_*).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memra.arguments import check_count, check_eos, check_session_args
from memra.errors import InputError, MemraError, describe
from memra.limits import MAX_K, MIN_SESSION_ROOM, VERIFY_CAP, round_fits
from memra.speculative.accept import conf_keep, greedy_accept
from memra.speculative.contract import (RoundOutcome, SessionStart, check_drafter, check_proposal, check_state,
                                        source_label)
from memra.speculative.metrics import SpecMetrics
from memra.speculative.sampling import (DraftSampling, SampleStreams, SamplingParams, accept_walk, filtered_rows,
                                        refuse_penalties)


@dataclass
class GateInstruments:
    """Test-only knobs for the exactness batteries; no serving path sets them."""

    draft_override: object = None      # (round, slot, draft) -> draft: forced accepts / rejections
    disable_rollback: bool = False     # red arm: move pos, leave every plane at post-row-K
    pmin_override: tuple | None = None  # (p_min, pmin0) for this session


class SpecSession:
    def __init__(self, model, prompt_ids, drafter, max_ctx: int, p_min: float = 0.0, pmin0: bool = False,
                 instruments: GateInstruments | None = None, sampling: SamplingParams | None = None):
        prompt, _ = check_session_args(model, prompt_ids, max_ctx, p_min, pmin0, sampling)
        if len(prompt) < 2:
            raise InputError("speculative decoding needs a prompt of >= 2 tokens (the draft warms on "
                             "(token[i+1], hidden[i]) pairs)")
        if len(prompt) + MIN_SESSION_ROOM > max_ctx:
            raise InputError(f"max_ctx {max_ctx} leaves no room for the prompt ({len(prompt)}) plus one "
                             "verify round; raise max_ctx")
        refuse_penalties(sampling)
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.model, self.drafter = model, drafter
        self.source = source_label(drafter)
        self.max_k, self.tap_layers = check_drafter(drafter, self.source)
        layers = getattr(model.cfg, "num_hidden_layers", None)  # test targets without a trunk have none
        if layers is not None and any(not 0 <= t < layers for t in self.tap_layers):
            raise InputError(f"{self.source}: tap_layers={self.tap_layers} reach outside the trunk 0..{layers - 1}; "
                             "the drafter was made for another model")
        self.instruments = instruments or GateInstruments()
        self.p_min, self.pmin0 = self.instruments.pmin_override or (p_min, pmin0)
        self.cache = model.new_cache(max_ctx)
        logits, collapsed, taps = model.prime_rows(prompt, self.cache, self.tap_layers)
        self.committed = list(prompt)
        self.streams = None
        self.draft_sampling = None
        if self.sampling is None:
            self.anchor = int(np.argmax(logits))
        else:
            self.streams = SampleStreams(model.be, self.sampling.seed)
            self.draft_sampling = DraftSampling(self.sampling, self.streams)
            self.anchor = self.streams.draw(filtered_rows(model.be, logits, self.sampling))
        self.anchor_emitted = False
        self.undelivered: list[int] = []  # committed by a burst that then failed: the next burst returns them
        self.undelivered_counts = (0, 0)  # (drafted, accepted) behind them
        self.done = False
        self.stopped: str | None = None  # why bursts are refused (a commit failed, or a walk left the cache)
        self.cache_lost = False           # a verify walk failed midway: not even demote() can continue
        self.demoted = False
        self.metrics = SpecMetrics()
        start = SessionStart(model, prompt, self.anchor, collapsed, taps, max_ctx)
        self.state = check_state(call_source(self.source, "begin", drafter.begin, start), self.source)

    # ---- bursts ----------------------------------------------------------------------------
    def burst(self, target: int, k: int, eos=()) -> tuple[list[int], int, int]:
        """Rounds until `target` new tokens are out, EOS, or the context guard; returns
        (tokens, drafted, accepted). May overshoot target by up to k (the caller clamps).
        After a burst that failed, the next one first hands back (alone) what the failed one
        had committed; a stopped session then refuses."""
        target = check_count(target, "target")  # before any state moves: a refused burst loses no token
        bound = min(MAX_K, self.max_k)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= bound:
            raise InputError(f"k={k!r} drafts per round is outside 1..={bound} (verify rows = k + 1 "
                             f"must stay <= {VERIFY_CAP}, and this draft source makes at most {bound})")
        eos = check_eos(eos, self.model.cfg.vocab_size)
        if self.undelivered:  # alone: the caller can then demote even if every round fails
            (out, self.undelivered), (drafted, accepted) = (self.undelivered, []), self.undelivered_counts
            return out, drafted, accepted
        if self.stopped is not None and not self.demoted:
            raise InputError(self._stopped_message())
        out: list[int] = []
        drafted = accepted = 0
        if not self.anchor_emitted:
            out.append(self.anchor)
            self.anchor_emitted = True
            self.done = self.anchor in eos
        while len(out) < target and not self.done:
            if not round_fits(self.cache.pos, k, self.cache.max_ctx):
                self.done = True
                break
            try:
                tokens, n_drafted = self._round(k)
            except BaseException:
                # a failed round is undone; what the burst committed before it is kept
                self.undelivered, self.undelivered_counts = out, (drafted, accepted)
                raise
            drafted += n_drafted
            accepted += len(tokens) - 1
            out.extend(tokens)
            self.done = any(t in eos for t in tokens)
        return out, drafted, accepted

    def demote(self) -> tuple[object, int]:
        """Hand the session over to plain decoding: one plain step commits the anchor; returns
        (cache, next_token). One-way: the draft state is dropped. Greedy sessions only: a
        sampled session's stream depends on its own counters. A session stopped by a failed
        commit demotes like any other: its cache and anchor are as the last good round left them."""
        if self.demoted:
            raise InputError("demote: the session is already demoted; decode on the cache demote() returned")
        if self.cache_lost:
            raise InputError(f"demote: {self.stopped}; open a new session")
        if self.sampling is not None:
            raise InputError("demote: sampled sessions stay speculative until they end (their random "
                             "stream is the session's own)")
        if not self.anchor_emitted or self.undelivered:
            raise InputError("demote: the session holds tokens not yet returned by burst(); call burst() "
                             "before demoting so none is lost")
        if self.cache.pos + 1 > self.cache.max_ctx:
            raise InputError(f"demote: no room to commit the anchor (pos {self.cache.pos} + 1 > "
                             f"max_ctx {self.cache.max_ctx})")
        logits = self.model.decode_step(self.anchor, self.cache)
        self.committed.append(self.anchor)
        self.state = None
        self.done = self.demoted = True
        return self.cache, int(np.argmax(logits))

    def _stopped_message(self) -> str:
        if self.cache_lost:
            return f"this session stopped: {self.stopped}; open a new session"
        after = ("open a new session (a sampled session cannot demote)" if self.sampling is not None else
                 "call demote() to continue with plain greedy decoding, or open a new session")
        return (f"this session stopped: {self.stopped}; that round was undone (the cache and the committed "
                f"tokens are as the last good round left them): {after}")

    # ---- one round ---------------------------------------------------------------------------
    def _round(self, k: int) -> tuple[list[int], int]:
        """One round as a transaction: on any failure the cache is rewound to the round's
        checkpoint and the random counters restored; committed and anchor move only at the end."""
        streams = self.streams
        marks = None if streams is None else (streams.sctr, streams.uctr)
        progress = {"started": False, "ckpt": None, "committing": False}
        try:
            rows, drafted, keep, bonus = self._round_steps(k, progress)
        except BaseException as exc:
            if marks is not None:
                streams.sctr, streams.uctr = marks
            self._undo(progress, exc)
            if self.stopped is not None and isinstance(exc, Exception):
                raise InputError(self._stopped_message()) from exc
            raise
        self.committed.extend(rows[:keep])
        self.anchor = bonus
        self.metrics.record(len(drafted), keep - 1)
        return drafted[:keep - 1] + [bonus], len(drafted)

    def _round_steps(self, k: int, progress: dict):
        """draft -> verify -> accept -> rollback -> commit; returns (rows, drafts, keep, bonus)."""
        model, m, inst = self.model, self.metrics, self.instruments
        with m.phase("draft"):
            drafts, q = self._drafts(k)
        rows = [self.anchor] + drafts
        verify = model.verify_greedy if self.sampling is None else model.verify_logits
        with m.phase("verify"):
            progress["started"] = True
            scored, collapsed, progress["ckpt"] = verify(rows, self.cache, self.tap_layers)
        ckpt = progress["ckpt"]
        with m.phase("accept"):
            if self.sampling is None:  # scored: each row's argmax, taken on the device
                j, bonus = greedy_accept(drafts, scored)
            else:  # scored: the rows' logits, filtered where they are
                p_rows = filtered_rows(model.be, scored, self.sampling)
                j, bonus = accept_walk(p_rows, drafts, q, self.streams, model.be)
        keep = j + 1
        with m.phase("roll"):
            if inst.disable_rollback:
                self.cache.pos = ckpt.pos + keep
            else:
                model.rollback(self.cache, ckpt, keep)
        with m.phase("maint"):
            taps = {layer: rows_[:keep] for layer, rows_ in ckpt.taps.items()}
            progress["committing"] = True
            call_source(self.source, "commit", self.state.commit,
                        RoundOutcome(rows[:keep], bonus, list(drafts), collapsed[:keep], taps))  # its own copy
        return rows, drafts, keep, bonus

    def _undo(self, progress: dict, exc: BaseException) -> None:
        """Put the cache back where the round found it; stop the session if that is impossible
        or if the source's commit failed (its state is then out of step with the session)."""
        why = str(exc) if isinstance(exc, MemraError) else describe(exc)
        if progress["started"]:
            try:
                if progress["ckpt"] is None:
                    raise InputError("the walk failed before it returned a checkpoint")
                self.model.rewind(self.cache, progress["ckpt"])
            except BaseException as lost:
                self.cache_lost = True
                self.stopped = f"a round failed ({why}) and its cache could not be rewound ({lost})"
                return
        if progress["committing"]:
            self.stopped = why

    def _drafts(self, k: int):
        """The round's drafts and their q (None = point mass), after the gates."""
        what = f"propose(k={k})"
        prop = call_source(self.source, what, self.state.propose, k, self.draft_sampling)
        prop = check_proposal(prop, k, self.model.cfg.vocab_size, f"{self.source}: {what}")
        drafts, q = prop.tokens, prop.q
        if prop.confidences is not None and self.p_min > 0:
            drafts = drafts[:conf_keep(prop.confidences, self.p_min, self.pmin0)]
        if q is not None:
            q = q.truncate(len(drafts))
        if self.instruments.draft_override is not None:
            drafts = [int(self.instruments.draft_override(self.metrics.rounds, i, d)) for i, d in enumerate(drafts)]
            q = None  # forced drafts are point masses
        return drafts, q


def call_source(source: str, what: str, fn, *args):
    """Call into a draft source; what it raises comes back naming the source (a memra refusal
    keeps its class, anything else becomes an InputError)."""
    try:
        return fn(*args)
    except MemraError as exc:
        try:
            err = type(exc)(f"{source}: {what}: {exc}")
        except Exception:
            err = InputError(f"{source}: {what}: {exc}")
        raise err from exc
    except (Exception, SystemExit) as exc:  # a plugin calling sys.exit is its failure, not the process's
        raise InputError(f"{source}: {what} raised {describe(exc)}") from exc
