"""Hugging Face transformers side of the memra <-> HF logits gate (see test_hf_peer.py).

Everything here runs transformers' own `Glm5NextTextModel` (5.23.0, CPU, fp32, eager attention)
on a flat `glm5_next_text` checkpoint directory and returns numpy arrays:

    peer = HFPeer.load(ckpt_dir)              # asserts: no missing keys, only MTP/lm_head unexpected
    full = peer.full_logits(ids)              # [S, V] logits of one uncached forward
    inc  = peer.cached_logits(ids, n)         # rows n-1..S-1: prefill ids[:n], then one token a call
    with peer.capture_indexer() as cap: peer.full_logits(ids)
    margins = indexer_margins(cap, G)         # per DSA layer: top-G vs (G+1)-th pool score gaps

The indexer capture recomputes, from the indexer's own submodules and helper methods, the per-row
pool scores HF ranks with `topk`, checks that they reproduce HF's selection, and keeps them so the
test can refuse fixtures whose pool ranking is (near-)tied at the budget boundary: there the two
implementations may legitimately pick different pools and the logits comparison says nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers.cache_utils import DynamicCache
from transformers.utils import logging as hf_logging
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer, Glm5NextTextModel

# Keys of a config.json that are file metadata rather than model fields.
_META_KEYS = ("architectures", "transformers_version", "auto_map", "_name_or_path")


def text_section(raw: dict) -> dict:
    """The text-model fields of a flat `glm5_next_text` or nested `glm5_next` config dict."""
    if raw.get("model_type") == "glm5_next" and isinstance(raw.get("text_config"), dict):
        raw = raw["text_config"]
    return dict(raw)


def hf_text_config(raw: dict) -> Glm5NextTextConfig:
    """Build transformers' @strict `Glm5NextTextConfig` from a memra / config.json dict.

    5.23.0 accepts every key memra's presets and `ModelConfig.to_dict()` write (unknown ones such as
    `mhc`, `first_k_dense_replace`, `index_kpool_compress`, `linear_attn_config.kda_layers` are kept
    and ignored; `deepseek_sparse_attention`/`full_attention` become `indexed_attention`). Two fixes:
    - `pad_token_id` defaults to 154820, outside a tiny vocab (nn.Embedding would reject it): use
      None unless the dict gives an id inside the vocab (padding_idx does not change a forward).
    - file metadata keys are dropped.
    """
    d = text_section(raw)
    for key in _META_KEYS:
        d.pop(key, None)
    d["model_type"] = "glm5_next_text"
    pad = d.get("pad_token_id")
    if not (isinstance(pad, int) and 0 <= pad < d.get("vocab_size", 154880)):
        d["pad_token_id"] = None
    cfg = Glm5NextTextConfig(**d)
    cfg._attn_implementation = "eager"
    return cfg


def _file_tensors(path: str) -> dict[str, str]:
    """safetensors key -> shard file, for every *.safetensors in the checkpoint directory."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            f = os.path.join(path, name)
            with safe_open(f, framework="pt") as h:
                for k in h.keys():
                    out[k] = f
    return out


def _read(path_by_key: dict[str, str], key: str) -> torch.Tensor:
    with safe_open(path_by_key[key], framework="pt") as h:
        return h.get_tensor(key)


def allowed_unexpected(key: str, num_layers: int) -> bool:
    """Keys HF's Glm5NextTextModel may legitimately not load: the NextN/MTP block stored at
    layers.{num_hidden_layers} and the top-level lm_head (HF's text model has no head)."""
    k = key[len("model."):] if key.startswith("model.") else key
    return k == "lm_head.weight" or key == "lm_head.weight" or k.startswith(f"layers.{num_layers}.")


@dataclass
class IndexerCapture:
    """What one full-indexer DSA layer scored in one HF call (batch 1, rows = the call's rows)."""

    layer: int
    cached: bool  # the call ran against a DynamicCache (decode / chunked prefill)
    q_pos0: int  # absolute position of the call's first row
    scores: np.ndarray  # [S, pools] float32: HF's index_scores before masking
    pre_relu: np.ndarray  # [S, Hi, pools] float32: softmax_scale * q_h . pk_j, before the ReLU
    valid: np.ndarray  # [S, pools] bool: the pools a row may select (complete and causal)
    selected: np.ndarray  # [S, G'] int: the pools whose output was used
    tie_rows: int = 0  # rows whose output was re-selected with ties to the lower pool


