"""The `dflash2` draft source: a DFlash-family block-diffusion drafter drafting for a glm5 target.

Each round the drafter runs ONE non-causal block forward over [anchor, MASK x (b-1)] against its
own KV of context features (fc + norm over the target's tapped layer outputs, appended in
committed order), harvests the rows its checkpoint was trained to draft, projects them through
the target's lm head, and walks the candidate selector (plus the markov head when the checkpoint
has one). A verify-window policy then decides how many drafts go to verify. Greedy proposals are
point masses; sampled proposals carry the selector's sparse q for the rejection walk.

The same source loads DFlash v1 and DSpark checkpoints in the seed's format (no dynamic convs,
no candidate selector; the tensor census tells them apart, memra.drafters.dflash2.weights):
each harvested row drafts on its own (memra.drafters.dflash2.dense), and sampled proposals carry
the dense filtered rows as q.

    result = generate(model, prompt, 64, draft="dflash2", num_draft_tokens=7,
                      draft_options={"path": "path/to/drafter"})

Options (`draft_options`):
  path           the drafter directory (config.json + model.safetensors); required
  precision      weight precision of the drafter, default "bf16" (see dflash2.model)
  harvest        "dflash" | "dspark"; default: the checkpoint's training-strategy census
  window         "ladder" | "confidence" | "confidence-slot"; default: confidence-slot when the
                 checkpoint has a confidence head, else the ladder (memra.drafters.dflash2.window)
  tau            confidence threshold in (0, 1), default 0.5
  adapt          False pins the ladder window at its cap
  verify_t       the verify window's cap: anchor + drafts, 2..=max_k + 1 (default max_k + 1)
  markov         False drafts without the markov head's bias (the confidence head still reads
                 its embeddings); default: on when the checkpoint has one
  mask_embedding an [H] vector (or an .npy / .safetensors file) replacing the mask token's embedding
                 (default: the drafter directory's mask_embedding.npy when it has one)
  tap_shift      gate instrument, never serving: read every tap layer n layers later (wrong
                 features must collapse acceptance while the output stays identical)

K is bounded by the block: at most block_size - 1 drafts per round under the mask-fill harvest
(block_size under the shifted one); asking for more is refused.
"""

from __future__ import annotations

import os

import numpy as np

from memra.drafters.dflash2.dense import dense_walk
from memra.drafters.dflash2.harvest import Harvest, resolve_harvest
from memra.drafters.dflash2.heads import ConfidenceHead, MarkovHead
from memra.drafters.dflash2.selector import Selector
from memra.drafters.dflash2.weights import DFLASH
from memra.drafters.dflash2.window import (
    VerifyWindow,
    WindowPolicy,
    resolve_vt_cap,
    resolve_window,
    sigmoid,
)
from memra.errors import ConfigError, InputError
from memra.speculative.contract import Proposal, RoundOutcome, SessionStart

OPTIONS = ("path", "precision", "harvest", "window", "tau", "adapt", "verify_t", "markov", "mask_embedding",
           "tap_shift")
INGEST_CHUNK = 256   # context rows per fc + K/V projection call: bounds the transient memory


