"""The named presets: `mini` is the seed fixture verbatim, `small` has every layer kind, `bench`,
`bench-dense` and `bench-xl` carry GLM-5-Next's real widths; each derived preset shares nothing
with its base."""

from __future__ import annotations

import json
import os
import re

import pytest

from memra.config import KDA, ModelConfig, preset
from memra.errors import ConfigError

LAC = "linear_attn_config"
SEED_FILE = "/work/shared/seeds/002_c1f1d2508258951f.txt"


def _seed_mini_config() -> dict:
    """The JSON literal of the seed gate's `mini_config_json()`, parsed from the seed text."""
    if not os.path.exists(SEED_FILE):
        pytest.skip(f"seed file {SEED_FILE} is not on this machine")
    with open(SEED_FILE, encoding="utf-8") as f:
        text = f.read()
    m = re.search(r'fn mini_config_json\(\) -> String \{\s*r#"(.*?)"#', text, re.DOTALL)
    assert m, "mini_config_json() not found in the seed"
    return json.loads(m.group(1))


def test_mini_preset_is_the_seed_fixture_config_exactly():
    seed = _seed_mini_config()
    mini = preset("mini")
    assert mini == seed
    assert json.dumps(mini, sort_keys=True) == json.dumps(seed, sort_keys=True)  # bool/int/float kinds too


def test_small_preset_has_every_layer_kind_and_a_sparse_64_token_prompt():
    cfg = ModelConfig.from_dict(preset("small"))
    assert KDA in cfg.layer_types
    full_dsa = [i for i in cfg.dsa_layers if cfg.indexer_types[i] == "full"]
    shared_after_full = [
        i for i in cfg.dsa_layers
        if cfg.indexer_types[i] == "shared" and i - 1 in full_dsa and cfg.indexer_source(i) == i - 1
    ]
    assert full_dsa and shared_after_full
    assert {"dense", "sparse"} <= set(cfg.mlp_layer_types)
    assert cfg.has_mtp
    dense_threshold = (cfg.index_topk // cfg.index_kpool + 1) * cfg.index_kpool
    assert 64 > dense_threshold


@pytest.mark.parametrize("name", ["bench", "bench-dense"])
def test_bench_presets_have_the_real_widths_in_twelve_layers(name):
    cfg = ModelConfig.from_dict(preset(name))
    real = {"hidden_size": 4096, "vocab_size": 154880, "linear_num_heads": 64, "linear_head_dim": 128,
            "linear_conv_kernel_dim": 4, "num_attention_heads": 64, "qk_nope_head_dim": 256, "v_head_dim": 256,
            "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 0, "index_n_heads": 32,
            "index_head_dim": 128, "index_topk": 2048, "index_kpool": 16, "moe_intermediate_size": 2048,
            "num_experts_per_tok": 8, "n_shared_experts": 1, "intermediate_size": 12288, "hc_mult": 4,
            "n_routed_experts": 64, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
            "routed_scaling_factor": 2.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-5}
    assert {k: getattr(cfg, k) for k in real} == real
    assert cfg.kda_layers == (0, 1, 2, 4, 5, 6, 8, 9, 10) and cfg.dsa_layers == (3, 7, 11)  # real: i % 4 == 3
    assert set(cfg.indexer_types) == {"full"}
    assert cfg.max_position_embeddings >= 4096 + 512  # the longest benchmark prompt, then decode
    ffn = ["dense"] * 12 if name == "bench-dense" else ["dense"] + ["sparse"] * 11
    assert list(cfg.mlp_layer_types) == ffn


def test_bench_xl_is_the_bench_trunk_doubled_with_twice_the_experts_and_needs_two_h200s_in_bf16():
    from memra.memory_plan import plan_for_config

    bench, xl = (ModelConfig.from_dict(preset(n)) for n in ("bench", "bench-xl"))
    same = ("hidden_size", "vocab_size", "linear_num_heads", "num_attention_heads", "kv_lora_rank",
            "moe_intermediate_size", "num_experts_per_tok", "index_kpool", "intermediate_size")
    assert {k: getattr(xl, k) for k in same} == {k: getattr(bench, k) for k in same}
    assert xl.num_hidden_layers == 24 and xl.n_routed_experts == 128
    assert xl.dsa_layers == tuple(i for i in range(24) if i % 4 == 3) and set(xl.indexer_types) == {"full"}
    assert list(xl.mlp_layer_types) == ["dense"] + ["sparse"] * 23
    h200 = 140 * 2 ** 30  # what one H200 offers a process
    needed = {dtype: plan_for_config(xl, dtype, max_ctx=8192, free=h200).devices_needed() for dtype in ("bf16", "fp8")}
    assert needed == {"bf16": 2, "fp8": 1}


def test_preset_returns_a_fresh_copy_each_call():
    first = preset("small")
    first["hidden_size"] = 1
    first[LAC]["kda_layers"].append(99)
    first["layer_types"][0] = "bogus"
    again = preset("small")
    assert again["hidden_size"] == 64
    assert again[LAC]["kda_layers"] == [0, 3, 4]
    assert again["layer_types"][0] == KDA


def test_unknown_preset_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match="tiny"):
        preset("tiny")


def test_a_derived_preset_shares_nothing_with_the_preset_it_derives_from():
    dense = preset("bench-dense")
    dense[LAC]["kda_layers"].append(99)
    dense[LAC]["num_heads"] = 1
    assert preset("bench")[LAC] == preset("bench-dense")[LAC] == {
        "num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
        "kda_layers": [0, 1, 2, 4, 5, 6, 8, 9, 10], "full_attn_layers": [3, 7, 11]}
    assert preset("small")[LAC]["num_heads"] == 2 and preset("mini")[LAC]["num_heads"] == 1
