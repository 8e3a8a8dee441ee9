"""The glm5_next tensor contract: every tensor a checkpoint of a config must hold, and its shape.

Canonical bare names (research/glm5_checkpoint.md section 1): the trunk's layers, the NextN/MTP
block at layer `num_hidden_layers`, the embedding, final norm and (untied) lm head. memra.checkpoint
loads against it, memra.memory plans with it, memra.fixtures writes it.

    expected_tensors(cfg)["layers.0.self_attn.q_proj.weight"]   # (linear_dim, hidden_size)
    expected_count(cfg)                                          # without enumerating experts
"""

from __future__ import annotations

import dataclasses

from memra.config import KDA, ModelConfig


def _kda(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, c, hk, dk = cfg.hidden_size, cfg.linear_dim, cfg.linear_num_heads, cfg.linear_head_dim
    k = cfg.linear_conv_kernel_dim
    out = {f"{p}_proj.weight": (c, d) for p in "qkv"}
    out.update({f"{p}_conv1d.weight": (c, 1, k) for p in "qkv"})
    out.update({
        "f_a_proj.weight": (dk, d), "f_b_proj.weight": (c, dk), "A_log": (hk,), "dt_bias": (c,),
        "b_proj.weight": (hk, d), "g_a_proj.weight": (dk, d), "g_b_proj.weight": (c, dk),
        "o_norm.weight": (dk,), "o_proj.weight": (d, c),
    })
    return out


def _dsa(cfg: ModelConfig, with_indexer: bool) -> dict[str, tuple[int, ...]]:
    d, h, rq, rkv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    out = {
        "q_a_proj.weight": (rq, d), "q_a_layernorm.weight": (rq,), "q_b_proj.weight": (h * (dn + dr), rq),
        "kv_a_proj_with_mqa.weight": (rkv + dr, d), "kv_a_layernorm.weight": (rkv,),
        "kv_b_proj.weight": (h * (dn + dv), rkv), "o_proj.weight": (d, h * dv),
    }
    if with_indexer:
        hi, di, p = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
        out.update({f"indexer.{k}": v for k, v in {
            "wq_b.weight": (hi * di, rq), "wk.weight": (di, d), "k_norm.weight": (di,),
            "k_norm.bias": (di,), "weights_proj.weight": (hi, d),
            "index_kpool_compress_gate": (di, d), "index_kpool_compress_ape": (p, di),
        }.items()})
    return out


def _swiglu(inner: int, d: int) -> dict[str, tuple[int, ...]]:
    return {"gate_proj.weight": (inner, d), "up_proj.weight": (inner, d), "down_proj.weight": (d, inner)}


def _moe(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, e = cfg.hidden_size, cfg.n_routed_experts
    out = {"gate.weight": (e, d), "gate.e_score_correction_bias": (e,)}
    for i in range(e):
        out.update({f"experts.{i}.{k}": v for k, v in _swiglu(cfg.moe_intermediate_size, d).items()})
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    out.update({f"shared_experts.{k}": v for k, v in _swiglu(shared, d).items()})
    return out


def _hc(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    n, d = cfg.hc_mult, cfg.hidden_size
    m = (2 + n) * n
    out = {}
    for site in ("attn", "ffn"):
        out.update({f"hc_{site}_fn": (m, n * d), f"hc_{site}_base": (m,), f"hc_{site}_scale": (3,)})
    return out


def _prefixed(prefix: str, block: dict) -> dict[str, tuple[int, ...]]:
    return {prefix + k: v for k, v in block.items()}


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical bare tensor name -> shape for every tensor a checkpoint of `cfg` must hold."""
    d, v, n_layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    out = {"embed_tokens.weight": (v, d), "norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    for i in range(n_layers):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        out.update(_prefixed(p, _hc(cfg)))
        kind = cfg.layer_types[i]
        mixer = _kda(cfg) if kind == KDA else _dsa(cfg, cfg.indexer_types[i] == "full")
        out.update(_prefixed(p + "self_attn.", mixer))
        ffn = _swiglu(cfg.intermediate_size, d) if cfg.mlp_layer_types[i] == "dense" else _moe(cfg)
        out.update(_prefixed(p + "mlp.", ffn))
    if cfg.has_mtp:
        p = f"layers.{n_layers}."
        for name in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
            out[f"{p}{name}.weight"] = (d,)
        out[p + "eh_proj.weight"] = (d, 2 * d)
        out.update(_prefixed(p + "self_attn.", _dsa(cfg, with_indexer=True)))
        out.update(_prefixed(p + "mlp.", _moe(cfg)))
    return out


def expected_count(cfg: ModelConfig) -> int:
    """len(expected_tensors(cfg)) without enumerating experts: what a declared size costs to check."""
    moe = len(_moe(dataclasses.replace(cfg, n_routed_experts=0))) + 3 * cfg.n_routed_experts
    n = 2 + (0 if cfg.tie_word_embeddings else 1)
    for i in range(cfg.num_hidden_layers):
        mixer = _kda(cfg) if cfg.layer_types[i] == KDA else _dsa(cfg, cfg.indexer_types[i] == "full")
        n += 2 + len(_hc(cfg)) + len(mixer) + (3 if cfg.mlp_layer_types[i] == "dense" else moe)
    return n + (6 + len(_dsa(cfg, with_indexer=True)) + moe if cfg.has_mtp else 0)
