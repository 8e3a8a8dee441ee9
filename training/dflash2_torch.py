"""The DFlash2 drafter in torch: the same forward memra's numpy drafter runs
(memra/drafters/dflash2/model.py, selector.py), batched over many anchors so it can be trained.

One sequence's target taps give the context features (hidden_norm(fc(concat taps))), which feed
K/V of every draft layer at their absolute positions 0..S-1. Each anchor at position a drafts the
block [token a, MASK x (b-1)] at positions a..a+b-1; the block attends to the context rows
strictly before a and, bidirectionally, to its own rows. Every sublayer is wrapped in the grouped
dynamic causal conv (block-local: row 0 reads zeros). The drafter borrows the target's embedding
and lm head (frozen buffers, not saved); the mask rows may use a learned `mask_embedding` instead
of the target's never-trained E[mask]. Parameter names are memra's tensor names, so the
state dict (minus `mask_embedding`) is the export.

    drafter = DFlash2Drafter(drafter_config(target_cfg), embed, lm_head)
    feats = drafter.context_features([taps[l] for l in drafter.tap_layers])      # [B, S, H]
    hidden = drafter(feats, anchor_pos, anchor_ids)                              # [B, N, b, H]
    logits = drafter.logits(hidden[..., 1:, :])                                  # slots 1..b-1
    path = drafter.candidate_selector.greedy_walk(logits, hidden[..., 1:, :], anchor_ids)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memra.drafters.dflash2.config import parse_dflash_config
from training.demo_config import DRAFTER

# Picked so the drafter is ~2.9M parameters without the borrowed tables (brief: <= ~3.5M):
# fc 0.20M + 2 layers x 0.82M + selector 1.06M (two [8192, 64] codebooks).
SHAPE = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768}
ROPE_THETA = 10000.0
RMS_EPS = 1e-6


def drafter_config(target_cfg: dict, **overrides) -> dict:
    """memra's drafter config.json dict for a target config (DRAFTER + SHAPE, then overrides)."""
    s = {**DRAFTER, **SHAPE, **overrides}
    n = s["num_hidden_layers"]
    nested = ("block_size", "mask_token_id", "target_layer_ids", "conv_kernel_size", "conv_group_size",
              "selector_rank", "selector_top_k")
    raw = {
        "model_type": "qwen3", "architectures": ["DFlash2DraftModel"],
        "hidden_size": target_cfg["hidden_size"], "vocab_size": target_cfg["vocab_size"],
        "num_hidden_layers": n, "intermediate_size": s["intermediate_size"],
        "num_attention_heads": s["num_attention_heads"], "num_key_value_heads": s["num_key_value_heads"],
        "head_dim": s["head_dim"], "rms_norm_eps": RMS_EPS, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False,
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 4096),
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "layer_types": ["full_attention"] * n, "use_sliding_window": False, "sliding_window": None,
        "is_causal": False, "num_target_layers": target_cfg["num_hidden_layers"],
        "dflash_config": {k: (list(s[k]) if k == "target_layer_ids" else s[k]) for k in nested},
    }
    parse_dflash_config(raw)  # memra's own validation: a config memra would refuse fails here
    return raw


