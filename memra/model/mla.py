"""Multi-head Latent Attention (NoPE) behind the DSA kpool indexer.

Every DSA layer caches one latent row c = RMSNorm(kv_a x) per position and attends in the
absorbed form: q_lat[h] = W_UK[h]^T q_nope[h], o[h] = W_UV[h] sum_j p[h, j] c_j (the backend's
mla_attention; a prompt on CUDA attends per head, to keys and values expanded from c). Which
positions a row attends comes from the kpool indexer: complete pools of P keys are scored
against the row's indexer query, the best index_topk / P pools win, and the incomplete tail
pool is always attended (dense while the row sees no more pools than the budget).
A `shared` layer reuses the selection of the last full indexer layer for the same rows.
"""

from __future__ import annotations

import numpy as np

from memra.model.cache import LatentPlane


class KpoolIndexer:
    def __init__(self, be, w, cfg):
        self.be, self.cfg = be, cfg
        self.wq_b = be.matrix(w("indexer.wq_b.weight"))
        self.wk = be.matrix(w("indexer.wk.weight"))
        self.k_norm_w = be.weight(w("indexer.k_norm.weight"))
        self.k_norm_b = be.weight(w("indexer.k_norm.bias"))
        self.weights_proj = be.matrix(w("indexer.weights_proj.weight"))
        self.gate = be.matrix(w("indexer.index_kpool_compress_gate"))
        self.ape = be.weight(w("indexer.index_kpool_compress_ape"))
        self.x_weights = (self.wk, self.gate, self.weights_proj)  # the projections of the mixer's input

    def __call__(self, projected, qr, plane: LatentPlane, at):
        """Write the rows' indexer keys, finalize the pools they complete, select positions.
        projected: the mixer's input through self.x_weights; `at` is the walk's first position
        as the backend reads it (be.position)."""
        be, cfg = self.be, self.cfg
        keys, gates, wts = projected
        t, hi, di, pool = qr.shape[0], cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
        be.write_rows(plane.index_keys, be.layernorm(keys, self.k_norm_w, self.k_norm_b, 1e-6), at)
        be.write_rows(plane.index_gates, gates, at)
        be.kpool_finalize(plane.index_keys, plane.index_gates, self.ape, plane.pool_keys, at, t)
        q = be.linear(qr, self.wq_b).reshape(t, hi, di)
        wts = be.scale(wts, hi ** -0.5)
        return be.kpool_select(
            q, wts, plane.pool_keys, at, pool, cfg.index_pool_budget, cfg.index_width,
            di ** -0.5,
        )


class MlaMixer:
    def __init__(self, be, w, cfg, with_indexer: bool):
        self.be, self.cfg = be, cfg
        h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.q_a = be.matrix(w("q_a_proj.weight"))
        self.q_a_norm = be.weight(w("q_a_layernorm.weight"))
        self.q_b = be.matrix(w("q_b_proj.weight"))
        self.kv_a = be.matrix(w("kv_a_proj_with_mqa.weight"))
        self.kv_a_norm = be.weight(w("kv_a_layernorm.weight"))
        kv_b = w("kv_b_proj.weight").reshape(h, dn + dv, r)
        self.w_uk_t = be.matrix(np.ascontiguousarray(kv_b[:, :dn].transpose(0, 2, 1)))  # [H, R, dn]
        self.w_uv = be.matrix(np.ascontiguousarray(kv_b[:, dn:]))                       # [H, dv, R]
        self.o_proj = be.matrix(w("o_proj.weight"))
        self.indexer = KpoolIndexer(be, w, cfg) if with_indexer else None
        self.scale = cfg.qk_head_dim ** -0.5
        self.x_weights = (self.q_a, self.kv_a, *(self.indexer.x_weights if self.indexer else ()))

    def new_plane(self, max_ctx: int) -> LatentPlane:
        be, cfg = self.be, self.cfg
        plane = LatentPlane(latent=be.zeros((max_ctx, cfg.kv_lora_rank)))
        if self.indexer is not None:
            di = cfg.index_head_dim
            plane.index_keys = be.zeros((max_ctx, di))
            plane.index_gates = be.zeros((max_ctx, di))
            plane.pool_keys = be.zeros((max_ctx // cfg.index_kpool + 1, di))
        return plane

    def __call__(self, x, plane: LatentPlane, at, selection):
        """Rows x [t, D] at positions at.. -> (out [t, D], selection used). Writes the plane's
        rows; the caller checks the plane before (LatentPlane.check) and advances it after."""
        be, cfg, t = self.be, self.cfg, x.shape[0]
        h, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        q_low, kv_low, *indexed = be.linears(x, self.x_weights)
        qr = be.rmsnorm(q_low, self.q_a_norm, cfg.rms_norm_eps)
        q = be.linear(qr, self.q_b).reshape(t, h, dn)
        be.write_rows(plane.latent, be.rmsnorm(kv_low, self.kv_a_norm, cfg.rms_norm_eps), at)
        if self.indexer is not None:
            selection = self.indexer(indexed, qr, plane, at)
        # the whole plane: the selection names only positions below the walk's last row; the
        # plane holds the walk's first position's rows (LatentPlane.check), so its length is pos0
        o = be.mla_attention(q, plane.latent, selection, self.w_uk_t, self.w_uv, self.scale).reshape(t, h * dv)
        return be.linear(o, self.o_proj), selection
