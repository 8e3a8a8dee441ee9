"""Named config dicts: `mini` (the seed fixture, verbatim), `small` (the CPU-test model) and
`bench` / `bench-dense` (GLM-5-Next's real per-layer widths in 12 layers, for the GPU benchmarks),
`bench-xl` (the same widths in 24 layers and 128 experts: more than one GPU holds in bf16) and
`full` (the released model's every size: planned, never written).
Each preset after `mini` is the one before it plus the keys that differ, so a difference reads
as one line (and every dict keeps the seed's key order).

    from memra.config import preset
    cfg_dict = preset("small")
"""

from __future__ import annotations

import copy

from memra.errors import ConfigError


def _derive(base: dict, drop: tuple = (), **changes) -> dict:
    """`base` without the `drop` keys, with `changes` set (a new key goes last)."""
    out = {key: value for key, value in base.items() if key not in drop}
    out.update(changes)
    return out


_MINI = {
    "model_type": "glm5_next_text",
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1,
    "hidden_size": 128,
    "intermediate_size": 64,
    "vocab_size": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "tie_word_embeddings": True,
    "hc_mult": 4,
    "hc_eps": 1e-06,
    "hc_sinkhorn_iters": 20,
    "mhc": True,
    "layer_types": ["linear_attention", "deepseek_sparse_attention",
                    "linear_attention", "deepseek_sparse_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "first_k_dense_replace": 1,
    "indexer_types": ["full", "full", "full", "full"],
    "linear_attn_config": {
        "num_heads": 1,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "kda_layers": [0, 2],
        "full_attn_layers": [1, 3],
    },
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_head_dim": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 0,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "index_n_heads": 1,
    "index_head_dim": 8,
    "index_topk": 8,
    "index_kpool": 4,
    "index_kpool_always_select_tail": True,
    "index_kpool_compress": True,
    "indexer_rope_interleave": True,
    "index_share_for_mtp_iteration": True,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "n_shared_experts": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "head_dim": 0,
    "attention_bias": False,
    "moe_router_dtype": "float32",
    "dtype": "bfloat16",
}

# The seed's explicit spellings of values memra derives or requires (checked when present);
# the other presets leave them out.
_SEED_SPELLINGS = ("mhc", "first_k_dense_replace", "qk_head_dim", "mla_use_nope", "indexer_rope_interleave",
                   "index_share_for_mtp_iteration", "scoring_func", "topk_method", "head_dim", "attention_bias",
                   "moe_router_dtype", "dtype")

# CPU-test scale: every layer kind, a shared indexer layer right after a full one (the only
# placement transformers can run), grouped routing, an untied head, and a kpool budget of
# 2 pools of 4 so a 64-token prompt is well past the dense threshold of 11 tokens.
_SMALL = _derive(
    _MINI, drop=_SEED_SPELLINGS,
    num_hidden_layers=6,
    hidden_size=64,
    intermediate_size=96,
    vocab_size=256,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention",
                 "linear_attention", "linear_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
    indexer_types=["full", "full", "shared", "full", "full", "full"],
    linear_attn_config=_derive(_MINI["linear_attn_config"], num_heads=2, head_dim=32,
                               kda_layers=[0, 3, 4], full_attn_layers=[1, 2, 5]),
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    index_n_heads=4,
    index_head_dim=16,
    n_routed_experts=8,
    moe_intermediate_size=32,
    n_group=2,
    eos_token_id=255,
)

# GPU-benchmark scale: every width of the real model (research/glm5_checkpoint.md section 0), but
# 12 layers with the real schedule (DSA at i % 4 == 3, an indexer on every DSA layer) and 64 routed
# experts, so bf16 weights (~46 GB) fit one GPU. index_kpool is transformers' class default 16
# (the release itself is read as 4 there).
_BENCH = _derive(
    _SMALL, drop=("eos_token_id",),
    num_hidden_layers=12,
    hidden_size=4096,
    intermediate_size=12288,
    vocab_size=154880,
    max_position_embeddings=8192,
    layer_types=["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(12)],
    mlp_layer_types=["dense"] + ["sparse"] * 11,
    indexer_types=["full"] * 12,
    linear_attn_config=_derive(_SMALL["linear_attn_config"], num_heads=64, head_dim=128,
                               kda_layers=[i for i in range(12) if i % 4 != 3], full_attn_layers=[3, 7, 11]),
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=256,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    index_kpool=16,
    n_routed_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    n_group=1,
)

# The same trunk with a dense FFN in every layer: attention, KDA and the lm head alone (the MTP
# block stays MoE, as in every checkpoint).
_BENCH_DENSE = _derive(_BENCH, mlp_layer_types=["dense"] * 12)

# Too large for one GPU in bf16 (155 GiB of weights against an H200's 141 GB; 82 GiB in FP8): the
# bench trunk at 24 layers (the same schedule) with 128 routed experts, for the pipeline
# benchmarks over 2-4 GPUs (docs/pipeline.md).
_BENCH_XL = _derive(
    _BENCH,
    num_hidden_layers=24,
    layer_types=["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(24)],
    mlp_layer_types=["dense"] + ["sparse"] * 23,
    indexer_types=["full"] * 24,
    linear_attn_config=_derive(_BENCH["linear_attn_config"], kda_layers=[i for i in range(24) if i % 4 != 3],
                               full_attn_layers=[i for i in range(24) if i % 4 == 3]),
    n_routed_experts=128,
)

# GLM-5-Next as released, for the memory plan only (never written as a fixture: ~600 GiB of bf16).
# Widths, 45 layers, DSA at i % 4 == 3 (11 layers, every one with an indexer), 288 experts top-8,
# index_kpool 4: research/glm5_checkpoint.md section 0 ("Real model") and section 1. Three dense
# layers (HF's default first min(3, L)): the only count that gives the FP8 release's 37,338 scales
# (section 1, "FP8 release extras"): 12 attention blocks x 4 + 3 dense MLPs x 3 + 43 MoE blocks x
# (288 + 1) x 3. max_position_embeddings 1048576 is the value the release's DFlash drafter copies
# from its target (research/dflash2.md); the research notes do not quote the target's own config.
_FULL = _derive(
    _BENCH,
    num_hidden_layers=45,
    max_position_embeddings=1048576,
    layer_types=["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(45)],
    mlp_layer_types=["dense"] * 3 + ["sparse"] * 42,
    indexer_types=["full"] * 45,
    linear_attn_config=_derive(_BENCH["linear_attn_config"], kda_layers=[i for i in range(45) if i % 4 != 3],
                               full_attn_layers=[i for i in range(45) if i % 4 == 3]),
    index_kpool=4,
    n_routed_experts=288,
)

_PRESETS = {"mini": _MINI, "small": _SMALL, "bench": _BENCH, "bench-dense": _BENCH_DENSE, "bench-xl": _BENCH_XL,
            "full": _FULL}


def preset(name: str) -> dict:
    """A fresh copy of a named config dict (`mini`: the seed fixture; `small`: CPU tests;
    `bench`, `bench-dense`: GPU benchmarks; `full`: the released model, for memory plans)."""
    if name not in _PRESETS:
        raise ConfigError(f"unknown preset {name!r}: choose one of {sorted(_PRESETS)}")
    return copy.deepcopy(_PRESETS[name])
