"""The demo target in PyTorch: transformers' Glm5NextTextModel trunk, an untied lm head, and the
NextN/MTP block, computing exactly what memra runs (DESIGN section 3) so the trained weights mean
the same thing when memra loads them.

    model = DemoTarget(target_config())
    logits, h, taps = model.forward_trunk(ids, tap_layers=(1, 3, 5))   # ids [B, S] int64
    mtp_logits, carrier = model.mtp_step(ids[:, 1:], h[:, :-1])        # row i: (tok_{i+1}, h_i)
    steps = model.mtp_chain(ids[:, 1:], h[:, :-1], n_steps=3)          # FastMTP's recursive chain
    out = model.greedy_continue(prompts, n_new=64)                      # cached greedy decode
    model = load_target(run_dir)                                        # <run>/target/ckpt.pt, eval

* h is the collapsed PRE-final-norm row (the unweighted mean over the mHC streams; HF's
  last_hidden_state is norm(h)); a tap of layer l is the stream mean after that layer, the
  contraction memra's `be.stream_mean(streams)` applies.
* The MTP block: z = eh_proj([enorm(embed(tok_{i+1})); hnorm(h_i)]), a pre-norm DSA-MLA block with
  its own kpool indexer and a MoE, logits = lm_head(shared_head.norm(z)); the carrier is z before
  shared_head.norm, and it is what memra's native-mtp drafter feeds the next chained step as h.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import (
    Glm5NextTextAttention, Glm5NextTextModel, Glm5NextTextMoE, Glm5NextTextRMSNorm,
)

_META_KEYS = ("architectures", "transformers_version", "auto_map", "_name_or_path", "torch_dtype", "dtype")


def hf_config(cfg_dict: dict, attn: str = "sdpa", extra_layer: bool = False) -> Glm5NextTextConfig:
    """transformers' Glm5NextTextConfig for a memra config dict (as tests/model/hf_peer.py builds it).

    extra_layer=True appends one DSA layer (own "full" indexer, MoE) to the layer lists: the config
    the MTP block's HF attention and MoE modules are built from (layer index num_hidden_layers).
    """
    d = {k: v for k, v in cfg_dict.items() if k not in _META_KEYS}
    d["model_type"] = "glm5_next_text"
    pad = d.get("pad_token_id")
    if not (isinstance(pad, int) and 0 <= pad < d.get("vocab_size", 154880)):
        d["pad_token_id"] = None
    if extra_layer:
        d["num_hidden_layers"] = d["num_hidden_layers"] + 1
        d["layer_types"] = list(d["layer_types"]) + ["indexed_attention"]
        d["indexer_types"] = list(d["indexer_types"]) + ["full"]
        d["mlp_layer_types"] = list(d["mlp_layer_types"]) + ["sparse"]
    cfg = Glm5NextTextConfig(**d)
    cfg._attn_implementation = attn
    return cfg


def selection_mask(topk: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The indexer's int32 position lists [B, S, W] (-1 = none) -> bool mask [B, 1, S, kv_len]."""
    valid = (topk >= 0) & (topk < kv_len)
    hit = torch.zeros(*topk.shape[:2], kv_len, dtype=torch.int32, device=topk.device)
    hit.scatter_add_(-1, topk.long().clamp(0, kv_len - 1), valid.to(torch.int32))
    return hit.ne(0).unsqueeze(1)


