"""The source-blind speculative session: draft -> verify -> accept -> rollback -> commit.

    session = SpecSession(model, prompt_ids, drafter, max_ctx)
    tokens, drafted, accepted = session.burst(target=32, k=4, eos=(eos_id,))

Invariant at every round boundary: `cache.pos == len(committed)`, plus one emitted but not
yet committed token, the anchor (the next round's verify row 0). A round commits j accepted
drafts and emits the target's bonus token, so greedy output is the plain greedy tape for any
draft source, any K and any acceptance pattern.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memra.errors import InputError
from memra.limits import MAX_K, MIN_SESSION_ROOM, VERIFY_CAP, round_fits
from memra.model.tokens import check_token_ids
from memra.speculative.accept import conf_keep, greedy_accept
from memra.speculative.contract import RoundOutcome, SessionStart
from memra.speculative.metrics import SpecMetrics
from memra.speculative.sampling import (DraftSampling, SampleStreams, SamplingParams, accept_walk, filtered_probs,
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
        prompt = check_token_ids(prompt_ids, model.cfg.vocab_size, "prompt token id")
        if len(prompt) < 2:
            raise InputError("speculative decoding needs a prompt of >= 2 tokens (the draft warms on "
                             "(token[i+1], hidden[i]) pairs)")
        if len(prompt) + MIN_SESSION_ROOM > max_ctx:
            raise InputError(f"max_ctx {max_ctx} leaves no room for the prompt ({len(prompt)}) plus one "
                             "verify round; raise max_ctx")
        refuse_penalties(sampling)
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.model, self.drafter = model, drafter
        self.instruments = instruments or GateInstruments()
        self.p_min, self.pmin0 = self.instruments.pmin_override or (p_min, pmin0)
        self.cache = model.new_cache(max_ctx)
        logits, collapsed, taps = model.prime_rows(prompt, self.cache, drafter.tap_layers)
        self.committed = list(prompt)
        self.streams = None
        self.draft_sampling = None
        if self.sampling is None:
            self.anchor = int(np.argmax(logits))
        else:
            self.streams = SampleStreams(model.be, self.sampling.seed)
            self.draft_sampling = DraftSampling(self.sampling, self.streams)
            self.anchor = self.streams.draw(filtered_probs(logits, self.sampling))
        self.anchor_emitted = False
        self.undelivered: list[int] = []  # committed by a burst that then failed: the next burst returns them
        self.done = False
        self.metrics = SpecMetrics()
        self.state = drafter.begin(SessionStart(model, prompt, self.anchor, collapsed, taps, max_ctx))

    # ---- bursts ----------------------------------------------------------------------------
    def burst(self, target: int, k: int, eos=()) -> tuple[list[int], int, int]:
        """Rounds until `target` new tokens are out, EOS, or the context guard; returns
        (tokens, drafted, accepted). May overshoot target by up to k (the caller clamps)."""
        bound = min(MAX_K, getattr(self.drafter, "max_k", MAX_K))
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= bound:
            raise InputError(f"k={k!r} drafts per round is outside 1..={bound} (verify rows = k + 1 "
                             f"must stay <= {VERIFY_CAP}, and this draft source makes at most {bound})")
        eos = check_token_ids(eos, self.model.cfg.vocab_size, "EOS id", fix="pass ids of this model's vocab",
                              allow_empty=True)
        out, self.undelivered = self.undelivered, []
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
            except Exception:
                self.undelivered = out  # a refused round commits nothing; what came before is kept
                raise
            drafted += n_drafted
            accepted += len(tokens) - 1
            out.extend(tokens)
            self.done = any(t in eos for t in tokens)
        return out, drafted, accepted

    def demote(self) -> tuple[object, int]:
        """Hand the session over to plain decoding: one plain step commits the anchor; returns
        (cache, next_token). One-way: the draft state is dropped. Greedy sessions only: a
        sampled session's stream depends on its own counters."""
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
        self.done = True
        return self.cache, int(np.argmax(logits))

    # ---- one round ---------------------------------------------------------------------------
    def _round(self, k: int) -> tuple[list[int], int]:
        model, m, inst = self.model, self.metrics, self.instruments
        with m.phase("draft"):
            drafts, q = self._drafts(k)
        rows = [self.anchor] + drafts
        with m.phase("verify"):
            logits, collapsed, ckpt = model.verify_rows(rows, self.cache, self.drafter.tap_layers)
        with m.phase("accept"):
            if self.sampling is None:
                j, bonus = greedy_accept(drafts, np.argmax(logits, axis=-1).tolist())
            else:
                p_rows = np.stack([filtered_probs(row, self.sampling) for row in logits])
                j, bonus = accept_walk(p_rows, drafts, q, self.streams)
        keep = j + 1
        with m.phase("roll"):
            if inst.disable_rollback:
                self.cache.pos = ckpt.pos + keep
            else:
                model.rollback(self.cache, ckpt, keep)
        with m.phase("maint"):
            taps = {layer: rows_[:keep] for layer, rows_ in ckpt.taps.items()}
            self.state.commit(RoundOutcome(rows[:keep], bonus, drafts, collapsed[:keep], taps))
        self.committed.extend(rows[:keep])
        self.anchor = bonus
        m.record(len(drafts), j)
        return drafts[:j] + [bonus], len(drafts)

    def _drafts(self, k: int):
        """The round's drafts and their q (None = point mass), after the gates."""
        prop = self.state.propose(k, self.draft_sampling)
        drafts = check_token_ids(list(prop.tokens)[:k], self.model.cfg.vocab_size, "draft token id",
                                 fix="the draft source must draft this model's ids (was it made for another "
                                     "model?)", allow_empty=True)
        q = prop.q
        if prop.confidences is not None and self.p_min > 0:
            drafts = drafts[:conf_keep(prop.confidences[:len(drafts)], self.p_min, self.pmin0)]
        if q is not None:
            q = q.truncate(len(drafts))
        if self.instruments.draft_override is not None:
            drafts = [int(self.instruments.draft_override(self.metrics.rounds, i, d)) for i, d in enumerate(drafts)]
            q = None  # forced drafts are point masses
        return drafts, q
