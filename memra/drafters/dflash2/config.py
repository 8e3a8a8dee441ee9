"""DflashConfig: a validated DFlash2 drafter config read from its `config.json`.

The DFlash keys (block_size, mask_token_id, target_layer_ids, conv/selector widths, logit
transforms) are read from the nested `dflash_config` first and from the top level as a fallback,
as the reference loaders do. RoPE comes from the nested `rope_parameters` (rope_theta inside);
the legacy top-level `rope_theta` / `rope_scaling` spelling is accepted too. Anything missing,
inconsistent or unsupported is refused with a `ConfigError` naming the key and the fix.

Block-attention causality: an explicit `is_causal` applies to every layer. When the key is absent
the reference loops make each `sliding_attention` layer causal and each full layer bidirectional;
we do the same (so a checkpoint runs as it was served) and warn, because trained DFlash drafters
expect a bidirectional block and a config missing the key is usually an export slip.

    cfg = load_dflash_config("path/to/drafter")       # a directory or its config.json
    cfg.block_size, cfg.target_layer_ids, cfg.rope.mscale, cfg.strategy_dspark
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from memra.config import read_config_json
from memra.drafters.dflash2.rope import yarn_attention_factor
from memra.errors import CheckpointError, ConfigError

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"                    # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True                    # floor/ceil the YaRN correction range (HF default)
    mscale: float = 1.0                      # the attention scaling applied to cos and sin


@dataclass(frozen=True)
class DflashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float
    final_logit_softcapping: float | None
    input_embedding_scale: float
    rope: RopeConfig
    layer_sliding: tuple[bool, ...]
    sliding_window: int | None               # None when no layer slides
    is_causal: bool                          # True when any layer's block attention is causal
    layer_causal: tuple[bool, ...]           # the per-layer causality the forward uses
    strategy_dspark: bool
    raw: dict = field(compare=False, repr=False)


def dspark_strategy_census(raw: dict) -> bool:
    """True iff the export declares the DSpark training strategy: `architectures` naming a
    DSpark class, or `projector_type == "dspark"` (in dflash_config, else top level)."""
    if not isinstance(raw, dict):
        return False
    arch = raw.get("architectures")
    names = arch if isinstance(arch, list) else [arch]
    by_arch = any(isinstance(a, str) and "DSpark" in a for a in names)
    return by_arch or _draft_value(raw, "projector_type") == "dspark"


def _draft_value(raw: dict, key: str, default=None):
    nested = raw.get("dflash_config")
    if isinstance(nested, dict) and key in nested:
        return nested[key]
    return raw.get(key, default)


def _int(key: str, value, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"dflash2 config key {key!r} must be an integer, got {value!r}")
    if value < lo:
        raise ConfigError(f"dflash2 config key {key!r} must be >= {lo}, got {value}")
    return value


def _float(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"dflash2 config key {key!r} must be a finite number, got {value!r}")
    return float(value)


def _required(raw: dict, key: str):
    if raw.get(key) is None:
        raise ConfigError(f"dflash2 config has no {key!r}: re-export the drafter's config.json")
    return raw[key]


def _rope(raw: dict, head_dim: int) -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is None:
        params = raw.get("rope_scaling")  # the legacy spelling
    params = dict(params or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError("dflash2 config: per-layer-type rope_parameters are not supported; "
                          "give one rope_parameters object for every layer")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError("dflash2 config has no rope_theta (in rope_parameters or at the top level)")
    theta = _float("rope_theta", theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"dflash2 config: rope_type {kind!r} is not supported: choose one of {list(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("dflash2 config: partial_rotary_factor != 1 is not supported (the drafter "
                          "ropes the whole head)")
    if head_dim % 2:
        raise ConfigError(f"dflash2 config: head_dim {head_dim} must be even for RoPE")
    if kind == "default":
        return RopeConfig(theta=theta)
    # YaRN, with transformers' precedence: a top-level original_max_position_embeddings wins,
    # then the rope_parameters one, then max_position_embeddings; a null factor is the ratio.
    orig = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or raw.get("max_position_embeddings")
    if orig is None:
        raise ConfigError("dflash2 config: yarn rope needs original_max_position_embeddings "
                          "(or max_position_embeddings)")
    orig = _int("original_max_position_embeddings", orig)
    factor = params.get("factor")
    if factor is None:
        factor = _int("max_position_embeddings", _required(raw, "max_position_embeddings")) / orig
    factor = _float("rope_parameters.factor", factor)
    if factor <= 0:
        raise ConfigError(f"dflash2 config: yarn factor must be > 0, got {factor}")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = yarn_attention_factor(factor, params.get("mscale"), params.get("mscale_all_dim"))
    return RopeConfig(
        theta=theta, type="yarn", factor=factor, original_max_position_embeddings=orig,
        beta_fast=_float("beta_fast", params.get("beta_fast") or 32.0),
        beta_slow=_float("beta_slow", params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        mscale=_float("attention_factor", attention_factor),
    )


def _layer_sliding(raw: dict, n_layers: int) -> tuple[bool, ...]:
    types = raw.get("layer_types")
    if types is None:
        # Qwen3's derivation: layers from max_window_layers on slide when use_sliding_window is set.
        use = bool(raw.get("use_sliding_window", False)) and raw.get("sliding_window") is not None
        first = raw.get("max_window_layers", 28)
        return tuple(use and i >= first for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConfigError(f"dflash2 config: layer_types must list {n_layers} entries (num_hidden_layers), "
                          f"got {types!r:.120}")
    bad = [t for t in types if t not in (SLIDING, FULL)]
    if bad:
        raise ConfigError(f"dflash2 config: layer_types entries must be {SLIDING!r} or {FULL!r}, got {bad[0]!r}")
    return tuple(t == SLIDING for t in types)


def _causality(raw: dict, layer_sliding: tuple[bool, ...]) -> tuple[bool, ...]:
    explicit = _draft_value(raw, "is_causal")
    if explicit is not None:
        if not isinstance(explicit, bool):
            raise ConfigError(f"dflash2 config key 'is_causal' must be true or false, got {explicit!r}")
        return tuple(explicit for _ in layer_sliding)
    if any(layer_sliding):
        warnings.warn("dflash2 config has no 'is_causal': following the reference loops, its "
                      "sliding_attention layers attend causally inside the block; set is_causal "
                      "explicitly (false for trained DFlash drafters) to silence this", stacklevel=3)
    return layer_sliding


def parse_dflash_config(raw: dict) -> DflashConfig:
    """Validate a parsed config.json dict into a DflashConfig."""
    if not isinstance(raw, dict):
        raise ConfigError(f"dflash2 config must be a JSON object, got {type(raw).__name__}")
    hidden = _int("hidden_size", _required(raw, "hidden_size"))
    heads = _int("num_attention_heads", _required(raw, "num_attention_heads"))
    kv_heads = _int("num_key_value_heads", raw.get("num_key_value_heads", heads))
    head_dim = _int("head_dim", _required(raw, "head_dim"))
    n_layers = _int("num_hidden_layers", _required(raw, "num_hidden_layers"))
    vocab = _int("vocab_size", _required(raw, "vocab_size"))
    if heads % kv_heads:
        raise ConfigError(f"dflash2 config: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv_heads}")
    block = _int("block_size", _draft_value(raw, "block_size", 16), lo=2)
    mask = _draft_value(raw, "mask_token_id")
    if mask is None:
        raise ConfigError("dflash2 config has no mask_token_id (dflash_config.mask_token_id)")
    mask = _int("mask_token_id", mask, lo=0)
    if mask >= vocab:
        raise ConfigError(f"dflash2 config: mask_token_id {mask} is outside the vocab 0..{vocab - 1}")
    taps = _draft_value(raw, "target_layer_ids")
    if not isinstance(taps, list) or not taps:
        raise ConfigError("dflash2 config: target_layer_ids must be a non-empty list of target layer indices")
    taps = tuple(_int("target_layer_ids", t, lo=0) for t in taps)
    group = _int("conv_group_size", _draft_value(raw, "conv_group_size", 16))
    if hidden % group:
        raise ConfigError(f"dflash2 config: conv_group_size {group} does not divide hidden_size {hidden}")
    top_k = _int("selector_top_k", _draft_value(raw, "selector_top_k", 16))
    if top_k > vocab:
        raise ConfigError(f"dflash2 config: selector_top_k {top_k} exceeds the vocab size {vocab}")
    cap = _draft_value(raw, "final_logit_softcapping")
    cap = None if cap is None else _float("final_logit_softcapping", cap)
    if cap is not None and cap <= 0:
        raise ConfigError(f"dflash2 config: final_logit_softcapping must be > 0 (or null), got {cap}")
    sliding = _layer_sliding(raw, n_layers)
    window = None
    if any(sliding):
        window = _int("sliding_window", _required(raw, "sliding_window"))
    causal = _causality(raw, sliding)
    return DflashConfig(
        hidden_size=hidden,
        intermediate_size=_int("intermediate_size", _required(raw, "intermediate_size")),
        num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=_float("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
        vocab_size=vocab, block_size=block, mask_token_id=mask, target_layer_ids=taps,
        conv_kernel_size=_int("conv_kernel_size", _draft_value(raw, "conv_kernel_size", 2)),
        conv_group_size=group,
        selector_rank=_int("selector_rank", _draft_value(raw, "selector_rank", 256)),
        selector_top_k=top_k,
        output_multiplier=_float("output_multiplier", _draft_value(raw, "output_multiplier", 1.0)),
        final_logit_softcapping=cap,
        input_embedding_scale=_float("input_embedding_scale", _draft_value(raw, "input_embedding_scale", 1.0)),
        rope=_rope(raw, head_dim), layer_sliding=sliding, sliding_window=window,
        is_causal=any(causal), layer_causal=causal,
        strategy_dspark=dspark_strategy_census(raw), raw=raw,
    )


def load_dflash_config(path) -> DflashConfig:
    """Read a drafter directory's config.json (or the file itself)."""
    return parse_dflash_config(read_config_json(path, "a DFlash2 drafter directory", CheckpointError))