class DFlash2Source:
    name = "dflash2"

    def load(self, model, options: dict | None = None) -> DFlash2Drafter:
        from memra.drafters.dflash2.model import DflashDraft

        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise InputError(f"dflash2: unknown options {unknown}; it takes {list(OPTIONS)}")
        path = options.get("path")
        if path is None:
            raise InputError("dflash2 needs the drafter checkpoint: pass draft_options={'path': <directory "
                             "with config.json and model.safetensors>}")
        if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
            raise InputError(f"dflash2: path {path!r} is not a directory: point 'path' at a DFlash2 drafter "
                             "checkpoint (config.json + model.safetensors)")
        draft = DflashDraft.load(path, model, precision=options.get("precision", "bf16"),
                                 mask_embedding=options.get("mask_embedding"))
        harvest = resolve_harvest(options.get("harvest"), draft.cfg.strategy_dspark)
        has_head = draft.conf_w is not None
        policy = resolve_window(options.get("window"), options.get("tau"), options.get("adapt"), has_head)
        if policy.is_confidence and not has_head:
            raise InputError(f"dflash2: window={policy.kind!r} sizes the verify window from a trained "
                             "confidence head, and this checkpoint has none: use window='ladder' (or "
                             "p_min to truncate on the selector's own confidence)")
        taps = shifted_taps(draft.cfg.target_layer_ids, options.get("tap_shift", 0),
                            model.cfg.num_hidden_layers)
        vt_cap = resolve_vt_cap(options.get("verify_t"), harvest.n_drafts(draft.cfg.block_size))
        markov_bias = resolve_markov(options.get("markov"), draft.markov_w1 is not None)
        return DFlash2Drafter(model, draft, harvest, policy, taps, vt_cap, markov_bias)


def resolve_markov(markov, has_head: bool) -> bool:
    """The `markov` option: whether drafting adds the markov head's bias (default: iff present)."""
    if markov is not None and not isinstance(markov, bool):
        raise InputError(f"dflash2: markov={markov!r} must be true or false (false drafts without the "
                         "markov head's semi-autoregressive bias)")
    if markov and not has_head:
        raise InputError("dflash2: markov=true asks for the markov head, and this checkpoint has none: "
                         "drop the option")
    return has_head if markov is None else markov


def shifted_taps(layers, shift, n_trunk: int) -> tuple[int, ...]:
    """The drafter's tap layers moved by the tap_shift gate instrument, checked against the trunk."""
    if isinstance(shift, bool) or not isinstance(shift, (int, np.integer)):
        raise InputError(f"dflash2: tap_shift={shift!r} must be an integer (0 = the checkpoint's own taps)")
    taps = tuple(int(t) + int(shift) for t in layers)
    bad = [t for t in taps if not 0 <= t < n_trunk]
    if bad:
        raise InputError(f"dflash2: tap layer {bad[0]} (target_layer_ids {list(layers)} shifted by {shift}) is "
                         f"outside the {n_trunk}-layer trunk 0..{n_trunk - 1}: use a smaller tap_shift, or a "
                         "drafter made for this model")
    return taps


class DFlash2Drafter:
    """A loaded DFlash2 drafter: weights once per model; `begin` opens a session state."""

    def __init__(self, model, draft, harvest: Harvest, policy: WindowPolicy, tap_layers: tuple[int, ...],
                 vt_cap: int | None = None, markov_bias: bool = True):
        cfg = draft.cfg
        self.model, self.draft, self.cfg = model, draft, cfg
        self.harvest, self.policy = harvest, policy
        self.block_size = cfg.block_size
        self.max_k = harvest.n_drafts(cfg.block_size)
        self.vt_cap = self.max_k + 1 if vt_cap is None else vt_cap
        self.tap_layers = tap_layers
        self.selector = None if draft.family == DFLASH else \
            Selector(draft.sel_hidden_proj, draft.sel_pred, draft.sel_succ, cfg.selector_top_k)
        self.markov = None if draft.markov_w1 is None else MarkovHead(draft.markov_w1, draft.markov_w2)
        self.markov_bias = markov_bias and self.markov is not None
        self.confidence = None
        if draft.conf_w is not None:
            if draft.conf_with_markov and self.markov is None:
                raise ConfigError("dflash2: the confidence head reads the markov embedding, and this "
                                  "checkpoint has no markov head; re-export the drafter")
            self.confidence = ConfidenceHead(draft.conf_w, draft.conf_b, draft.conf_with_markov)

    def begin(self, start: SessionStart) -> DFlash2State:
        return DFlash2State(self, start)