class NextN(nn.Module):
    """The MTP block (checkpoint layer num_hidden_layers, no mHC). Submodule names follow the
    checkpoint: export writes `mtp.X` as `model.layers.{L}.X`."""

    def __init__(self, cfg_dict: dict, attn: str, experts_impl: str | None):
        super().__init__()
        cfg = hf_config(cfg_dict, attn=attn, extra_layer=True)
        cfg._experts_implementation = experts_impl  # the trunk's MoE kernel choice (e.g. grouped_mm)
        if cfg.qk_rope_head_dim != 0:
            raise ValueError("the MTP block is written for NoPE MLA (qk_rope_head_dim 0), as memra runs it")
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_index = cfg_dict["num_hidden_layers"]
        self.enorm = Glm5NextTextRMSNorm(d, eps)
        self.hnorm = Glm5NextTextRMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.input_layernorm = Glm5NextTextRMSNorm(d, eps)
        self.post_attention_layernorm = Glm5NextTextRMSNorm(d, eps)
        self.self_attn = Glm5NextTextAttention(cfg, self.layer_index)
        self.mlp = Glm5NextTextMoE(cfg)
        self.shared_head = nn.Module()
        self.shared_head.norm = Glm5NextTextRMSNorm(d, eps)

    def entry(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """z0 = eh_proj([enorm(e); hnorm(h)])."""
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))

    def qkv(self, x: torch.Tensor):
        """x = input_layernorm(z0) [B, S, D] -> q, k [B, H, S, dn], v [B, H, S, dv], q_resid."""
        a = self.self_attn
        b, s, _ = x.shape
        q_resid = a.q_a_layernorm(a.q_a_proj(x))
        q = a.q_b_proj(q_resid).view(b, s, a.num_heads, a.qk_head_dim).transpose(1, 2)
        latent = a.kv_a_layernorm(a.kv_a_proj_with_mqa(x))
        kv = a.kv_b_proj(latent).view(b, s, a.num_heads, a.qk_nope_head_dim + a.v_head_dim).transpose(1, 2)
        k, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        return q, k, v, q_resid

    def select(self, x: torch.Tensor, q_resid: torch.Tensor) -> torch.Tensor:
        """The block's own kpool indexer over its causal rows -> bool mask [B, 1, S, S]."""
        ones = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        topk = self.self_attn.indexer(hidden_states=x, q_resid=q_resid, attention_mask=ones, past_key_values=None)
        return selection_mask(topk, x.shape[1])

    def finish(self, z0: torch.Tensor, attn_out: torch.Tensor, lm_head: nn.Module):
        """Residual attention + MoE, then (logits float32, carrier z before shared_head.norm)."""
        b, s, _ = z0.shape
        z = z0 + self.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, s, -1))
        z = z + self.mlp(self.post_attention_layernorm(z))
        return lm_head(self.shared_head.norm(z)).float(), z


