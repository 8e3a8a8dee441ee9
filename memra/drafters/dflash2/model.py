"""The DFlash-family drafter network: context features, the draft KV cache and the block forward.

A small Qwen3-style stack drafts a whole block [anchor, MASK x (b-1)] in one forward, attending
(bidirectionally unless the config says causal) over the cached target context and the block.
It borrows the target's embedding table and lm head. In a DFlash2 checkpoint each sublayer is
wrapped in the grouped dynamic causal conv (research/dflash2.md §2): per-row coefficients come
from the sublayer input, the pre-conv mixes that input with its previous row, the post-conv does
the same to the sublayer output. The conv is block-local (row 0 reads zeros), so there is no conv
state between rounds. A DFlash v1 / DSpark checkpoint (`family == "dflash"`, the seed's format)
has no convs: its sublayers are the plain pre-norm residual ones.

The drafter is not in the exact class (the target verifies every token), so it computes in
float32 with the array module's own GEMMs (numpy, or cupy on the CUDA backend) and the backend's
row ops (rmsnorm, softmax, silu): a draft round is bound by its host's launches, one op each.

    draft = DflashDraft.load(dir, target_model, precision="q8_0")
    kv = draft.new_kv(max_ctx)
    draft.ingest(kv, draft.ctx_features([taps[l] for l in draft.cfg.target_layer_ids]))
    hidden = draft.forward_block(kv, [anchor] + [mask] * (b - 1), start_pos=kv.len)
    logits = draft.logits(hidden[1:])
"""

from __future__ import annotations

import os

import numpy as np

from memra.drafters.dflash2.config import DflashConfig, load_dflash_config
from memra.drafters.dflash2.quant import PRECISIONS
from memra.drafters.dflash2.rope import apply_rope, cos_sin, inv_freq
from memra.drafters.dflash2.weights import (
    DFLASH2,
    family_of,
    load_mask_embedding,
    load_weights,
)
from memra.errors import ConfigError, ContextOverflowError, InputError

F32 = np.float32
MASK_FILE = "mask_embedding.npy"  # a learned mask row in the drafter directory, used unless overridden


def conv_rows(xp, z, base, coef, group: int):
    """One side of the grouped dynamic causal conv over a block's rows.

    out[t, c] = sum_j (base[j, c] + coef[t, j, c // group]) * z[t - j, c], z[t - j] = 0 for t < j.
    z [b, H]; base [k, H]; coef [b, k, H/group].
    """
    coef = xp.repeat(coef, group, axis=2)  # [b, k, H]: every tap's channels at once
    out = z * (base[0] + coef[:, 0])
    for j in range(1, min(base.shape[0], z.shape[0])):
        out[j:] += (base[j] + coef[j:, j]) * z[:-j]
    return out


class DflashKv:
    """Per-layer context K (k_norm'd, roped) and V of the committed rows, append-only."""

    def __init__(self, xp, n_layers: int, max_ctx: int, n_kv: int, head_dim: int):
        self.max_ctx = max_ctx
        self.len = 0
        self.k = [xp.zeros((max_ctx, n_kv, head_dim), F32) for _ in range(n_layers)]
        self.v = [xp.zeros((max_ctx, n_kv, head_dim), F32) for _ in range(n_layers)]


class _Visibility:
    """A block's attention masks over [context + block] keys, one upload per distinct rule (causal,
    window), None where every block row sees every key. Block row i sits at cache index n + i."""

    def __init__(self, xp, n: int, b: int):
        self.xp, self.n, self.b, self.made = xp, n, b, {}

    def __call__(self, causal: bool, window, first: int, keys: int):
        if not causal and window is None:
            return None
        rule = (causal, window, first, keys)
        if rule not in self.made:
            q_idx = self.n + np.arange(self.b)[:, None]
            k_idx = first + np.arange(keys)[None, :]
            visible = np.ones((self.b, keys), dtype=bool)
            if causal:
                visible &= k_idx <= q_idx
            if window is not None:
                visible &= np.abs(q_idx - k_idx) < window
            self.made[rule] = self.xp.asarray(visible)
        return self.made[rule]


