"""Per-layer schedules of a glm5_next config: which mixer, which FFN, which indexer mode.

transformers' derivations (layer_types, mlp_layer_types, indexer_types incl. index_topk_pattern
and index_topk_freq / index_skip_topk_offset), with linear_attn_config's 0-based layer lists
checked against them. Every refusal is a ConfigError naming the key.
"""

from __future__ import annotations

import math

from memra.errors import ConfigError

FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max

KDA = "linear_attention"
DSA = "indexed_attention"
# transformers writes the DSA mixer under three names across releases.
DSA_SPELLINGS = ("deepseek_sparse_attention", "full_attention", "indexed_attention")


def coerce(key: str, value, kind: str):
    """Check one scalar against the dataclass field type; return it in canonical form."""
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise ConfigError(f"config key {key!r} must be a finite float32 (|x| <= {FLOAT32_MAX:.4g}: the "
                              f"model computes in float32), got {value!r}")
        return float(value)
    if kind == "float | None":
        return None if value is None else coerce(key, value, "float")
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"config key {key!r} must be a string, got {value!r}")
        return value
    raise AssertionError(kind)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _schedule(text: dict, key: str, n_layers: int, allowed: tuple[str, ...]) -> list[str] | None:
    values = text.get(key)
    if values is None:
        return None
    require(isinstance(values, list), f"{key} must be a list with one entry per layer")
    require(
        len(values) == n_layers,
        f"{key} has {len(values)} entries but num_hidden_layers is {n_layers}: give one per layer",
    )
    for i, v in enumerate(values):
        require(v in allowed, f"{key}[{i}] = {v!r} is not one of {list(allowed)}")
    return list(values)


def layer_types(text: dict, lac: dict | None, n_layers: int) -> tuple[str, ...]:
    given = _schedule(text, "layer_types", n_layers, (KDA, *DSA_SPELLINGS))
    kda_list = (lac or {}).get("kda_layers")
    full_list = (lac or {}).get("full_attn_layers")
    for name, lst in (("kda_layers", kda_list), ("full_attn_layers", full_list)):
        if lst is None:
            continue
        require(
            isinstance(lst, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in lst),
            f"linear_attn_config.{name} must be a list of layer indices",
        )
        require(
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
        require(
            sorted(kda_list) == kda,
            f"linear_attn_config.kda_layers {sorted(kda_list)} disagrees with layer_types "
            f"(KDA at {kda}{'' if given is not None else ', the default when layer_types is absent'}); "
            "give layer_types explicitly and make the two agree",
        )
    if full_list is not None:
        require(
            sorted(full_list) == dsa,
            f"linear_attn_config.full_attn_layers {sorted(full_list)} disagrees with layer_types "
            f"(DSA at {dsa}); give layer_types explicitly and make the two agree",
        )
    return tuple(types)


def mlp_layer_types(text: dict, n_layers: int) -> tuple[str, ...]:
    given = _schedule(text, "mlp_layer_types", n_layers, ("dense", "sparse"))
    if given is None:
        given = ["dense"] * min(3, n_layers) + ["sparse"] * max(n_layers - 3, 0)
    fkdr = text.get("first_k_dense_replace")
    freq = text.get("moe_layer_freq", 1)
    if fkdr is not None and "mlp_layer_types" in text and freq == 1:
        coerce("first_k_dense_replace", fkdr, "int")
        implied = ["dense" if i < fkdr else "sparse" for i in range(n_layers)]
        require(
            implied == given,
            f"first_k_dense_replace={fkdr} implies {implied} but mlp_layer_types is {given}; "
            "drop first_k_dense_replace or make them agree",
        )
    return tuple(given)


def indexer_types(text: dict, n_layers: int) -> tuple[str, ...]:
    given = _schedule(text, "indexer_types", n_layers, ("full", "shared"))
    if given is not None:
        return tuple(given)
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            require(
                set(pattern) <= {"F", "S"},
                f"index_topk_pattern {pattern!r} may only hold 'F' (full) and 'S' (shared)",
            )
            values = [{"F": "full", "S": "shared"}[c] for c in pattern]
        elif isinstance(pattern, list):
            values = pattern
        else:
            raise ConfigError(f"index_topk_pattern must be a string like 'FSFS' or a list, got {pattern!r}")
        require(
            len(values) == n_layers,
            f"index_topk_pattern has {len(values)} entries but num_hidden_layers is {n_layers}",
        )
        require(
            all(v in ("full", "shared") for v in values),
            f"index_topk_pattern entries must be full/shared, got {values}",
        )
        return tuple(values)
    freq = max(coerce("index_topk_freq", text.get("index_topk_freq", 1), "int"), 1)
    offset = coerce("index_skip_topk_offset", text.get("index_skip_topk_offset", 2), "int")
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers))
