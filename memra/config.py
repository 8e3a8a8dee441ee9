"""ModelConfig: a validated GLM-5-Next text config read from Hugging Face `config.json`.

Accepts the flat `glm5_next_text` layout and the multimodal `glm5_next` layout with a
`text_config`, with transformers' key names, defaults and derivations (see
research/glm5_checkpoint.md). Anything inconsistent or unsupported is refused with a
`ConfigError` that names the key and the fix; unknown keys that do not contradict are ignored.

    cfg = load_config("path/to/checkpoint")      # a directory or a config.json path
    cfg = ModelConfig.from_dict(preset("small"))
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, fields

from memra.errors import ConfigError

KDA = "linear_attention"
DSA = "indexed_attention"
# transformers writes the DSA mixer under three names across releases.
DSA_SPELLINGS = ("deepseek_sparse_attention", "full_attention", "indexed_attention")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    num_nextn_predict_layers: int = 0
    eos_token_id: tuple[int, ...] = ()
    # Schedules, one entry per trunk layer (filled by from_dict).
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()

    # ---- derived views -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == KDA)

    @property
    def dsa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == DSA)

    @property
    def linear_dim(self) -> int:
        """C = Hk * dk: width of each KDA q/k/v projection."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def index_pool_budget(self) -> int:
        """G = index_topk / P: how many complete pools a query row may select."""
        return self.index_topk // self.index_kpool

    @property
    def index_width(self) -> int:
        """Width of one row's attended-position list: the pooled budget plus the tail."""
        return self.index_topk + self.index_kpool - 1

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    def indexer_source(self, layer: int) -> int:
        """The DSA layer whose indexer selection `layer` uses (itself unless `shared`)."""
        for j in range(layer, -1, -1):
            if self.layer_types[j] == DSA and self.indexer_types[j] == "full":
                return j
        raise ConfigError(
            f"indexer_types[{layer}] is 'shared' but no DSA layer with a full indexer precedes "
            f"layer {layer}; mark an earlier DSA layer 'full' in indexer_types / index_topk_pattern"
        )

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        return _parse(raw)

    def to_dict(self) -> dict:
        """A flat `glm5_next_text` config.json dict that from_dict reads back to this config."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("layer_types", "mlp_layer_types", "indexer_types"):
            out[key] = list(out[key])
        out["eos_token_id"] = list(self.eos_token_id)
        lac = {
            "num_heads": self.linear_num_heads,
            "head_dim": self.linear_head_dim,
            "short_conv_kernel_size": self.linear_conv_kernel_dim,
            "gate_lower_bound": self.linear_lower_bound,
        }
        if self.linear_lower_bound is None:
            lac["safe_gate"] = False  # otherwise a null bound reads back as -5.0
        for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "linear_lower_bound"):
            out.pop(key)
        out["linear_attn_config"] = lac
        out["model_type"] = "glm5_next_text"
        out["num_key_value_heads"] = self.num_attention_heads
        out["index_kpool_compress"] = True
        out["pad_token_id"] = 0
        return out


_TYPES = {f.name: f.type for f in fields(ModelConfig)}
_LINEAR_KEYS = {
    "num_heads": "linear_num_heads",
    "head_dim": "linear_head_dim",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
    "gate_lower_bound": "linear_lower_bound",
}


def _text_section(raw: dict) -> dict:
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type == "glm5_next" and raw.get("text_config") is not None:
        text = raw["text_config"]
        if not isinstance(text, dict):
            raise ConfigError("glm5_next config: text_config must be an object")
        return text
    if model_type in ("glm5_next", "glm5_next_text"):
        return raw
    raise ConfigError(
        f"unsupported model_type {model_type!r}: memra runs glm5_next_text "
        "(or glm5_next with a text_config)"
    )


def _coerce(key: str, value, kind: str):
    """Check one scalar against the dataclass field type; return it in canonical form."""
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"config key {key!r} must be finite, got {value!r}")
        return float(value)
    if kind == "float | None":
        return None if value is None else _coerce(key, value, "float")
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"config key {key!r} must be a string, got {value!r}")
        return value
    raise AssertionError(kind)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _parse(raw: dict) -> ModelConfig:
    text = copy.deepcopy(_text_section(raw))
    _require(
        "q_lora_rank" not in text or text["q_lora_rank"] is not None,
        "q_lora_rank is null: glm5_next DSA layers need the q LoRA path (the indexer reads it)",
    )
    kw: dict = {}
    for name, kind in _TYPES.items():
        if name in ("layer_types", "mlp_layer_types", "indexer_types", "eos_token_id"):
            continue
        if name in text and text[name] is not None or (name in text and kind == "float | None"):
            kw[name] = _coerce(name, text[name], kind)

    lac = text.get("linear_attn_config")
    if lac is not None:
        _require(isinstance(lac, dict), "linear_attn_config must be an object")
        for src, dst in _LINEAR_KEYS.items():
            if src in lac:
                kw[dst] = _coerce(f"linear_attn_config.{src}", lac[src], _TYPES[dst])
        if lac.get("safe_gate", True) and kw.get("linear_lower_bound", -5.0) is None:
            kw["linear_lower_bound"] = -5.0

    eos = text.get("eos_token_id")
    if eos is not None:
        eos_list = eos if isinstance(eos, list) else [eos]
        kw["eos_token_id"] = tuple(_coerce("eos_token_id", e, "int") for e in eos_list)

    n_layers = kw.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    _require(n_layers >= 1, f"num_hidden_layers must be >= 1, got {n_layers}")
    kw["layer_types"] = _layer_types(text, lac, n_layers)
    kw["mlp_layer_types"] = _mlp_layer_types(text, n_layers)
    kw["indexer_types"] = _indexer_types(text, n_layers)
    cfg = ModelConfig(**kw)
    _validate(cfg, text)
    return cfg


def _schedule(text: dict, key: str, n_layers: int, allowed: tuple[str, ...]) -> list[str] | None:
    values = text.get(key)
    if values is None:
        return None
    _require(isinstance(values, list), f"{key} must be a list with one entry per layer")
    _require(
        len(values) == n_layers,
        f"{key} has {len(values)} entries but num_hidden_layers is {n_layers}: give one per layer",
    )
    for i, v in enumerate(values):
        _require(v in allowed, f"{key}[{i}] = {v!r} is not one of {list(allowed)}")
    return list(values)


def _layer_types(text: dict, lac: dict | None, n_layers: int) -> tuple[str, ...]:
    given = _schedule(text, "layer_types", n_layers, (KDA, *DSA_SPELLINGS))
    kda_list = (lac or {}).get("kda_layers")
    full_list = (lac or {}).get("full_attn_layers")
    for name, lst in (("kda_layers", kda_list), ("full_attn_layers", full_list)):
        if lst is None:
            continue
        _require(
            isinstance(lst, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in lst),
            f"linear_attn_config.{name} must be a list of layer indices",
        )
        _require(
            all(0 <= i < n_layers for i in lst),
            f"linear_attn_config.{name} = {lst} holds indices outside 0..{n_layers - 1}; "
            "GLM lists are 0-based (Kimi's 1-based lists must be shifted down by one)",
        )
    if given is not None:
        types = [DSA if t in DSA_SPELLINGS else KDA for t in given]
    else:
        # transformers' default; it never reads kda_layers, so those must agree with it (below)
        types = [KDA if i % 4 != 3 else DSA for i in range(n_layers)]
    kda = [i for i, t in enumerate(types) if t == KDA]
    dsa = [i for i, t in enumerate(types) if t == DSA]
    if kda_list is not None:
        _require(
            sorted(kda_list) == kda,
            f"linear_attn_config.kda_layers {sorted(kda_list)} disagrees with layer_types "
            f"(KDA at {kda}{'' if given is not None else ', the default when layer_types is absent'}); "
            "give layer_types explicitly and make the two agree",
        )
    if full_list is not None:
        _require(
            sorted(full_list) == dsa,
            f"linear_attn_config.full_attn_layers {sorted(full_list)} disagrees with layer_types "
            f"(DSA at {dsa}); give layer_types explicitly and make the two agree",
        )
    return tuple(types)


def _mlp_layer_types(text: dict, n_layers: int) -> tuple[str, ...]:
    given = _schedule(text, "mlp_layer_types", n_layers, ("dense", "sparse"))
    if given is None:
        given = ["dense"] * min(3, n_layers) + ["sparse"] * max(n_layers - 3, 0)
    fkdr = text.get("first_k_dense_replace")
    freq = text.get("moe_layer_freq", 1)
    if fkdr is not None and "mlp_layer_types" in text and freq == 1:
        _coerce("first_k_dense_replace", fkdr, "int")
        implied = ["dense" if i < fkdr else "sparse" for i in range(n_layers)]
        _require(
            implied == given,
            f"first_k_dense_replace={fkdr} implies {implied} but mlp_layer_types is {given}; "
            "drop first_k_dense_replace or make them agree",
        )
    return tuple(given)


def _indexer_types(text: dict, n_layers: int) -> tuple[str, ...]:
    given = _schedule(text, "indexer_types", n_layers, ("full", "shared"))
    if given is not None:
        return tuple(given)
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            _require(
                set(pattern) <= {"F", "S"},
                f"index_topk_pattern {pattern!r} may only hold 'F' (full) and 'S' (shared)",
            )
            values = [{"F": "full", "S": "shared"}[c] for c in pattern]
        elif isinstance(pattern, list):
            values = pattern
        else:
            raise ConfigError(f"index_topk_pattern must be a string like 'FSFS' or a list, got {pattern!r}")
        _require(
            len(values) == n_layers,
            f"index_topk_pattern has {len(values)} entries but num_hidden_layers is {n_layers}",
        )
        _require(
            all(v in ("full", "shared") for v in values),
            f"index_topk_pattern entries must be full/shared, got {values}",
        )
        return tuple(values)
    freq = max(_coerce("index_topk_freq", text.get("index_topk_freq", 1), "int"), 1)
    offset = _coerce("index_skip_topk_offset", text.get("index_skip_topk_offset", 2), "int")
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers))


def _validate(cfg: ModelConfig, text: dict) -> None:
    positive = (
        "vocab_size", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "v_head_dim", "index_topk", "index_head_dim", "index_n_heads",
        "index_kpool", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
        "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings",
    )
    for key in positive:
        _require(getattr(cfg, key) >= 1, f"{key} must be >= 1, got {getattr(cfg, key)}")
    _require(cfg.rms_norm_eps > 0 and cfg.hc_eps > 0, "rms_norm_eps and hc_eps must be > 0")
    _require(cfg.swiglu_limit > 0, f"swiglu_limit must be > 0, got {cfg.swiglu_limit}")
    _require(cfg.routed_scaling_factor > 0, f"routed_scaling_factor must be > 0, got {cfg.routed_scaling_factor}")
    _require(
        cfg.num_attention_heads == cfg.num_key_value_heads,
        f"num_attention_heads ({cfg.num_attention_heads}) must equal num_key_value_heads "
        f"({cfg.num_key_value_heads}): MLA shares one latent across all heads",
    )
    _require(
        cfg.qk_rope_head_dim == 0,
        f"qk_rope_head_dim is {cfg.qk_rope_head_dim}: glm5_next MLA is NoPE, set it to 0",
    )
    if "mla_use_nope" in text:
        _require(text["mla_use_nope"] is True, "mla_use_nope must be true for glm5_next")
    if "qk_head_dim" in text:
        _require(
            text["qk_head_dim"] == cfg.qk_head_dim,
            f"qk_head_dim {text['qk_head_dim']} != qk_nope_head_dim + qk_rope_head_dim "
            f"({cfg.qk_head_dim}); make them agree",
        )
    _require(
        cfg.index_topk % cfg.index_kpool == 0,
        f"index_topk ({cfg.index_topk}) must be divisible by index_kpool ({cfg.index_kpool})",
    )
    _require(
        text.get("index_kpool_compress", True) is True,
        "index_kpool_compress=false is not supported: only compressed (softmax-pooled) kpool keys "
        "are defined for glm5_next; set it to true",
    )
    _require(
        cfg.index_kpool_always_select_tail,
        "index_kpool_always_select_tail=false is not supported: a query's own incomplete pool "
        "would be unreachable (the first rows attend nothing); set it to true",
    )
    _require(cfg.hidden_act == "silu", f"hidden_act {cfg.hidden_act!r} is not supported: use 'silu'")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if key in text:
            _require(text[key] == want, f"{key} {text[key]!r} is not supported: glm5_next uses {want!r}")
    if "moe_router_dtype" in text:
        _require(text["moe_router_dtype"] == "float32", "moe_router_dtype must be 'float32'")
    if "mhc" in text:
        _require(text["mhc"] is True, "mhc=false is not supported: glm5_next always runs the mHC trunk")
    if cfg.linear_lower_bound is not None:
        _require(cfg.linear_lower_bound < 0, f"gate_lower_bound must be negative, got {cfg.linear_lower_bound}")
    _require(
        cfg.num_nextn_predict_layers in (0, 1),
        f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}: memra supports at most one NextN block",
    )
    if "sparse" in cfg.mlp_layer_types or cfg.has_mtp:
        e, g = cfg.n_routed_experts, cfg.n_group
        _require(e >= 1 and g >= 1 and e % g == 0, f"n_routed_experts ({e}) must be divisible by n_group ({g})")
        _require(e // g >= 2, f"each expert group needs >= 2 experts (n_routed_experts {e}, n_group {g})")
        _require(1 <= cfg.topk_group <= g, f"topk_group ({cfg.topk_group}) must be in 1..n_group ({g})")
        _require(
            1 <= cfg.num_experts_per_tok <= cfg.topk_group * (e // g),
            f"num_experts_per_tok ({cfg.num_experts_per_tok}) must be in 1..{cfg.topk_group * (e // g)} "
            "(the experts in the kept groups)",
        )
        _require(cfg.moe_intermediate_size >= 1, "moe_intermediate_size must be >= 1")
        _require(cfg.n_shared_experts >= 1, f"n_shared_experts must be >= 1, got {cfg.n_shared_experts}")
    if "dense" in cfg.mlp_layer_types:
        _require(cfg.intermediate_size >= 1, "intermediate_size must be >= 1")
    for i, t in enumerate(cfg.layer_types):
        if t == DSA and cfg.indexer_types[i] == "shared":
            cfg.indexer_source(i)  # raises when no full DSA layer precedes it


def read_config_json(path, what: str, missing_error=ConfigError) -> dict:
    """The parsed config.json of a directory (or the file itself); `what` names the directory
    kind in the error ("a checkpoint directory"); a missing or unreadable file raises
    `missing_error`, a malformed one ConfigError."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise missing_error(f"no config.json at {path}: point at {what}") from None
    except OSError as exc:
        raise missing_error(f"cannot read {path} ({exc.strerror}): point at {what}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); re-export the config") from None


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read a checkpoint directory's config.json (or the file itself)."""
    return ModelConfig.from_dict(read_config_json(path, "a checkpoint directory"))


from memra.presets import preset  # noqa: E402, F401  (re-exported: config.preset is public API)
