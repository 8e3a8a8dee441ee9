"""The native MTP draft source: the checkpoint's own NextN block chains K drafts.

The block keeps its own latent plane, owned by the draft state (other sources pay nothing
for it). At session start it warms the plane over the prompt in one batched pass of
(prompt[i+1], h_i) pairs; `pending` holds committed (token, h_seed) pairs not yet fed, where
h_seed is the trunk's collapsed pre-final-norm row. Each round feeds them (the last row's
logits are draft 1), chains K-1 more steps on the block's own carrier, and after the verify
resets the plane to the committed boundary and queues the round's kept pairs.

Options: `d2t` — an FR-Spec trim: the draft head projects through the lm-head rows of
those token ids only, drafting rank ids that map back through d2t before anything else
sees them (the verify stays full-vocab).
"""

from __future__ import annotations

import numpy as np

from memra.errors import InputError
from memra.speculative.contract import DenseQ, Proposal, RoundOutcome, SessionStart


class NativeMtpSource:
    name = "native-mtp"

    def load(self, model, options: dict | None = None) -> "NativeMtpDrafter":
        options = dict(options or {})
        d2t = options.pop("d2t", None)
        if options:
            raise InputError(f"native-mtp: unknown options {sorted(options)}; it takes only 'd2t'")
        if model.mtp is None:
            raise InputError(
                "native-mtp needs the checkpoint's NextN/MTP block (num_nextn_predict_layers >= 1), "
                "and this model has none: choose another draft source"
            )
        return NativeMtpDrafter(model, d2t)


class NativeMtpDrafter:
    max_k = 14
    tap_layers: tuple[int, ...] = ()

    def __init__(self, model, d2t=None):
        self.model = model
        self.d2t = None
        self.head = model.mtp.lm_head
        if d2t is not None:
            ids = np.asarray(d2t)
            vocab = model.cfg.vocab_size
            if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
                raise InputError("native-mtp: d2t must be a non-empty list of token ids")
            if ids.min() < 0 or ids.max() >= vocab:
                raise InputError(
                    f"native-mtp: d2t holds token id {int(ids.max() if ids.max() >= vocab else ids.min())} "
                    f"outside the vocab 0..{vocab - 1}: the trim was made for another vocabulary"
                )
            self.d2t = ids.astype(np.int64)
            be = model.be
            self.head = be.matrix(np.asarray(be.to_host(self.head))[self.d2t])
            self.d2t_rows = be.asarray(self.d2t[None, :], dtype=np.int64)  # [1, n]: be.pick maps a rank row
        # test-only instrument: use the rank id as the token id (the skipped-remap defect)
        self.skip_d2t_remap = False

    def begin(self, start: SessionStart) -> "NativeMtpState":
        return NativeMtpState(self, start)


class NativeMtpState:
    def __init__(self, drafter: NativeMtpDrafter, start: SessionStart):
        self.drafter = drafter
        mtp = drafter.model.mtp
        self.plane = mtp.new_plane(start.max_ctx)
        self.walks = drafter.model.be.walks()  # on cuda: the draft steps replay CUDA graphs
        prompt = np.asarray(start.prompt, dtype=np.int64)
        # warm: pairs (prompt[i+1], h_i) at plane positions 0..plen-2; only the plane matters
        mtp.warm(prompt[1:], start.collapsed[:-1], self.plane, 0)
        self.pending_tokens = [int(start.anchor)]
        self.pending_h = [start.collapsed[-1:]]
        self.committed_len = self.plane.length

    def _step(self, tokens, h):
        """One draft step over token ids (host, or the device ids of the chain's last argmax)
        -> (the last row's logits [1, V] on the device, its carrier [1, D]): the rows before it
        only fill the plane (MtpBlock's last_only)."""
        d = self.drafter
        return d.model.mtp(tokens, h, self.plane, self.plane.length, d.head, walks=self.walks, last_only=True)

    def propose(self, k: int, sampling=None) -> Proposal:
        """K chained drafts: greedy argmaxes, or (sampling) draws from the filtered draft
        distribution, whose rows (scattered to the full vocab) are the proposal's q."""
        be = self.drafter.model.be
        h = be.concat(self.pending_h, axis=0)
        logits, carrier = self._step(np.asarray(self.pending_tokens, dtype=np.int64), h)
        self.pending_tokens, self.pending_h = [], []
        self.committed_len = self.plane.length
        if sampling is None:
            return self._greedy(k, logits, carrier)
        tokens, confidences, q_rows = [], [], []
        for ki in range(k):
            probs = sampling.filter(logits[-1])
            confidences.append(float(probs.max()))  # before the draw: see Proposal.confidences
            tok = self._token(sampling.draw(probs))
            tokens.append(tok)
            q_rows.append(self._full_vocab(probs))
            if ki + 1 < k:
                logits, carrier = self._step(np.asarray([tok], dtype=np.int64), carrier)
        return Proposal(tokens=tokens, q=DenseQ(np.stack(q_rows)), confidences=confidences)

    def _greedy(self, k: int, logits, carrier) -> Proposal:
        """K argmax drafts chained on the device: each step's argmax id feeds the next step
        (through d2t) without a trip through the host, so the steps queue back to back; the ids
        and confidences (the argmax's softmax probability) come back once, at the end."""
        d, be = self.drafter, self.drafter.model.be
        remap = None if d.d2t is None or d.skip_d2t_remap else d.d2t_rows
        ranks, confidences = [], []
        for ki in range(k):
            row = logits[-1:]
            rank, confidence = be.argmax_prob(row)  # [1]: the lowest index among ties, as np.argmax
            ranks.append(rank)
            confidences.append(confidence)
            if ki + 1 < k:
                logits, carrier = self._step(rank if remap is None else be.pick(remap, rank), carrier)
        ranks = be.to_host(be.concat(ranks, axis=0))
        confidences = be.to_host(be.concat(confidences, axis=0))
        return Proposal(tokens=[self._token(int(r)) for r in ranks], confidences=[float(c) for c in confidences])

    def _token(self, rank: int) -> int:
        """A draft head rank -> its token id (the identity without an FR-Spec trim)."""
        d = self.drafter
        return rank if d.d2t is None or d.skip_d2t_remap else int(d.d2t[rank])

    def _full_vocab(self, probs: np.ndarray) -> np.ndarray:
        d = self.drafter
        if d.d2t is None or d.skip_d2t_remap:
            return probs
        row = np.zeros(d.model.cfg.vocab_size)
        np.add.at(row, d.d2t, probs)
        return row

    def commit(self, outcome: RoundOutcome) -> None:
        """Drop the chain rows; queue (next token, h) pairs for every kept verify row."""
        self.drafter.model.mtp.reset_plane(self.plane, self.committed_len)
        nxt = outcome.kept[1:] + [outcome.bonus]
        self.pending_tokens = [int(t) for t in nxt]
        self.pending_h = [outcome.collapsed]