class DFlash2State:
    """One session: the drafter KV (committed context only), the tap rows not yet ingested, the
    anchor, and the verify window carried between rounds."""

    def __init__(self, drafter: DFlash2Drafter, start: SessionStart):
        self.drafter = drafter
        self.kv = drafter.draft.new_kv(start.max_ctx + drafter.block_size)
        self.pending = [self._tap_rows(start.taps, "the prompt")]
        self.committed = len(start.prompt)
        self.anchor = int(start.anchor)
        self.window = VerifyWindow(drafter.policy, vt_cap=drafter.vt_cap)

    def _tap_rows(self, taps: dict, what: str) -> list:
        missing = [layer for layer in self.drafter.tap_layers if taps.get(layer) is None]
        if missing:
            raise InputError(f"dflash2: {what} came without the rows of tap layer {missing[0]}; the core "
                             f"must tap drafter.tap_layers {list(self.drafter.tap_layers)}")
        return [taps[layer] for layer in self.drafter.tap_layers]

    def _ingest(self) -> None:
        draft = self.drafter.draft
        for rows in self.pending:
            n = rows[0].shape[0]
            for r0 in range(0, n, INGEST_CHUNK):
                draft.ingest_taps(self.kv, [t[r0:r0 + INGEST_CHUNK] for t in rows])
        self.pending = []
        assert self.kv.len == self.committed, "drafter context rows must equal the committed rows"

    def propose(self, k: int, sampling=None) -> Proposal:
        d = self.drafter
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= d.max_k:
            raise InputError(
                f"dflash2: k={k!r} drafts outside 1..={d.max_k}: the drafter's block_size {d.block_size} "
                f"makes {d.max_k} drafts per round under the {d.harvest.value} harvest (its trained mask "
                f"pattern); ask for num_draft_tokens <= {d.max_k}"
            )
        self._ingest()
        draft, n = d.draft, int(k)
        block = [self.anchor] + [d.cfg.mask_token_id] * (d.block_size - 1)
        # without a row bias every row's candidates are known up front: taken where the logits are
        top_k = None if d.selector is None or d.markov_bias else min(d.selector.top_k, d.cfg.vocab_size)
        rows, logits, top = draft.draft_rows(self.kv, block, self.kv.len, d.harvest.first_row, n, top_k)
        walk = self._walk(rows, logits, top, sampling)
        confidences = walk.confidences
        raws = None
        if d.confidence is not None:
            embs = None
            if d.confidence.with_markov:
                embs = d.markov.embeddings([self.anchor] + walk.path[:-1])
            raws = d.confidence.raw_scores(rows, embs)
            confidences = [sigmoid(r) for r in raws]
        keep = min(self.window.size(raws if d.policy.is_confidence else None) - 1, n)
        q = None if sampling is None else walk.q.truncate(keep)
        return Proposal(tokens=walk.path[:keep], q=q, confidences=confidences[:keep])

    def _walk(self, rows, logits, top, sampling):
        """The drafts of the harvested rows: the candidate selector's walk (sparse q), or each row
        on its own for a checkpoint without one (dense q)."""
        d = self.drafter
        bias = d.markov.row_bias if d.markov_bias else None
        if d.selector is None:
            return dense_walk(logits, self.anchor, sampling, bias)
        uniforms, temperature = None, 1.0
        if sampling is not None:
            temperature = float(sampling.params.temperature)
            uniforms = [sampling.streams.accept_uniform() for _ in range(rows.shape[0])]
        return d.selector.walk(logits, rows, self.anchor, uniforms, temperature, bias, top)

    def commit(self, outcome: RoundOutcome) -> None:
        """Queue the kept verify rows' taps (anchor + accepted drafts) as the next context rows."""
        self.pending.append([rows[:len(outcome.kept)] for rows in self._tap_rows(outcome.taps, "the round")])
        self.committed += len(outcome.kept)
        self.anchor = int(outcome.bonus)
        self.window.after_round(len(outcome.kept) - 1)
