"""ModelConfig: the presets, transformers' derivations, the accepted spellings and every refusal.

transformers 5.23.0 (`Glm5NextTextConfig`) is the truth for defaults and derived schedules; the
comparisons skip when it is not importable. Every refusal must be a `ConfigError` naming its key.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memra.checkpoint import expected_tensors
from memra.config import DSA, KDA, ModelConfig, load_config, preset
from memra.errors import ConfigError

LAC = "linear_attn_config"


def _set(d: dict, path: str, value) -> dict:
    """d with `path` ("key" or "linear_attn_config.key") set to value; "__delete__" removes it."""
    *parents, leaf = path.split(".")
    target = d
    for p in parents:
        target = target[p]
    if value == "__delete__":
        target.pop(leaf, None)
    else:
        target[leaf] = value
    return d


def _with_layers(d: dict, types: list[str]) -> dict:
    """d with layer_types replaced and the linear_attn_config index lists kept consistent."""
    d["layer_types"] = types
    d[LAC]["kda_layers"] = [i for i, t in enumerate(types) if t == KDA]
    d[LAC]["full_attn_layers"] = [i for i, t in enumerate(types) if t != KDA]
    return d


def _without(d: dict, *paths: str) -> dict:
    for p in paths:
        _set(d, p, "__delete__")
    return d


# ---- transformers is the truth for defaults and derivations ----------------------------------

def _mixed_dsa(indexer: dict, types=(DSA, DSA, DSA, DSA, KDA, KDA)) -> dict:
    d = _with_layers(preset("small"), list(types))
    _without(d, "indexer_types")
    d.update(indexer)
    return d


HF_DICTS = {
    "mini": lambda: preset("mini"),
    "small": lambda: preset("small"),
    "no_layer_types": lambda: _without(preset("small"), "layer_types", f"{LAC}.kda_layers", f"{LAC}.full_attn_layers"),
    "no_mlp_layer_types": lambda: _without(preset("small"), "mlp_layer_types"),
    "no_schedules_at_all": lambda: _without(
        preset("mini"), "layer_types", "mlp_layer_types", "indexer_types", "first_k_dense_replace",
        f"{LAC}.kda_layers", f"{LAC}.full_attn_layers"),
    "pattern_string_FSFS": lambda: _mixed_dsa({"index_topk_pattern": "FSFSFS"}),
    "pattern_list": lambda: _mixed_dsa({"index_topk_pattern": ["full", "full", "shared", "full", "shared", "full"]}),
    "freq_2_default_offset": lambda: _mixed_dsa({"index_topk_freq": 2}),
    "freq_3_offset_0": lambda: _mixed_dsa({"index_topk_freq": 3, "index_skip_topk_offset": 0}, (KDA, KDA, DSA, DSA, DSA, DSA)),
    "lac_without_gate_bound": lambda: _set(_without(preset("small"), f"{LAC}.gate_lower_bound"), "linear_lower_bound", -3.0),
    "lac_gate_null_safe_gate_default": lambda: _set(preset("small"), f"{LAC}.gate_lower_bound", None),
    "lac_gate_null_safe_gate_true": lambda: _set(_set(preset("small"), f"{LAC}.gate_lower_bound", None), f"{LAC}.safe_gate", True),
    "lac_gate_null_safe_gate_false": lambda: _set(_set(preset("small"), f"{LAC}.gate_lower_bound", None), f"{LAC}.safe_gate", False),
    "lac_partial_top_level_rest": lambda: {**preset("small"), LAC: {"num_heads": 2}, "linear_head_dim": 32, "linear_conv_kernel_dim": 3},
    "no_lac_top_level_fields": lambda: {**_without(preset("small"), LAC), "linear_num_heads": 2, "linear_head_dim": 32, "linear_lower_bound": None},
    "full_attention_spelling": lambda: _set(preset("small"), "layer_types",
                                            [KDA, "full_attention", "deepseek_sparse_attention", KDA, KDA, DSA]),
}


def _hf_text_config(d: dict):
    hf = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")
    # pad_token_id: HF's default (154820) is outside a tiny vocab and only warns; memra ignores it.
    return hf.Glm5NextTextConfig(**{**copy.deepcopy(d), "pad_token_id": 0})


def _assert_matches_hf(cfg: ModelConfig, hf) -> None:
    for name in ModelConfig.__dataclass_fields__:
        ours, theirs = getattr(cfg, name), getattr(hf, name)
        if name == "eos_token_id":
            theirs = [] if theirs is None else [theirs] if isinstance(theirs, int) else theirs
        if isinstance(ours, tuple):
            ours = list(ours)
        assert ours == theirs, f"{name}: memra {ours!r} != transformers {theirs!r}"
    assert cfg.qk_head_dim == hf.qk_head_dim


@pytest.mark.parametrize("name", sorted(HF_DICTS))
def test_derived_fields_match_transformers(name):
    d = HF_DICTS[name]()
    _assert_matches_hf(ModelConfig.from_dict(d), _hf_text_config(d))


def test_nested_glm5_next_matches_transformers_text_config():
    hf = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")
    text = {**preset("small"), "pad_token_id": 0}
    nested = hf.Glm5NextConfig(text_config=text, vision_config={"depth": 1, "hidden_size": 32})
    _assert_matches_hf(ModelConfig.from_dict({"model_type": "glm5_next", "text_config": text}), nested.text_config)


@pytest.mark.parametrize("name", ["mini", "small", "pattern_string_FSFS", "lac_gate_null_safe_gate_default"])
def test_to_dict_is_read_by_transformers_as_the_same_model(name):
    cfg = ModelConfig.from_dict(HF_DICTS[name]())
    _assert_matches_hf(cfg, _hf_text_config(cfg.to_dict()))


def test_omitted_layer_types_never_silently_diverge_from_transformers():
    d = _without(preset("mini"), "layer_types")  # kda_layers [0, 2] kept; HF derives [K, K, K, DSA]
    hf = _hf_text_config(d)
    try:
        cfg = ModelConfig.from_dict(d)
    except ConfigError:
        return  # refusing the contradiction is as good as matching
    assert list(cfg.layer_types) == hf.layer_types


# ---- accepted spellings and layouts ----------------------------------------------------------

@pytest.mark.parametrize("spelling", ["deepseek_sparse_attention", "full_attention", "indexed_attention"])
def test_every_dsa_spelling_parses_to_indexed_attention(spelling):
    d = preset("small")
    d["layer_types"] = [spelling if t != KDA else KDA for t in d["layer_types"]]
    cfg = ModelConfig.from_dict(d)
    assert cfg.layer_types == ModelConfig.from_dict(preset("small")).layer_types
    assert cfg.dsa_layers == (1, 2, 5)


def test_glm5_next_with_text_config_and_flat_layouts_give_one_config():
    flat = ModelConfig.from_dict(preset("small"))
    nested = ModelConfig.from_dict({"model_type": "glm5_next", "text_config": preset("small"),
                                    "vision_config": {"depth": 1}})
    flat_glm5_next = ModelConfig.from_dict({**preset("small"), "model_type": "glm5_next"})
    assert nested == flat == flat_glm5_next


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3", None, "__delete__"])
def test_other_model_types_are_refused(model_type):
    d = _set(preset("small"), "model_type", model_type)
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_dict(d)


ROUND_TRIP_DICTS = sorted(HF_DICTS)


@pytest.mark.parametrize("name", ROUND_TRIP_DICTS)
def test_to_dict_round_trips_through_from_dict(name):
    cfg = ModelConfig.from_dict(HF_DICTS[name]())
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()


def test_null_gate_lower_bound_round_trips():
    cfg = ModelConfig.from_dict(HF_DICTS["lac_gate_null_safe_gate_false"]())
    assert cfg.linear_lower_bound is None
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


# ---- refusals: a ConfigError that names the key ----------------------------------------------

def _one_based_kda(d: dict) -> dict:
    _with_layers(d, [KDA, DSA, DSA, KDA, DSA, KDA])      # KDA at 0, 3, 5
    d[LAC]["kda_layers"] = [1, 4, 6]                      # Kimi's 1-based spelling: 6 == num_hidden_layers
    return d


REFUSALS = [
    ("topk_not_multiple_of_kpool", lambda d: _set(d, "index_topk", 10), "index_topk"),
    ("kpool_compress_false", lambda d: _set(d, "index_kpool_compress", False), "index_kpool_compress"),
    ("always_select_tail_false", lambda d: _set(d, "index_kpool_always_select_tail", False), "index_kpool_always_select_tail"),
    ("layer_types_too_short", lambda d: _set(d, "layer_types", d["layer_types"][:5]), "layer_types"),
    ("layer_types_too_long", lambda d: _set(d, "layer_types", d["layer_types"] + [KDA]), "layer_types"),
    ("unknown_layer_type", lambda d: _set(d, "layer_types", [KDA, "sliding_attention", DSA, KDA, KDA, DSA]), "layer_types"),
    ("layer_types_not_a_list", lambda d: _set(d, "layer_types", KDA), "layer_types"),
    ("mlp_type_moe", lambda d: _set(d, "mlp_layer_types", ["dense"] + ["moe"] * 5), "mlp_layer_types"),
    ("kda_layers_disagree", lambda d: _set(d, f"{LAC}.kda_layers", [0, 3]), "kda_layers"),
    ("kda_layers_one_based", _one_based_kda, "kda_layers"),
    ("full_attn_layers_disagree", lambda d: _set(d, f"{LAC}.full_attn_layers", [1, 2]), "full_attn_layers"),
    ("first_k_dense_contradicts", lambda d: _set(d, "first_k_dense_replace", 2), "first_k_dense_replace"),
    ("qk_head_dim_contradicts", lambda d: _set(d, "qk_head_dim", 24), "qk_head_dim"),
    ("rope_dim_positive", lambda d: _set(d, "qk_rope_head_dim", 8), "qk_rope_head_dim"),
    ("kv_heads_differ", lambda d: _set(d, "num_key_value_heads", 2), "num_key_value_heads"),
    ("q_lora_rank_null", lambda d: _set(d, "q_lora_rank", None), "q_lora_rank"),
    ("hidden_act_gelu", lambda d: _set(d, "hidden_act", "gelu"), "hidden_act"),
    ("scoring_softmax", lambda d: _set(d, "scoring_func", "softmax"), "scoring_func"),
    ("topk_method_greedy", lambda d: _set(d, "topk_method", "greedy"), "topk_method"),
    ("experts_not_divisible_by_groups", lambda d: _set(d, "n_routed_experts", 9), "n_routed_experts"),
    ("experts_per_tok_too_many", lambda d: _set(d, "num_experts_per_tok", 5), "num_experts_per_tok"),
    ("two_nextn_layers", lambda d: _set(d, "num_nextn_predict_layers", 2), "num_nextn_predict_layers"),
    ("mhc_false", lambda d: _set(d, "mhc", False), "mhc"),
    ("string_for_int", lambda d: _set(d, "hidden_size", "64"), "hidden_size"),
    ("bool_for_int", lambda d: _set(d, "num_hidden_layers", True), "num_hidden_layers"),
    ("float_for_int", lambda d: _set(d, "n_routed_experts", 8.0), "n_routed_experts"),
    ("string_for_float", lambda d: _set(d, "rms_norm_eps", "1e-5"), "rms_norm_eps"),
    ("int_for_bool", lambda d: _set(d, "tie_word_embeddings", 1), "tie_word_embeddings"),
    ("string_in_linear_attn_config", lambda d: _set(d, f"{LAC}.num_heads", "2"), "num_heads"),
    ("linear_attn_config_not_an_object", lambda d: _set(d, LAC, [2, 32]), LAC),
    ("eos_not_an_int", lambda d: _set(d, "eos_token_id", "</s>"), "eos_token_id"),
    ("zero_hidden_size", lambda d: _set(d, "hidden_size", 0), "hidden_size"),
    ("negative_kpool", lambda d: _set(d, "index_kpool", -4), "index_kpool"),
]


@pytest.mark.parametrize("mutate,key", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_bad_config_is_refused_with_a_config_error_naming_the_key(mutate, key):
    d = mutate(preset("small"))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(d)
    assert key in str(info.value)


def test_refusal_arms_have_a_green_twin():
    """The unmutated preset parses, so each refusal above is caused by its one mutation."""
    assert ModelConfig.from_dict(preset("small")).num_hidden_layers == 6
    assert ModelConfig.from_dict(_with_layers(preset("small"), [KDA, DSA, DSA, KDA, DSA, KDA])).kda_layers == (0, 3, 5)


def test_shared_indexer_without_a_full_dsa_layer_before_it_is_refused():
    d = _set(preset("small"), "indexer_types", ["full", "shared", "shared", "full", "full", "full"])
    with pytest.raises(ConfigError, match="layer 1"):
        ModelConfig.from_dict(d)


def test_shared_indexer_refusal_names_the_indexer_types_key():
    d = _set(preset("small"), "indexer_types", ["full", "shared", "shared", "full", "full", "full"])
    with pytest.raises(ConfigError, match="indexer_types"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("raw", [None, [], "glm5_next_text", 3, {"model_type": "glm5_next", "text_config": [1]}])
def test_non_object_config_is_a_config_error(raw):
    with pytest.raises(ConfigError):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("key,value", [
    ("index_topk_freq", "2"), ("index_topk_freq", None),
    ("index_skip_topk_offset", "2"), ("index_skip_topk_offset", None),
    ("index_topk_pattern", 5), ("index_topk_pattern", True),
])
def test_bad_indexer_schedule_keys_are_config_errors(key, value):
    d = _set(_without(preset("small"), "indexer_types"), key, value)
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("key,value", [
    ("swiglu_limit", math.nan), ("swiglu_limit", -1.0), ("routed_scaling_factor", math.inf),
    ("rms_norm_eps", math.inf), ("hc_eps", math.inf), (f"{LAC}.gate_lower_bound", -math.inf),
    ("n_shared_experts", -1),
    ("routed_scaling_factor", 1e308), ("swiglu_limit", -1e39),  # finite, but past float32: inf in the model
    ("rms_norm_eps", 1e-50), ("hc_eps", 1e-46),                 # positive, but 0 in float32
    ("hc_sinkhorn_iters", 10**9),                               # a run of hours (int32 holds it)
])
def test_nonsense_values_are_config_errors(key, value):
    d = _set(preset("small"), key, value)
    with pytest.raises(ConfigError, match=key.split(".")[-1]):
        ModelConfig.from_dict(d)


def test_tensor_contract_shapes_are_positive_for_a_valid_shared_expert_count():
    """The green twin of n_shared_experts=-1 above, which yields negative contract shapes."""
    cfg = ModelConfig.from_dict(_set(preset("small"), "n_shared_experts", 1))
    assert all(dim > 0 for shape in expected_tensors(cfg).values() for dim in shape)


# ---- any one-key mutation parses or is a ConfigError -----------------------------------------

_SMALL = preset("small")
_MUTABLE_KEYS = sorted(_SMALL) + sorted(f"{LAC}.{k}" for k in _SMALL[LAC])
_WRONG_VALUES = st.one_of(
    st.just("__delete__"), st.none(), st.booleans(),
    st.integers(-2**64, 2**64), st.sampled_from([0, -1, 1, 2, 3, 7, 8, 10**6]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.sampled_from([KDA, DSA, "full", "shared", "dense", "sparse", "silu"]),
    st.lists(st.one_of(st.integers(-2, 8), st.sampled_from([KDA, DSA, "full", "dense", "x"])), max_size=8),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)


@settings(max_examples=400, deadline=None, database=None)
@given(key=st.sampled_from(_MUTABLE_KEYS), value=_WRONG_VALUES)
def test_one_key_mutation_parses_or_raises_config_error(key, value):
    d = _set(preset("small"), key, value)
    try:
        cfg = ModelConfig.from_dict(d)
    except ConfigError as exc:
        assert str(exc)
        return
    assert isinstance(cfg, ModelConfig)
    again = ModelConfig.from_dict(cfg.to_dict())
    assert json.dumps(again.to_dict(), sort_keys=True) == json.dumps(cfg.to_dict(), sort_keys=True)


# ---- load_config -----------------------------------------------------------------------------

def test_load_config_reads_a_directory_or_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset("small")))
    want = ModelConfig.from_dict(preset("small"))
    assert load_config(tmp_path) == want
    assert load_config(tmp_path / "config.json") == want


def test_load_config_on_a_missing_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path / "no_such_checkpoint")
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path)  # exists, but holds no config.json


@pytest.mark.parametrize("text", ["{not json", "", "\xff\xfe", "[1, 2]", '{"model_type": "llama"}'])
def test_load_config_on_a_bad_file_is_a_config_error(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError):
        load_config(tmp_path)


def test_load_config_through_a_file_path_is_a_config_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0")
    with pytest.raises(ConfigError):
        load_config(tmp_path / "model.safetensors" / "config.json")
