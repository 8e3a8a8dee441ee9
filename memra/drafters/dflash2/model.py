"""The DFlash-family drafter network: context features, the draft KV cache and the block forward.

A small Qwen3-style stack drafts a whole block [anchor, MASK x (b-1)] in one forward, attending
(bidirectionally unless the config says causal) over the cached target context and the block.
It borrows the target's embedding table and lm head. In a DFlash2 checkpoint each sublayer is
wrapped in the grouped dynamic causal conv (research/dflash2.md §2): per-row coefficients come
from the sublayer input, the pre-conv mixes that input with its previous row, the post-conv does
the same to the sublayer output. The conv is block-local (row 0 reads zeros), so there is no conv
state between rounds. A DFlash v1 / DSpark checkpoint (`family == "dflash"`, the seed's format)
has no convs: its sublayers are the plain pre-norm residual ones.

The drafter is not in the exact class (the target verifies every token): it computes in float32
with the backend's ops (projections, rmsnorm, silu, block attention, top-k) and the array module's
elementwise ones. None of them is a cuBLAS call on a block's rows, so on CUDA a draft round (the
block forward, its logits and candidates) and a round's context append are each captured once
into a CUDA graph per shape and replayed (the cache's walk runner, as the target's walks): a
round was bound by its host's few hundred eager launches, not by its GPU time.

    draft = DflashDraft.load(dir, target_model, precision="q8_0")
    kv = draft.new_kv(max_ctx)
    draft.ingest(kv, draft.ctx_features([taps[l] for l in draft.cfg.target_layer_ids]))
    hidden = draft.forward_block(kv, [anchor] + [mask] * (b - 1), start_pos=kv.len)
    logits = draft.logits(hidden[1:])
    rows, logits, (values, ids) = draft.draft_rows(kv, block, kv.len, first=1, n=7, top_k=8)  # one replay
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
from memra.limits import VERIFY_CAP
from memra.safetensors_io import f32_to_bf16

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
    """Per-layer context K (k_norm'd, roped) and V of the committed rows, append-only, and the
    walk runner (be.walks()) whose graphs hold these planes by address."""

    def __init__(self, xp, n_layers: int, max_ctx: int, n_kv: int, head_dim: int, walks):
        self.max_ctx = max_ctx
        self.len = 0
        self.walks = walks
        self.k = [xp.zeros((max_ctx, n_kv, head_dim), F32) for _ in range(n_layers)]
        self.v = [xp.zeros((max_ctx, n_kv, head_dim), F32) for _ in range(n_layers)]


class _Layer:
    """One layer's tensors: `dev` loads a vector or conv kernel, `mat` a projection matrix."""

    def __init__(self, dev, mat, i: int, convs: bool):
        p = f"layers.{i}."
        self.ln_in, self.ln_post = dev(p + "input_layernorm.weight"), dev(p + "post_attention_layernorm.weight")
        self.wq, self.wk = mat(p + "self_attn.q_proj.weight"), mat(p + "self_attn.k_proj.weight")
        self.wv, self.wo = mat(p + "self_attn.v_proj.weight"), mat(p + "self_attn.o_proj.weight")
        self.q_norm, self.k_norm = dev(p + "self_attn.q_norm.weight"), dev(p + "self_attn.k_norm.weight")
        self.w_gate, self.w_up = mat(p + "mlp.gate_proj.weight"), mat(p + "mlp.up_proj.weight")
        self.w_down = mat(p + "mlp.down_proj.weight")
        self.attn_base = self.attn_proj = self.mlp_base = self.mlp_proj = None
        if convs:
            self.attn_base, self.attn_proj = dev(p + "attention_conv.base_kernel"), \
                mat(p + "attention_conv.kernel_projection.weight")
            self.mlp_base, self.mlp_proj = dev(p + "mlp_conv.base_kernel"), mat(p + "mlp_conv.kernel_projection.weight")


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
        # bf16-held projections keep bf16 storage: the same values, half the bytes (on CUDA the
        # tensor-core projection; numpy widens them back)
        mat = (lambda name: self.be.matrix(f32_to_bf16(tensors[name]))) if precision == "bf16" else dev  # noqa: E731
        self.family = family_of(tensors)
        dflash2 = self.family == DFLASH2
        self.layers = [_Layer(dev, mat, i, dflash2) for i in range(cfg.num_hidden_layers)]
        self.fc, self.hidden_norm, self.norm = mat("fc.weight"), dev("hidden_norm.weight"), dev("norm.weight")
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
        self.inv_freq = xp.asarray(inv_freq(cfg.rope, cfg.head_dim))  # on the device before any capture

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
        return self._features(self._tap_rows(tap_rows))

    def _tap_rows(self, tap_rows: list) -> list:
        """The tapped layers' rows as device [n, H] arrays, checked against target_layer_ids."""
        taps = self.cfg.target_layer_ids
        if len(tap_rows) != len(taps):
            raise InputError(f"dflash2 ctx_features: got {len(tap_rows)} tapped layers, the drafter reads "
                             f"{len(taps)} (target layers {list(taps)}, in that order)")
        rows = [self._rows(t, f"tap of target layer {layer}") for t, layer in zip(tap_rows, taps)]
        if len({r.shape[0] for r in rows}) != 1:
            raise InputError(f"dflash2 ctx_features: the tapped layers have different row counts "
                             f"{[r.shape[0] for r in rows]}; pass the same rows of every layer")
        return rows

    def _features(self, rows):
        h = self.cfg.hidden_size
        x = self.xp.empty((rows[0].shape[0], h * len(rows)), F32)
        for i, r in enumerate(rows):  # slice copies: cupy's concatenate of over 8 arrays uploads a
            x[:, i * h:(i + 1) * h] = r  # pointer table, which a graph capture refuses
        return self._rmsnorm(self._linear(x, self.fc), self.hidden_norm)

    def new_kv(self, max_ctx: int) -> DflashKv:
        if isinstance(max_ctx, bool) or not isinstance(max_ctx, (int, np.integer)) or max_ctx < 1:
            raise InputError(f"dflash2 new_kv: max_ctx must be a positive integer, got {max_ctx!r}")
        c = self.cfg
        return DflashKv(self.xp, c.num_hidden_layers, int(max_ctx), c.num_key_value_heads, c.head_dim, self.be.walks())

    def _check_kv(self, kv) -> None:
        c = self.cfg
        if not isinstance(kv, DflashKv) or len(kv.k) != c.num_hidden_layers \
                or kv.k[0].shape[1:] != (c.num_key_value_heads, c.head_dim):
            raise InputError("dflash2: this KV cache was not made by this drafter; create it with draft.new_kv")

    def ingest(self, kv: DflashKv, features) -> None:
        """Append context rows (ctx_features output) at cache positions kv.len.. for every layer."""
        self._check_kv(kv)
        feats = self._rows(features, "ingest features")
        self._room(kv, feats.shape[0])
        self._append(kv, feats, kv.len)
        kv.len += feats.shape[0]

    def ingest_taps(self, kv: DflashKv, tap_rows: list) -> None:
        """ingest(kv, ctx_features(tap_rows)) as one walk: a round's few rows replay a graph."""
        self._check_kv(kv)
        rows = self._tap_rows(tap_rows)
        n = rows[0].shape[0]
        self._room(kv, n)
        key = (self, "ingest", n) if n <= VERIFY_CAP else None  # a prompt's rows run once, eagerly
        kv.walks.run(key, lambda _tokens, at, *taps: self._append(kv, self._features(list(taps)), at),
                     [], kv.len, *rows)
        kv.len += n

    def _room(self, kv: DflashKv, n: int) -> None:
        if kv.len + n > kv.max_ctx:
            raise ContextOverflowError(f"dflash2 draft KV: {n} more rows at {kv.len} would pass max_ctx "
                                       f"{kv.max_ctx}; create it with a larger max_ctx")

    def _append(self, kv: DflashKv, feats, at) -> None:
        """K/V of feats [n, H] into every layer's cache rows at.. (`at`: a position, host or device)."""
        xp, c, n = self.xp, self.cfg, feats.shape[0]
        rows = at + xp.arange(n)
        cos, sin = self._cos_sin(rows)
        for li, layer in enumerate(self.layers):
            k = self._rmsnorm(self._linear(feats, layer.wk).reshape(n, c.num_key_value_heads, c.head_dim),
                              layer.k_norm)
            kv.k[li][rows] = apply_rope(k, cos, sin, xp)
            kv.v[li][rows] = self._linear(feats, layer.wv).reshape(n, c.num_key_value_heads, c.head_dim)

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
        return self.xp.array(self._run_block(kv, block_tokens, start_pos, None), copy=True)

    def draft_rows(self, kv: DflashKv, block_tokens, start_pos: int, first: int, n: int, top_k: int | None):
        """A round's device work in one walk: the block forward's hidden rows first..first + n
        [n, H], their logits [n, V] and (top_k given) be.top_k(logits, top_k). The arrays are the
        walk's own, overwritten by the next round of the same shape."""
        if not (0 <= first and 1 <= n and first + n <= len(block_tokens)):
            raise InputError(f"dflash2 draft_rows: rows {first}..{first + n - 1} outside the "
                             f"{len(block_tokens)}-row block")
        if top_k is not None and not 1 <= top_k <= self.cfg.vocab_size:
            raise InputError(f"dflash2 draft_rows: top_k={top_k!r} outside 1..{self.cfg.vocab_size} (the vocab)")
        return self._run_block(kv, block_tokens, start_pos, (int(first), int(n), top_k))

    def _run_block(self, kv: DflashKv, block_tokens, start_pos: int, harvest):
        self._check_kv(kv)
        ids = self._block_ids(block_tokens)
        if isinstance(start_pos, bool) or not isinstance(start_pos, (int, np.integer)) or start_pos < kv.len:
            raise InputError(f"dflash2 forward_block: start_pos {start_pos!r} must be an integer >= the "
                             f"{kv.len} cached context rows (the block follows its context)")
        # the walk's tokens: the block ids, then the first position; its position: the context length
        return kv.walks.run((self, "block", ids.size, harvest), lambda tokens, n_ctx: self._block(
            kv, tokens, n_ctx, ids.size, harvest), np.append(ids, start_pos), kv.len)

    def _block(self, kv: DflashKv, tokens, n_ctx, b: int, harvest):
        xp, c = self.xp, self.cfg
        ids, start = tokens[:b], tokens[b:]
        h = self.be.embed(self.target.embed_table, ids)
        if self.mask_embedding is not None:
            h = xp.where((ids == c.mask_token_id)[:, None], self.mask_embedding, h)
        h = h * F32(c.input_embedding_scale)
        cos, sin = self._cos_sin(start + xp.arange(b))
        for li, layer in enumerate(self.layers):
            x = self._rmsnorm(h, layer.ln_in)
            h = h + self._convolved(layer.attn_base, layer.attn_proj, x, self._attention, li, layer, kv, n_ctx,
                                    cos, sin)
            x = self._rmsnorm(h, layer.ln_post)
            h = h + self._convolved(layer.mlp_base, layer.mlp_proj, x, self._mlp, layer)
        hidden = self._rmsnorm(h, self.norm)
        if harvest is None:
            return hidden
        first, n, top_k = harvest
        rows = hidden[first:first + n]
        logits = self.logits(rows)
        return rows, logits, None if top_k is None else self.be.top_k(logits, top_k)

    def _convolved(self, base, proj, x, sublayer, *args):
        """conv_post(sublayer(conv_pre(x), *args)), both sides' coefficients from the sublayer input x;
        the plain sublayer(x, *args) without convs."""
        if base is None:
            return sublayer(x, *args)
        c = self.cfg
        coef = self._linear(x, proj).reshape(x.shape[0], 2, c.conv_kernel_size, c.hidden_size // c.conv_group_size)
        y = sublayer(conv_rows(self.xp, x, base[0], coef[:, 0], c.conv_group_size), *args)
        return conv_rows(self.xp, y, base[1], coef[:, 1], c.conv_group_size)

    def _attention(self, x, li: int, layer: _Layer, kv: DflashKv, n_ctx, cos, sin):
        xp, c = self.xp, self.cfg
        b, nh, nkv, hd = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = apply_rope(self._rmsnorm(self._linear(x, layer.wq).reshape(b, nh, hd), layer.q_norm), cos, sin, xp)
        k = apply_rope(self._rmsnorm(self._linear(x, layer.wk).reshape(b, nkv, hd), layer.k_norm), cos, sin, xp)
        v = self._linear(x, layer.wv).reshape(b, nkv, hd)
        window = c.sliding_window if c.layer_sliding[li] else None
        out = self.be.block_attention(q, kv.k[li], kv.v[li], k, v, n_ctx, c.layer_causal[li], window, hd ** -0.5)
        return self._linear(out.reshape(b, nh * hd), layer.wo)

    def _mlp(self, x, layer: _Layer):
        return self._linear(self.be.silu(self._linear(x, layer.w_gate)) * self._linear(x, layer.w_up), layer.w_down)

    def _linear(self, x, w):
        """be.linear, a block of up to 2 VERIFY_CAP rows in exact-class calls of at most
        VERIFY_CAP (16 rows would be one cuBLAS call, which CuPy refuses in a graph capture); a
        row's values do not depend on the split."""
        x = self.be.contiguous(x)
        t = x.shape[0]
        if t <= VERIFY_CAP or t > 2 * VERIFY_CAP:
            return self.be.linear(x, w)
        half = (t + 1) // 2
        return self.xp.concatenate([self.be.linear(x[:half], w), self.be.linear(x[half:], w)])

    def _rmsnorm(self, x, w):
        """The backend's rmsnorm: one launch on the GPU where the array arithmetic took seven
        (a draft round is bound by its host's launches, not its GPU time)."""
        return self.be.rmsnorm(x, w, self.cfg.rms_norm_eps)

    def _cos_sin(self, positions):
        return cos_sin(self.inv_freq, self.cfg.rope.mscale, positions, self.xp)

    # ---- logits ------------------------------------------------------------------------------
    def logits(self, hidden):
        """The target's lm head on draft hidden rows [n, H] -> [n, V], times output_multiplier,
        then softcapped cap * tanh(x / cap) when configured."""
        c = self.cfg
        rows = self._rows(hidden if getattr(hidden, "ndim", 2) == 2 else hidden[None], "logits hidden")
        out = self._linear(rows, self.target.lm_head)
        if c.output_multiplier != 1.0:
            out = out * F32(c.output_multiplier)
        if c.final_logit_softcapping is not None:
            cap = F32(c.final_logit_softcapping)
            out = cap * self.xp.tanh(out / cap)
        return out
