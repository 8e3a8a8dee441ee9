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
import os
from dataclasses import dataclass, fields

import numpy as np

from memra.errors import ConfigError, InputError
from memra.jsonfile import read_json_object
from memra.schedules import DSA, KDA, coerce, indexer_types, layer_types, mlp_layer_types, require


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
MAX_LAYERS = 1024     # 16x the deepest public MoE; the schedules are enumerated per layer
MAX_SIZE = 2**31 - 1  # every declared size: the kernels index rows, columns and positions with int32
MAX_SINKHORN_ITERS = 1000  # 50x the release's 20: every mHC site of every step runs them in turn
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


def _parse(raw: dict) -> ModelConfig:
    text = copy.deepcopy(_text_section(raw))
    require(
        "q_lora_rank" not in text or text["q_lora_rank"] is not None,
        "q_lora_rank is null: glm5_next DSA layers need the q LoRA path (the indexer reads it)",
    )
    kw: dict = {}
    for name, kind in _TYPES.items():
        if name in ("layer_types", "mlp_layer_types", "indexer_types", "eos_token_id"):
            continue
        if name in text and text[name] is not None or (name in text and kind == "float | None"):
            kw[name] = coerce(name, text[name], kind)

    lac = text.get("linear_attn_config")
    if lac is not None:
        require(isinstance(lac, dict), "linear_attn_config must be an object")
        for src, dst in _LINEAR_KEYS.items():
            if src in lac:
                kw[dst] = coerce(f"linear_attn_config.{src}", lac[src], _TYPES[dst])
        if lac.get("safe_gate", True) and kw.get("linear_lower_bound", -5.0) is None:
            kw["linear_lower_bound"] = -5.0

    eos = text.get("eos_token_id")
    if eos is not None:
        eos_list = eos if isinstance(eos, list) else [eos]
        kw["eos_token_id"] = tuple(coerce("eos_token_id", e, "int") for e in eos_list)

    _check_declared_sizes(kw)
    n_layers = kw.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    require(n_layers >= 1, f"num_hidden_layers must be >= 1, got {n_layers}")
    kw["layer_types"] = layer_types(text, lac, n_layers)
    kw["mlp_layer_types"] = mlp_layer_types(text, n_layers)
    kw["indexer_types"] = indexer_types(text, n_layers)
    cfg = ModelConfig(**kw)
    _validate(cfg, text)
    return cfg


def _check_declared_sizes(kw: dict) -> None:
    """Before anything is enumerated per layer: every integer size inside int32, the layer count
    inside MAX_LAYERS (the checkpoint files bound the rest, see memra.checkpoint)."""
    for name, value in kw.items():
        if _TYPES[name] == "int":
            require(value <= MAX_SIZE, f"{name} {value} is past {MAX_SIZE} (the kernels index with int32): "
                    "fix config.json")
    n_layers = kw.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    require(n_layers <= MAX_LAYERS, f"num_hidden_layers {n_layers} is past the bound of {MAX_LAYERS} layers: "
            "fix config.json")