@dataclass
class Margin:
    layer: int
    sparse_rows: int  # rows with more valid pools than the budget G
    worst_row: int = -1  # absolute position of the row with the smallest gap
    worst_rel: float = float("inf")  # min over sparse rows of (s_G - s_{G+1}) / max|s|
    worst_scores: tuple = field(default_factory=tuple)  # that row's best G+2 scores
    zero_tie_rows: int = 0  # rows whose boundary is an exact tie of robust ReLU zeros
    problems: list = field(default_factory=list)  # human-readable reasons a row fails


class HFPeer:
    """A loaded HF Glm5NextTextModel plus the output matrix W (logits = last_hidden_state @ W.T)."""

    def __init__(self, model: Glm5NextTextModel, head: torch.Tensor, loading_info: dict):
        self.model = model
        self.cfg = model.config
        self.head = head
        self.loading_info = loading_info

    @classmethod
    def load(cls, path: str) -> "HFPeer":
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        cfg = hf_text_config(raw)
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the load report lists every MTP key as UNEXPECTED
        try:
            model, info = Glm5NextTextModel.from_pretrained(
                path,
                config=cfg,
                dtype=torch.float32,
                attn_implementation="eager",
                output_loading_info=True,
            )
        finally:
            hf_logging.set_verbosity(level)
        # An FP8 checkpoint: without a GPU transformers dequantizes each e4m3 matrix (to float32
        # here: e4m3 * scale_inv) and keeps the checkpoint's BF16 tensors in bf16. Widening those
        # is exact, so the model is the dequantized float32 one. A float32 checkpoint: no-op.
        model = model.float()
        model.eval()
        missing = sorted(info.get("missing_keys", []))
        assert not missing, f"HF left parameters at their init (missing from {path}): {missing}"
        bad = sorted(k for k in info.get("unexpected_keys", []) if not allowed_unexpected(k, cfg.num_hidden_layers))
        assert not bad, f"HF did not load these checkpoint tensors: {bad}"
        mismatched = info.get("mismatched_keys", [])
        assert not mismatched, f"HF shape mismatches: {mismatched}"
        assert model.config._attn_implementation == "eager", model.config._attn_implementation

        files = _file_tensors(path)
        emb_key = next(k for k in ("model.embed_tokens.weight", "embed_tokens.weight",
                                   "model.language_model.embed_tokens.weight") if k in files)
        emb = _read(files, emb_key).float()
        assert torch.equal(emb, model.embed_tokens.weight.detach()), "HF embed_tokens differs from the file"
        if cfg.tie_word_embeddings:
            head = emb
        else:
            assert "lm_head.weight" in files, "untied config but the checkpoint has no lm_head.weight"
            head = _read(files, "lm_head.weight").float()
        return cls(model, head, info)

    # ---- forwards ----------------------------------------------------------------------------
    def _logits(self, hidden: torch.Tensor) -> np.ndarray:
        return (hidden[0] @ self.head.T).double().numpy()

    @torch.no_grad()
    def full_logits(self, ids) -> np.ndarray:
        """[S, V] logits of one uncached forward over the whole sequence."""
        x = torch.as_tensor(np.asarray(ids), dtype=torch.long)[None]
        out = self.model(input_ids=x, use_cache=False)
        return self._logits(out.last_hidden_state)

    @torch.no_grad()
    def cached_logits(self, ids, n: int) -> np.ndarray:
        """Rows n-1..S-1: prefill ids[:n] into a DynamicCache, then feed ids[n:] one at a time.

        HF's DynamicCache(config) holds a LinearAttentionLayer (conv + recurrent state) per KDA
        layer and a DynamicIndexedLayer per DSA layer: the latent K/V plus, via update_indexer,
        the packed per-token indexer state [k | gate_score | valid], from which every call
        rebuilds all pool keys and re-scores them. So HF's decode recomputes the same selection
        as its full forward (up to float rounding) rather than keeping pool keys incrementally.
        """
        ids = np.asarray(ids)
        cache = DynamicCache(config=self.cfg)
        x = torch.as_tensor(ids[:n], dtype=torch.long)[None]
        out = self.model(input_ids=x, past_key_values=cache, use_cache=True)
        rows = [self._logits(out.last_hidden_state)[-1]]
        for t in range(n, len(ids)):
            x = torch.as_tensor(ids[t : t + 1], dtype=torch.long)[None]
            out = self.model(input_ids=x, past_key_values=cache, use_cache=True)
            rows.append(self._logits(out.last_hidden_state)[-1])
        assert cache.get_seq_length() == len(ids)
        return np.stack(rows)

    @torch.no_grad()
    @contextlib.contextmanager
    def capture_indexer(self, align_ties: bool = False):
        """Record an IndexerCapture for every full-indexer call made inside (cached or not).

        align_ties=True replaces HF's selection on rows whose top-G boundary is an *exact* score
        tie by the same pools chosen with ties to the lower pool index (a stable sort), the rule
        memra documents; torch.topk leaves the order of equal values unspecified (HF's full
        forward and its cached decode even disagree with each other). Rows without an exact
        boundary tie keep HF's own output, which is asserted to equal the rebuilt one.
        """
        captured: list[IndexerCapture] = []
        hooks = []
        for module in self.model.modules():
            if isinstance(module, Glm5NextTextIndexer):
                hooks.append(module.register_forward_hook(_indexer_hook(captured, align_ties), with_kwargs=True))
        assert hooks, "no Glm5NextTextIndexer in the model"
        try:
            yield captured
        finally:
            for h in hooks:
                h.remove()