class _Layer:
    def __init__(self, dev, i: int, convs: bool):
        p = f"layers.{i}."
        self.ln_in, self.ln_post = dev(p + "input_layernorm.weight"), dev(p + "post_attention_layernorm.weight")
        self.wq, self.wk = dev(p + "self_attn.q_proj.weight"), dev(p + "self_attn.k_proj.weight")
        self.wv, self.wo = dev(p + "self_attn.v_proj.weight"), dev(p + "self_attn.o_proj.weight")
        self.q_norm, self.k_norm = dev(p + "self_attn.q_norm.weight"), dev(p + "self_attn.k_norm.weight")
        self.w_gate, self.w_up = dev(p + "mlp.gate_proj.weight"), dev(p + "mlp.up_proj.weight")
        self.w_down = dev(p + "mlp.down_proj.weight")
        self.attn_base = self.attn_proj = self.mlp_base = self.mlp_proj = None
        if convs:
            self.attn_base, self.attn_proj = dev(p + "attention_conv.base_kernel"), \
                dev(p + "attention_conv.kernel_projection.weight")
            self.mlp_base, self.mlp_proj = dev(p + "mlp_conv.base_kernel"), dev(p + "mlp_conv.kernel_projection.weight")


def _check_target(cfg: DflashConfig, target_cfg) -> None:
    for key in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(cfg, key), getattr(target_cfg, key)
        if mine != theirs:
            raise ConfigError(f"dflash2 drafter {key} {mine} != target {key} {theirs}: "
                              "the drafter was made for another model")
    n = target_cfg.num_hidden_layers
    bad = [t for t in cfg.target_layer_ids if not 0 <= t < n]
    if bad:
        raise ConfigError(f"dflash2 target_layer_ids {bad} outside the target's layers 0..{n - 1}: "
                          "the drafter was made for another model")