def _validate(cfg: ModelConfig, text: dict) -> None:
    positive = (
        "vocab_size", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "v_head_dim", "index_topk", "index_head_dim", "index_n_heads",
        "index_kpool", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
        "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings",
    )
    for key in positive:
        require(getattr(cfg, key) >= 1, f"{key} must be >= 1, got {getattr(cfg, key)}")
    require(cfg.hc_sinkhorn_iters <= MAX_SINKHORN_ITERS, f"hc_sinkhorn_iters {cfg.hc_sinkhorn_iters} is past "
            f"the bound of {MAX_SINKHORN_ITERS} (the release uses 20): fix config.json")
    require(np.float32(cfg.rms_norm_eps) > 0 and np.float32(cfg.hc_eps) > 0,
            f"rms_norm_eps ({cfg.rms_norm_eps}) and hc_eps ({cfg.hc_eps}) must be > 0 in float32")
    require(cfg.swiglu_limit > 0, f"swiglu_limit must be > 0, got {cfg.swiglu_limit}")
    require(cfg.routed_scaling_factor > 0, f"routed_scaling_factor must be > 0, got {cfg.routed_scaling_factor}")
    require(
        cfg.num_attention_heads == cfg.num_key_value_heads,
        f"num_attention_heads ({cfg.num_attention_heads}) must equal num_key_value_heads "
        f"({cfg.num_key_value_heads}): MLA shares one latent across all heads",
    )
    require(
        cfg.qk_rope_head_dim == 0,
        f"qk_rope_head_dim is {cfg.qk_rope_head_dim}: glm5_next MLA is NoPE, set it to 0",
    )
    if "mla_use_nope" in text:
        require(text["mla_use_nope"] is True, "mla_use_nope must be true for glm5_next")
    if "qk_head_dim" in text:
        require(
            text["qk_head_dim"] == cfg.qk_head_dim,
            f"qk_head_dim {text['qk_head_dim']} != qk_nope_head_dim + qk_rope_head_dim "
            f"({cfg.qk_head_dim}); make them agree",
        )
    require(
        cfg.index_topk % cfg.index_kpool == 0,
        f"index_topk ({cfg.index_topk}) must be divisible by index_kpool ({cfg.index_kpool})",
    )
    require(
        text.get("index_kpool_compress", True) is True,
        "index_kpool_compress=false is not supported: only compressed (softmax-pooled) kpool keys "
        "are defined for glm5_next; set it to true",
    )
    require(
        cfg.index_kpool_always_select_tail,
        "index_kpool_always_select_tail=false is not supported: a query's own incomplete pool "
        "would be unreachable (the first rows attend nothing); set it to true",
    )
    require(cfg.hidden_act == "silu", f"hidden_act {cfg.hidden_act!r} is not supported: use 'silu'")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if key in text:
            require(text[key] == want, f"{key} {text[key]!r} is not supported: glm5_next uses {want!r}")
    if "moe_router_dtype" in text:
        require(text["moe_router_dtype"] == "float32", "moe_router_dtype must be 'float32'")
    if "mhc" in text:
        require(text["mhc"] is True, "mhc=false is not supported: glm5_next always runs the mHC trunk")
    if cfg.linear_lower_bound is not None:
        require(cfg.linear_lower_bound < 0, f"gate_lower_bound must be negative, got {cfg.linear_lower_bound}")
    require(
        cfg.num_nextn_predict_layers in (0, 1),
        f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}: memra supports at most one NextN block",
    )
    if "sparse" in cfg.mlp_layer_types or cfg.has_mtp:
        e, g = cfg.n_routed_experts, cfg.n_group
        require(e >= 1 and g >= 1 and e % g == 0, f"n_routed_experts ({e}) must be divisible by n_group ({g})")
        require(e // g >= 2, f"each expert group needs >= 2 experts (n_routed_experts {e}, n_group {g})")
        require(1 <= cfg.topk_group <= g, f"topk_group ({cfg.topk_group}) must be in 1..n_group ({g})")
        require(
            1 <= cfg.num_experts_per_tok <= cfg.topk_group * (e // g),
            f"num_experts_per_tok ({cfg.num_experts_per_tok}) must be in 1..{cfg.topk_group * (e // g)} "
            "(the experts in the kept groups)",
        )
        require(cfg.moe_intermediate_size >= 1, "moe_intermediate_size must be >= 1")
        require(cfg.n_shared_experts >= 1, f"n_shared_experts must be >= 1, got {cfg.n_shared_experts}")
    if "dense" in cfg.mlp_layer_types:
        require(cfg.intermediate_size >= 1, "intermediate_size must be >= 1")
    full_seen = False  # one pass: a shared DSA layer needs a full one before it
    for i, t in enumerate(cfg.layer_types):
        if t == DSA and cfg.indexer_types[i] == "shared" and not full_seen:
            cfg.indexer_source(i)  # raises, naming the layer
        full_seen |= t == DSA and cfg.indexer_types[i] == "full"


def read_config_json(path, what: str, missing_error=ConfigError) -> dict:
    """The parsed config.json of a directory (or the file itself); `what` names the directory
    kind in the error ("a checkpoint directory"); a missing or unreadable file raises
    `missing_error`, a malformed one (see memra.jsonfile) ConfigError."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"the path must be a str or os.PathLike, got {type(path).__name__} {path!r:.40}: "
                         f"point at {what}")
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.lexists(path):
        raise missing_error(f"no config.json at {path}: point at {what}")
    return read_json_object(path, ConfigError, "re-export the config", io_error=missing_error)


def read_optional_json(path: str) -> dict:
    """A JSON object file a checkpoint may hold (generation_config.json, tokenizer_config.json):
    {} when it is absent; ConfigError naming the file when it is unreadable or not an object."""
    return read_json_object(path, ConfigError, "fix or delete it", absent={})


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read a checkpoint directory's config.json (or the file itself)."""
    return ModelConfig.from_dict(read_config_json(path, "a checkpoint directory"))


from memra.presets import preset  # noqa: E402, F401  (re-exported: config.preset is public API)