def rmsnorm(x, weight, eps: float = RMS_EPS):
    """x * rsqrt(mean(x^2) + eps) * w in float32 (memra's drafter computes every norm in f32)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rmsnorm(x, self.weight)


def rope_tables(n_pos: int, head_dim: int, theta: float, device):
    """NeoX cos, sin [n_pos, head_dim] (float32, frequencies in float64 as memra's rope.py)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    ang = torch.arange(n_pos, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x, cos, sin):
    """x [..., heads, hd] with cos/sin [..., hd] broadcast over the heads axis."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class GroupedDynamicConv(nn.Module):
    """Both sides of one sublayer's conv along the block axis (dim -2); identity at init.

    side s: out[t, c] = sum_j (base[s, j, c] + coef[t, s, j, c // g]) * z[t - j, c], z[t - j] = 0 for t < j,
    with coef = x @ kernel_projection^T from the sublayer input x (both sides)."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group, self.groups = kernel, group, hidden // group
        base = torch.zeros(2, kernel, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def coefficients(self, x):
        return self.kernel_projection(x).float().unflatten(-1, (2, self.kernel, self.groups))

    def side(self, z, coef, s: int):
        z = z.float()
        bs = z.shape[-2]
        out = None
        for j in range(min(self.kernel, bs)):
            w = self.base_kernel[s, j] + coef[..., s, j, :].repeat_interleave(self.group, dim=-1)
            shifted = z if j == 0 else F.pad(z[..., :bs - j, :], (0, 0, j, 0))
            out = w * shifted if out is None else out + w * shifted
        return out


class DraftAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm, self.k_norm = RMSNorm(head_dim), RMSNorm(head_dim)

    def _kv(self, x, cos, sin):
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)).float()
        rep = self.heads // self.kv_heads   # query head h reads kv head h // rep (memra's grouping)
        return apply_rope(k, cos, sin).repeat_interleave(rep, -2), v.repeat_interleave(rep, -2)

    def context_kv(self, feats, cos, sin):
        """K/V [B, S, heads, hd] of the context features (roped at positions 0..S-1)."""
        return self._kv(feats, cos, sin)

    def forward(self, x, ctx_k, ctx_v, ctx_visible, cos, sin, causal: bool):
        """x [B, N, b, H] block rows; ctx_visible [B, N, S] bool; cos/sin [B, N, b, hd]."""
        q = apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))), cos, sin)
        k, v = self._kv(x, cos, sin)
        scale = self.head_dim ** -0.5
        s_ctx = torch.einsum("bnthd,bshd->bnhts", q, ctx_k) * scale
        s_ctx = s_ctx.masked_fill(~ctx_visible[:, :, None, None, :], float("-inf"))
        s_blk = torch.einsum("bnthd,bnuhd->bnhtu", q, k) * scale
        if causal:
            b = x.shape[-2]
            s_blk = s_blk.masked_fill(~torch.ones(b, b, dtype=torch.bool, device=x.device).tril(), float("-inf"))
        probs = torch.cat([s_ctx, s_blk], dim=-1).float().softmax(dim=-1)
        n_ctx = ctx_k.shape[1]
        out = torch.einsum("bnhts,bshd->bnthd", probs[..., :n_ctx].to(ctx_v.dtype), ctx_v) \
            + torch.einsum("bnhtu,bnuhd->bnthd", probs[..., n_ctx:].to(v.dtype), v)
        return self.o_proj(out.flatten(-2))


class DraftMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, d = c["hidden_size"], c["dflash_config"]
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h), RMSNorm(h)
        self.self_attn = DraftAttention(h, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
        self.mlp = DraftMLP(h, c["intermediate_size"])
        self.attention_conv = GroupedDynamicConv(h, d["conv_kernel_size"], d["conv_group_size"])
        self.mlp_conv = GroupedDynamicConv(h, d["conv_kernel_size"], d["conv_group_size"])

    def forward(self, h, ctx_k, ctx_v, ctx_visible, cos, sin, causal: bool):
        x = self.input_layernorm(h)
        coef = self.attention_conv.coefficients(x)
        a = self.self_attn(self.attention_conv.side(x, coef, 0), ctx_k, ctx_v, ctx_visible, cos, sin, causal)
        h = h + self.attention_conv.side(a, coef, 1)
        x = self.post_attention_layernorm(h)
        coef = self.mlp_conv.coefficients(x)
        return h + self.mlp_conv.side(self.mlp(self.mlp_conv.side(x, coef, 0)), coef, 1)


class CandidateSelector(nn.Module):
    """score_i(pred, b) = u_i[b] + sum_r P[pred, r] * z_i[r] * S[cand_i[b], r], z_i = h_i @ W^T.
    W starts at zero (the walk starts as the plain top-1) and the codebooks random, so every
    part gets a gradient after the first step."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        nn.init.zeros_(self.hidden_projection.weight)
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * rank ** -0.5)
        self.successor_codebook = nn.Parameter(torch.randn(vocab, rank) * rank ** -0.5)

    def candidates(self, logits):
        """(u [..., K] float32 with gradient, cand [..., K] ids) of the top-K logits."""
        cand = logits.detach().topk(self.top_k, dim=-1).indices
        return logits.gather(-1, cand).float(), cand

    def scores(self, u, cand, hidden, pred):
        """[..., K] scores of one slot's candidates given its predecessor ids `pred` [...]."""
        z = self.hidden_projection(hidden).float()
        gate = self.predecessor_codebook[pred].float() * z
        return u + (self.successor_codebook[cand].float() * gate.unsqueeze(-2)).sum(-1)

    @torch.no_grad()
    def greedy_walk(self, logits, hidden, anchor):
        """memra's greedy walk over slots [..., n, V] / [..., n, H] from `anchor` [...] -> ids [..., n]."""
        u, cand = self.candidates(logits)
        pred, path = anchor, []
        for i in range(logits.shape[-2]):
            idx = self.scores(u[..., i, :], cand[..., i, :], hidden[..., i, :], pred).argmax(-1, keepdim=True)
            pred = cand[..., i, :].gather(-1, idx).squeeze(-1)
            path.append(pred)
        return torch.stack(path, dim=-1)


class DFlash2Drafter(nn.Module):
    def __init__(self, config: dict, embed: torch.Tensor, lm_head: torch.Tensor, learn_mask: bool = True):
        super().__init__()
        self.config = config
        self.cfg = parse_dflash_config(config)
        c = self.cfg
        if tuple(embed.shape) != (c.vocab_size, c.hidden_size) or tuple(lm_head.shape) != tuple(embed.shape):
            raise ValueError(f"drafter needs the target's embedding and lm head [{c.vocab_size}, {c.hidden_size}], "
                             f"got {list(embed.shape)} and {list(lm_head.shape)}")
        self.tap_layers = c.target_layer_ids
        self.block_size, self.mask_token_id = c.block_size, c.mask_token_id
        self.block_causal = c.is_causal
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)
        h = c.hidden_size
        self.fc = nn.Linear(len(c.target_layer_ids) * h, h, bias=False)
        self.hidden_norm, self.norm = RMSNorm(h), RMSNorm(h)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(c.num_hidden_layers))
        self.candidate_selector = CandidateSelector(h, c.vocab_size, c.selector_rank, c.selector_top_k)
        self.mask_embedding = nn.Parameter(self.embed[c.mask_token_id].clone()) if learn_mask else None

    def own_parameter_count(self) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if n != "mask_embedding")

    def context_features(self, tap_rows):
        """hidden_norm(fc(concat of the tapped layers' rows [B, S, H], in target_layer_ids order))."""
        return self.hidden_norm(self.fc(torch.cat([t.float() for t in tap_rows], dim=-1)))

    def block_embeddings(self, anchor_ids):
        """[B, N, b, H]: E[anchor] then the mask row (learned, or the target's E[mask])."""
        c = self.cfg
        mask = self.embed[c.mask_token_id] if self.mask_embedding is None else self.mask_embedding
        first = self.embed[anchor_ids].unsqueeze(-2)
        rest = mask.float().expand(*anchor_ids.shape, c.block_size - 1, c.hidden_size)
        return torch.cat([first, rest], dim=-2) * c.input_embedding_scale

    def forward(self, feats, anchor_pos, anchor_ids, causal: bool | None = None):
        """Final normed hidden rows [B, N, b, H] of the blocks anchored at `anchor_pos` [B, N]
        (token ids `anchor_ids`), over the context rows of `feats` [B, S, H] before each anchor."""
        c = self.cfg
        b, n_ctx = c.block_size, feats.shape[1]
        causal = self.block_causal if causal is None else causal
        max_pos = max(n_ctx, int(anchor_pos.max()) + b)
        cos, sin = rope_tables(max_pos, c.head_dim, c.rope.theta, feats.device)
        blk_pos = anchor_pos.unsqueeze(-1) + torch.arange(b, device=feats.device)
        blk_cos, blk_sin = cos[blk_pos], sin[blk_pos]
        ctx_visible = torch.arange(n_ctx, device=feats.device) < anchor_pos.unsqueeze(-1)
        h = self.block_embeddings(anchor_ids)
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.context_kv(feats, cos[:n_ctx], sin[:n_ctx])
            h = layer(h, ctx_k, ctx_v, ctx_visible, blk_cos, blk_sin, causal)
        return self.norm(h)

    def logits(self, hidden):
        """The target's lm head on draft rows, with the config's multiplier and softcap."""
        c = self.cfg
        out = F.linear(hidden, self.lm_head)
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.final_logit_softcapping is not None:
            out = c.final_logit_softcapping * torch.tanh(out / c.final_logit_softcapping)
        return out


def param_groups(drafter: DFlash2Drafter, weight_decay: float):
    """AdamW groups: decay on the projection matrices only (not norms, convs, codebooks, mask)."""
    decay, keep = [], []
    for name, p in drafter.named_parameters():
        matrix = p.ndim == 2 and name.endswith("weight") and "norm" not in name
        (decay if matrix else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def count_params(config: dict) -> int:
    """Own parameters of a drafter with this config (no model built)."""
    c = parse_dflash_config(config)
    h, hd, i = c.hidden_size, c.head_dim, c.intermediate_size
    g = h // c.conv_group_size
    per_layer = 2 * h + h * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 2 * hd \
        + 3 * h * i + 2 * (2 * c.conv_kernel_size * h + 2 * c.conv_kernel_size * g * h)
    return len(c.target_layer_ids) * h * h + 2 * h + c.num_hidden_layers * per_layer \
        + 2 * c.vocab_size * c.selector_rank + c.selector_rank * h