class DflashDraft:
    def __init__(self, cfg: DflashConfig, tensors: dict, target_model, precision: str, mask_embedding=None):
        self.cfg, self.target, self.precision = cfg, target_model, precision
        self.be = target_model.be
        xp = self.xp = self.be.xp
        dev = lambda name: xp.asarray(tensors[name], dtype=F32)  # noqa: E731
        self.family = family_of(tensors)
        dflash2 = self.family == DFLASH2
        self.layers = [_Layer(dev, i, dflash2) for i in range(cfg.num_hidden_layers)]
        self.fc, self.hidden_norm, self.norm = dev("fc.weight"), dev("hidden_norm.weight"), dev("norm.weight")
        self.sel_hidden_proj = self.sel_pred = self.sel_succ = None   # the plain backbone has no selector
        if dflash2:
            self.sel_hidden_proj = dev("candidate_selector.hidden_projection.weight")
            self.sel_pred = dev("candidate_selector.predecessor_codebook")
            self.sel_succ = dev("candidate_selector.successor_codebook")
        has_markov = "markov_head.w1" in tensors
        self.markov_w1 = dev("markov_head.w1") if has_markov else None
        self.markov_w2 = dev("markov_head.w2") if has_markov else None
        self.conf_w = self.conf_b = None
        self.conf_with_markov = False
        if "confidence_head.weight" in tensors:
            self.conf_w = dev("confidence_head.weight").reshape(-1)
            self.conf_b = float(np.asarray(tensors["confidence_head.bias"]).reshape(-1)[0])
            self.conf_with_markov = self.conf_w.shape[0] != cfg.hidden_size
        self.mask_embedding = None if mask_embedding is None else xp.asarray(mask_embedding, dtype=F32)
        self.inv_freq = inv_freq(cfg.rope, cfg.head_dim)

    @classmethod
    def load(cls, path, target_model, precision: str = "bf16", mask_embedding=None) -> DflashDraft:
        """Load a drafter directory (config.json + model.safetensors) against its target."""
        if precision not in PRECISIONS:
            raise InputError(f"unknown drafter precision {precision!r}: choose one of {list(PRECISIONS)}")
        path = os.fspath(path)
        cfg = load_dflash_config(path)
        _check_target(cfg, target_model.cfg)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        tensors = load_weights(folder, cfg, precision)
        if mask_embedding is None and os.path.isfile(os.path.join(folder, MASK_FILE)):
            mask_embedding = os.path.join(folder, MASK_FILE)  # trained with the drafter, shipped beside it
        mask = None if mask_embedding is None else load_mask_embedding(mask_embedding, cfg.hidden_size)
        return cls(cfg, tensors, target_model, precision, mask)

    # ---- context ---------------------------------------------------------------------------
    def _rows(self, a, what: str):
        rows = self.xp.asarray(a, dtype=F32)
        if rows.ndim != 2 or rows.shape[1] != self.cfg.hidden_size:
            raise InputError(f"dflash2 {what}: expected [rows, {self.cfg.hidden_size}], got {list(rows.shape)}")
        return rows

    def ctx_features(self, tap_rows: list):
        """hidden_norm(fc(concat of the tapped layers' rows, in target_layer_ids order)) -> [n, H]."""
        taps = self.cfg.target_layer_ids
        if len(tap_rows) != len(taps):
            raise InputError(f"dflash2 ctx_features: got {len(tap_rows)} tapped layers, the drafter reads "
                             f"{len(taps)} (target layers {list(taps)}, in that order)")
        rows = [self._rows(t, f"tap of target layer {layer}") for t, layer in zip(tap_rows, taps)]
        if len({r.shape[0] for r in rows}) != 1:
            raise InputError(f"dflash2 ctx_features: the tapped layers have different row counts "
                             f"{[r.shape[0] for r in rows]}; pass the same rows of every layer")
        return self._rmsnorm(self.xp.concatenate(rows, axis=1) @ self.fc.T, self.hidden_norm)

    def new_kv(self, max_ctx: int) -> DflashKv:
        if isinstance(max_ctx, bool) or not isinstance(max_ctx, (int, np.integer)) or max_ctx < 1:
            raise InputError(f"dflash2 new_kv: max_ctx must be a positive integer, got {max_ctx!r}")
        c = self.cfg
        return DflashKv(self.xp, c.num_hidden_layers, int(max_ctx), c.num_key_value_heads, c.head_dim)

    def _check_kv(self, kv) -> None:
        c = self.cfg
        if not isinstance(kv, DflashKv) or len(kv.k) != c.num_hidden_layers \
                or kv.k[0].shape[1:] != (c.num_key_value_heads, c.head_dim):
            raise InputError("dflash2: this KV cache was not made by this drafter; create it with draft.new_kv")

    def ingest(self, kv: DflashKv, features) -> None:
        """Append context rows (ctx_features output) at cache positions kv.len.. for every layer."""
        self._check_kv(kv)
        feats = self._rows(features, "ingest features")
        n = feats.shape[0]
        if kv.len + n > kv.max_ctx:
            raise ContextOverflowError(f"dflash2 draft KV: {n} more rows at {kv.len} would pass max_ctx "
                                       f"{kv.max_ctx}; create it with a larger max_ctx")
        cos, sin = self._cos_sin(np.arange(kv.len, kv.len + n))
        c = self.cfg
        for li, layer in enumerate(self.layers):
            k = self._rmsnorm((feats @ layer.wk.T).reshape(n, c.num_key_value_heads, c.head_dim), layer.k_norm)
            kv.k[li][kv.len:kv.len + n] = apply_rope(k, cos, sin, self.xp)
            kv.v[li][kv.len:kv.len + n] = (feats @ layer.wv.T).reshape(n, c.num_key_value_heads, c.head_dim)
        kv.len += n

    # ---- the block forward -------------------------------------------------------------------
    def _block_ids(self, block_tokens) -> np.ndarray:
        ids = np.asarray(block_tokens)
        c = self.cfg
        if ids.ndim != 1 or not 1 <= ids.size <= c.block_size or (ids.size and ids.dtype.kind not in "iu"):
            raise InputError(f"dflash2 forward_block: block must be 1..{c.block_size} token ids (block_size), "
                             f"got {block_tokens!r:.80}")
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise InputError(f"dflash2 forward_block: token ids must lie in 0..{c.vocab_size - 1}")
        return ids.astype(np.int64)

    def forward_block(self, kv: DflashKv, block_tokens, start_pos: int):
        """Final normed hidden rows [b, H] of the block at positions start_pos.. over the cached
        context. Block K/V are transient: kv is not changed."""
        self._check_kv(kv)
        ids = self._block_ids(block_tokens)
        if isinstance(start_pos, bool) or not isinstance(start_pos, (int, np.integer)) or start_pos < kv.len:
            raise InputError(f"dflash2 forward_block: start_pos {start_pos!r} must be an integer >= the "
                             f"{kv.len} cached context rows (the block follows its context)")
        xp, c = self.xp, self.cfg
        h = xp.array(self.be.embed(self.target.embed_table, ids), dtype=F32)
        if self.mask_embedding is not None:  # integer rows: a boolean index would sync on its count
            h[xp.asarray(np.flatnonzero(ids == c.mask_token_id))] = self.mask_embedding
        h = h * F32(c.input_embedding_scale)
        cos, sin = self._cos_sin(np.arange(start_pos, start_pos + ids.size))
        masks = _Visibility(xp, kv.len, ids.size)
        for li, layer in enumerate(self.layers):
            x = self._rmsnorm(h, layer.ln_in)
            h = h + self._convolved(layer.attn_base, layer.attn_proj, x, self._attention, li, layer, kv, cos, sin,
                                    masks)
            x = self._rmsnorm(h, layer.ln_post)
            h = h + self._convolved(layer.mlp_base, layer.mlp_proj, x, self._mlp, layer)
        return self._rmsnorm(h, self.norm)

    def _convolved(self, base, proj, x, sublayer, *args):
        """conv_post(sublayer(conv_pre(x), *args)), both sides' coefficients from the sublayer input x;
        the plain sublayer(x, *args) without convs."""
        if base is None:
            return sublayer(x, *args)
        c = self.cfg
        coef = (x @ proj.T).reshape(x.shape[0], 2, c.conv_kernel_size, c.hidden_size // c.conv_group_size)
        y = sublayer(conv_rows(self.xp, x, base[0], coef[:, 0], c.conv_group_size), *args)
        return conv_rows(self.xp, y, base[1], coef[:, 1], c.conv_group_size)

    def _attention(self, x, li: int, layer: _Layer, kv: DflashKv, cos, sin, masks):
        xp, c = self.xp, self.cfg
        b, nh, nkv, hd = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = apply_rope(self._rmsnorm((x @ layer.wq.T).reshape(b, nh, hd), layer.q_norm), cos, sin, xp)
        k = apply_rope(self._rmsnorm((x @ layer.wk.T).reshape(b, nkv, hd), layer.k_norm), cos, sin, xp)
        v = (x @ layer.wv.T).reshape(b, nkv, hd)
        window = c.sliding_window if c.layer_sliding[li] else None
        first = 0 if window is None else max(0, kv.len - window + 1)  # no block row sees further back
        keys = xp.concatenate([kv.k[li][first:kv.len], k])
        values = xp.concatenate([kv.v[li][first:kv.len], v])
        visible = masks(c.layer_causal[li], window, first, keys.shape[0])
        rep = nh // nkv
        qg = q.reshape(b, nkv, rep, hd).transpose(1, 2, 0, 3)                    # [nkv, rep, b, hd]
        scores = (qg @ keys.transpose(1, 2, 0)[:, None]) * F32(hd ** -0.5)     # [nkv, rep, b, n]
        if visible is not None:
            scores = xp.where(visible, scores, F32(-np.inf))
        probs = self.be.softmax(scores)
        out = probs @ values.transpose(1, 0, 2)[:, None]                        # [nkv, rep, b, hd]
        return out.transpose(2, 0, 1, 3).reshape(b, nh * hd) @ layer.wo.T

    def _mlp(self, x, layer: _Layer):
        return (self.be.silu(x @ layer.w_gate.T) * (x @ layer.w_up.T)) @ layer.w_down.T

    def _rmsnorm(self, x, w):
        """The backend's rmsnorm: one launch on the GPU where the array arithmetic took seven
        (a draft round is bound by its host's launches, not its GPU time)."""
        return self.be.rmsnorm(x, w, self.cfg.rms_norm_eps)

    def _cos_sin(self, positions):
        cos, sin = cos_sin(self.inv_freq, self.cfg.rope.mscale, positions)
        return self.xp.asarray(cos), self.xp.asarray(sin)

    # ---- logits ------------------------------------------------------------------------------
    def logits(self, hidden):
        """The target's lm head on draft hidden rows [n, H] -> [n, V], times output_multiplier,
        then softcapped cap * tanh(x / cap) when configured."""
        c = self.cfg
        rows = self._rows(hidden if getattr(hidden, "ndim", 2) == 2 else hidden[None], "logits hidden")
        out = self.be.linear(self.be.contiguous(rows), self.target.lm_head)
        if c.output_multiplier != 1.0:
            out = out * F32(c.output_multiplier)
        if c.final_logit_softcapping is not None:
            cap = F32(c.final_logit_softcapping)
            out = cap * self.xp.tanh(out / cap)
        return out