class DemoTarget(nn.Module):
    """HF Glm5NextTextModel trunk + untied lm_head + the NextN/MTP block (see the module doc)."""

    def __init__(self, cfg_dict: dict, attn: str = "sdpa"):
        super().__init__()
        self.cfg_dict = dict(cfg_dict)
        if self.cfg_dict.get("tie_word_embeddings"):
            raise ValueError("DemoTarget trains an untied lm_head: set tie_word_embeddings false")
        self.cfg_dict["num_nextn_predict_layers"] = 1
        self.hf_cfg = hf_config(self.cfg_dict, attn=attn)
        self.trunk = Glm5NextTextModel(self.hf_cfg)
        d, v = self.hf_cfg.hidden_size, self.hf_cfg.vocab_size
        self.lm_head = nn.Linear(d, v, bias=False)
        self.mtp = NextN(self.cfg_dict, attn, self.hf_cfg._experts_implementation)
        for module in list(self.mtp.modules()) + [self.lm_head]:
            self.trunk._init_weights(module)  # HF's own init rules (norms 1, router bias 0, ...)

    @property
    def num_layers(self) -> int:
        return self.hf_cfg.num_hidden_layers

    # ---- trunk ---------------------------------------------------------------------------------
    def forward_trunk(self, ids: torch.Tensor, tap_layers=()):
        """ids [B, S] int64 -> (logits [B, S, V] float32, h [B, S, D] collapsed pre-final-norm rows,
        taps {layer: [B, S, D]} the stream mean after each named layer)."""
        tap_layers = tuple(int(t) for t in tap_layers)
        for t in tap_layers:
            if not 0 <= t < self.num_layers:
                raise ValueError(f"tap layer {t} outside the trunk's layers 0..{self.num_layers - 1}")
        grabbed: dict = {}
        hooks = [self.trunk.hc_head.register_forward_hook(lambda m, a, out: grabbed.__setitem__("h", out))]
        for t in tap_layers:
            hook = lambda m, a, out, t=t: grabbed.__setitem__(t, out[0].mean(dim=2))  # noqa: E731
            hooks.append(self.trunk.layers[t].register_forward_hook(hook))
        try:
            out = self.trunk(input_ids=ids, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        logits = self.lm_head(out.last_hidden_state).float()
        return logits, grabbed["h"], {t: grabbed[t] for t in tap_layers}

    # ---- MTP -----------------------------------------------------------------------------------
    def mtp_step(self, next_ids: torch.Tensor, h: torch.Tensor):
        """Rows (tok_{i+1}, h_i) at MTP positions 0..S-1, causal over the block's own rows, as memra's
        MtpBlock computes a plane filled from position 0 -> (logits [B, S, V] f32, carrier [B, S, D]).
        A chained draft is one more row: append (draft, carrier[:, -1]) and call again."""
        m = self.mtp
        z0 = m.entry(self.trunk.embed_tokens(next_ids), h)
        x = m.input_layernorm(z0)
        q, k, v, q_resid = m.qkv(x)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m.select(x, q_resid), scale=m.self_attn.scaling)
        return m.finish(z0, o, self.lm_head)

    def mtp_chain(self, next_ids: torch.Tensor, h: torch.Tensor, n_steps: int):
        """FastMTP's recursive unroll, every base row i at once -> [(logits, carrier)] per step.

        Step 1 is mtp_step. Step k > 1 of base i feeds (next_ids[i + k - 1], carrier of step k-1 at
        base i) and sits at MTP position i + k - 1, as memra's native-mtp drafter chains it: it
        attends the step-1 rows of positions <= i (the teacher-forced plane rows) plus its own
        chain's rows, never another base's chain. Rows past the end (i + k - 1 >= S) are computed
        on a clamped token and must be left out of the loss.

        Exact to memra while a row sees no more complete pools than the indexer budget (dense:
        MTP positions < index_topk + index_kpool - 1); past that the chain rows reuse step 1's
        selection at base i instead of running the indexer on the chain row (memra does).
        """
        m, s = self.mtp, next_ids.shape[1]
        z0 = m.entry(self.trunk.embed_tokens(next_ids), h)
        x = m.input_layernorm(z0)
        q, k, v, q_resid = m.qkv(x)
        base_mask = m.select(x, q_resid)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=base_mask, scale=m.self_attn.scaling)
        steps = [m.finish(z0, o, self.lm_head)]
        keys, values = [k], [v]
        eye = torch.eye(s, dtype=torch.bool, device=next_ids.device)[None, None].expand_as(base_mask)
        idx = torch.arange(s, device=next_ids.device)
        for step in range(1, n_steps):
            tok = next_ids[:, (idx + step).clamp(max=s - 1)]
            z0 = m.entry(self.trunk.embed_tokens(tok), steps[-1][1])
            x = m.input_layernorm(z0)
            q, k, v, _ = m.qkv(x)
            keys.append(k)
            values.append(v)
            mask = torch.cat([base_mask] + [eye] * step, dim=-1)
            o = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                               scale=m.self_attn.scaling)
            steps.append(m.finish(z0, o, self.lm_head))
        return steps

    # ---- generation ----------------------------------------------------------------------------
    @torch.no_grad()
    def greedy_continue(self, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
        """prompts [B, P] int64 -> [B, P + n_new]: the trunk's greedy continuation (lowest id wins
        ties, as memra's accept rule), one cached decode step per token."""
        cache = DynamicCache(config=self.hf_cfg)
        out = self.trunk(input_ids=prompts, past_key_values=cache, use_cache=True)
        seq = [prompts]
        for i in range(n_new):
            logits = self.lm_head(out.last_hidden_state[:, -1]).float()
            nxt = logits.argmax(dim=-1, keepdim=True)  # torch's argmax returns the first maximum
            seq.append(nxt)
            if i + 1 < n_new:
                out = self.trunk(input_ids=nxt, past_key_values=cache, use_cache=True)
        return torch.cat(seq, dim=1)

    # ---- MoE balance ---------------------------------------------------------------------------
    def routers(self) -> dict[str, nn.Module]:
        """name -> every MoE router (trunk and MTP): what the aux-free bias update adjusts."""
        return {n: mod for n, mod in self.named_modules() if type(mod).__name__ == "Glm5NextTextTopkRouter"}


def tiny_config(vocab: int = 256) -> dict:
    """The demo config's layer kinds (KDA, DSA full + shared indexer, dense + grouped MoE, mHC, MTP)
    at tiny widths, for CPU smoke runs and parity tests: the indexer turns sparse at position 11."""
    from training.demo_config import target_config

    cfg = target_config()
    cfg.update(
        hidden_size=32, intermediate_size=64, vocab_size=vocab,
        linear_attn_config={**cfg["linear_attn_config"], "num_heads": 2, "head_dim": 16},
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=16, v_head_dim=16, index_n_heads=4, index_head_dim=8, index_topk=8,
        n_routed_experts=4, moe_intermediate_size=16,
        pad_token_id=min(cfg["pad_token_id"], vocab - 1), eos_token_id=min(cfg["eos_token_id"], vocab - 1),
    )
    return cfg


def load_target(run_dir: str, map_location: str = "cpu", stage: str = "target") -> DemoTarget:
    """The trained target from <run>/<stage>/ckpt.pt (written by training/target.py), in eval mode;
    stage="target_smoke" loads what `target.py --smoke` wrote."""
    path = os.path.join(run_dir, stage, "ckpt.pt")
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: run training/target.py --run-dir {run_dir} first")
    state = torch.load(path, map_location=map_location, weights_only=False)
    model = DemoTarget(state["cfg"])
    model.load_state_dict(state["model"])
    return model.eval()