def _indexer_hook(captured: list, align_ties: bool):
    def hook(module: Glm5NextTextIndexer, args, kwargs, output):
        st = indexer_state(module, **kwargs)
        assert st["scores"].shape[0] == 1, "capture expects batch 1"
        G = module.index_topk // module.index_kpool
        select_k = min(G, st["scores"].shape[-1])
        masked = st["scores"].masked_fill(~st["valid"], torch.finfo(st["scores"].dtype).min)
        hf_pick = masked.topk(select_k, dim=-1).indices
        stable_pick = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :select_k]
        # Rebuilding HF's output from HF's own pick must reproduce it bit for bit: this proves the
        # recomputed scores are the ones HF ranked and the rebuild follows HF's code.
        rebuilt_hf = _selection_output(module, st, hf_pick, kwargs["attention_mask"])
        assert torch.equal(rebuilt_hf, output), (
            f"indexer capture does not reproduce HF's selection at layer {module.layer_idx}"
        )
        # Rows where the boundary is an exact tie: the G-th and (G+1)-th best valid scores are equal.
        srt = masked.sort(dim=-1, descending=True).values
        n_valid = st["valid"].sum(-1)
        tie = torch.zeros_like(n_valid, dtype=torch.bool)
        if srt.shape[-1] > select_k and select_k > 0:
            tie = (n_valid > select_k) & (srt[..., select_k - 1] == srt[..., select_k])
        out = output
        if align_ties and bool(tie.any()):
            rebuilt = _selection_output(module, st, stable_pick, kwargs["attention_mask"])
            out = torch.where(tie[..., None], rebuilt, output)
        captured.append(
            IndexerCapture(
                layer=module.layer_idx,
                cached=kwargs.get("past_key_values") is not None,
                q_pos0=st["q_pos0"],
                scores=st["scores"][0].numpy().astype(np.float32),
                pre_relu=st["pre_relu"][0].numpy().astype(np.float32),
                valid=st["valid"][0].numpy(),
                selected=(stable_pick if align_ties else hf_pick)[0].numpy(),
                tie_rows=int(tie.sum()) if align_ties else 0,
            )
        )
        return out

    return hook


@torch.no_grad()
def indexer_state(module: Glm5NextTextIndexer, hidden_states, q_resid, attention_mask, past_key_values=None):
    """Everything Glm5NextTextIndexer.forward derives before its topk, recomputed with the same
    submodules, helpers and op order. Call it after the forward (from a hook): for a cached
    call the DynamicIndexedLayer then already holds this call's packed rows, as it did inside."""
    batch_size, seq_len = hidden_states.shape[:2]
    hidden_shape = (batch_size, seq_len, -1, module.head_dim)
    q = module.wq_b(q_resid).view(hidden_shape)
    if past_key_values is None:
        k = module.k_norm(module.wk(hidden_states)).view(hidden_shape).squeeze(2)
        gate_scores = F.linear(hidden_states, module.index_kpool_compress_gate)
        valid_channel = attention_mask.to(k.dtype)[..., None]
        packed = torch.cat([k, gate_scores, valid_channel], dim=-1)
        kv_len = current_length = seq_len
    else:
        layer = past_key_values.layers[module.layer_idx]
        packed = layer.indexer_keys
        kv_len = layer.keys.shape[-2]
        current_length = layer.get_seq_length()
    valid_keys = packed[..., -1].bool()
    visible = module.get_visible_tokens(valid_keys=valid_keys, q_length=seq_len, current_length=current_length)
    pool_keys, pool_indices, pool_valid = module.get_pooled_states(packed_states=packed)
    pre = torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * module.softmax_scale
    scores = F.relu(pre)
    weights = module.weights_proj(hidden_states.to(module.weights_proj.weight.dtype)).float() * (module.n_heads**-0.5)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    pool_end = pool_indices[..., -1].clamp(0, kv_len - 1)
    pool_visible = visible.gather(dim=-1, index=pool_end[:, None, :].expand(batch_size, seq_len, -1))
    valid = pool_visible & pool_valid[:, None]
    return {
        "scores": index_scores, "pre_relu": pre, "valid": valid, "pool_indices": pool_indices,
        "visible": visible, "valid_keys": valid_keys, "q_pos0": current_length - seq_len,
    }


def _selection_output(module: Glm5NextTextIndexer, st: dict, selected: torch.Tensor, attention_mask) -> torch.Tensor:
    """Glm5NextTextIndexer.forward's tail end (pools -> token ids, tail, padding) for a given pick."""
    batch_size = selected.shape[0]
    batch_idx = torch.arange(batch_size)[:, None, None]
    selected_valid = st["valid"].gather(-1, selected)
    selected_indices = st["pool_indices"][batch_idx, selected]
    topk_indices = selected_indices.flatten(-2)
    topk_indices = topk_indices.masked_fill(~selected_valid[..., None].expand_as(selected_indices).flatten(-2), -1)
    output_width = module.index_topk
    if module.index_kpool_always_select_tail:
        topk_indices = module.append_visible_tail(topk_indices, st["visible"], st["valid_keys"])
        output_width += module.index_kpool - 1
    topk_indices = F.pad(topk_indices, (0, output_width - topk_indices.shape[-1]), value=-1)
    topk_indices = topk_indices[..., :output_width]
    topk_indices = topk_indices.masked_fill(~attention_mask[..., None], -1)
    return topk_indices.to(torch.int32)


def indexer_margins(captures: list[IndexerCapture], budget: int, rel: float, allow_zero_ties: bool = False) -> list[Margin]:
    """Check, per layer, every row that sees more valid pools than `budget`.

    A row is safe when its budget-th best valid score beats the (budget+1)-th by more than
    `rel` * max|score| of the row. With allow_zero_ties, a row whose boundary is an exact tie
    at 0.0 is also safe when every pool of the tied group has all per-head pre-ReLU values
    below -rel * max|pre-ReLU| of the row (so every implementation clamps them to exactly 0)
    and the group is separated by the margin from the next distinct scores above and below:
    then only the tie-break rule decides, and align_ties makes HF use memra's.
    """
    out = {}
    for cap in captures:
        m = out.setdefault(cap.layer, Margin(layer=cap.layer, sparse_rows=0))
        for i in range(cap.scores.shape[0]):
            ok = cap.valid[i]
            s_all = cap.scores[i].astype(np.float64)
            order = np.argsort(-s_all[ok], kind="stable")
            s = s_all[ok][order]
            if s.size <= budget:
                continue
            pos = cap.q_pos0 + i
            m.sparse_rows += 1
            scale = max(np.abs(s).max(), 1e-30)
            gap = (s[budget - 1] - s[budget]) / scale
            if gap < m.worst_rel:
                m.worst_rel, m.worst_row = float(gap), pos
                m.worst_scores = tuple(float(v) for v in s[: budget + 2])
            if gap > rel:
                continue
            if allow_zero_ties and s[budget - 1] == 0.0 and s[budget] == 0.0:
                pre = cap.pre_relu[i][:, ok][:, order].astype(np.float64)  # [Hi, valid pools] sorted
                group = np.flatnonzero(s == 0.0)
                pre_scale = max(np.abs(pre).max(), 1e-30)
                robust = bool((pre[:, group] < -rel * pre_scale).all())
                above = s[s > 0.0]
                below = s[s < 0.0]
                sep = (above.size == 0 or above.min() > rel * scale) and (below.size == 0 or -below.max() > rel * scale)
                if robust and sep:
                    m.zero_tie_rows += 1
                    continue
                why = (
                    f"a tied pool has a pre-ReLU value {pre[:, group].max():.3g} within {rel:g} * {pre_scale:.3g} of 0"
                    if not robust else "a nonzero score lies within the margin of 0"
                )
                m.problems.append(f"layer {cap.layer} row {pos}: exact 0.0 tie at the budget boundary, but {why}")
                continue
            m.problems.append(
                f"layer {cap.layer} row {pos}: best valid pool scores {[float(v) for v in s[: budget + 2]]} "
                f"leave a relative gap {gap:.3g} <= {rel:g} between the #{budget} and #{budget + 1} best"
            )
    return list(out.values())


def max_rel_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """max over rows of max|a-b| / max|b| (b is the HF reference), and the worst row."""
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    b = np.atleast_2d(np.asarray(b, dtype=np.float64))
    assert a.shape == b.shape, (a.shape, b.shape)
    rel = np.abs(a - b).max(-1) / np.maximum(np.abs(b).max(-1), 1e-30)
    i = int(np.argmax(rel))
    return float(rel[i]), i
