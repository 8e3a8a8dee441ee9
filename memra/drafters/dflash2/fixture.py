"""A random but well-formed DFlash-family checkpoint for a target config, for tests and examples.

The drafter matches the target (hidden, vocab, valid tap layers) and is deliberately non-trivial:
the convs are not the identity (random base kernels and kernel projections), the optional heads
can be added, and every weight is scaled so activations stay O(1) through the stack.
`family="dflash"` writes the seed's format instead: the DFlash v1 / DSpark backbone (no convs, no
candidate selector, no conv or selector keys in the config) with the heads under the seed's
tensor names (`markov_head.markov_w1.weight`, `confidence_head.proj.weight`, ...).

    dir = write_fixture_drafter(tmp, preset("small"), seed=0)
    dir = write_fixture_drafter(tmp, preset("mini"), rope="yarn", sliding_window=4, strategy="dspark",
                                with_markov=True, with_confidence=True, dtype="float32")
    dir = write_fixture_drafter(tmp, preset("mini"), family="dflash", strategy="dspark", with_markov=True)
"""

from __future__ import annotations

import json
import math
import os
import zlib

import numpy as np

from memra.drafters.dflash2.config import FULL, SLIDING, parse_dflash_config
from memra.drafters.dflash2.weights import DFLASH, DFLASH2, expected_tensors
from memra.errors import InputError
from memra.safetensors_io import write_safetensors

_DEFAULTS = {
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": None, "block_size": 8, "conv_kernel_size": 2, "conv_group_size": 16,
    "selector_rank": 16, "selector_top_k": 8, "target_layer_ids": None, "mask_token_id": None,
    "sliding_window": None, "layer_types": None, "is_causal": False, "rope": "default",
    "with_markov": False, "with_confidence": False, "markov_rank": None, "strategy": "dflash",
    "output_multiplier": None, "final_logit_softcapping": None, "input_embedding_scale": None,
    "rms_norm_eps": 1e-6, "dtype": "bfloat16", "family": DFLASH2,
}
# the seed's spellings of the heads, written by family="dflash" (the loader maps both)
_SEED_NAMES = {"markov_head.w1": "markov_head.markov_w1.weight", "markov_head.w2": "markov_head.markov_w2.weight",
               "confidence_head.weight": "confidence_head.proj.weight",
               "confidence_head.bias": "confidence_head.proj.bias"}
_YARN_FACTOR = 4.0


def _default_taps(n_layers: int) -> list[int]:
    """A few target layers spread over the trunk (first, middle, last)."""
    return sorted({round(x) for x in np.linspace(0, n_layers - 1, min(3, n_layers))})


def _rope(choice, max_positions: int) -> dict:
    if isinstance(choice, dict):
        return dict(choice)
    if choice == "default":
        return {"rope_type": "default", "rope_theta": 10000.0}
    if choice == "yarn":  # factor = max / original, as transformers expects
        return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": _YARN_FACTOR, "beta_fast": 32.0,
                "beta_slow": 1.0, "original_max_position_embeddings": int(max_positions / _YARN_FACTOR)}
    raise InputError(f"fixture rope {choice!r}: give 'default', 'yarn' or a rope_parameters dict")


def drafter_config(target: dict, **shape) -> dict:
    """The config.json dict of a fixture drafter for `target` (shape keys as write_fixture_drafter)."""
    unknown = sorted(set(shape) - set(_DEFAULTS))
    if unknown:
        raise InputError(f"write_fixture_drafter: unknown shape keys {unknown}; known: {sorted(_DEFAULTS)}")
    s = {**_DEFAULTS, **shape}
    hidden, vocab, n = target["hidden_size"], target["vocab_size"], s["num_hidden_layers"]
    max_positions = target.get("max_position_embeddings", 4096)
    if s["strategy"] not in ("dflash", "dspark"):
        raise InputError(f"fixture strategy {s['strategy']!r}: choose 'dflash' or 'dspark'")
    if s["family"] not in (DFLASH2, DFLASH):
        raise InputError(f"fixture family {s['family']!r}: choose {DFLASH2!r} or {DFLASH!r}")
    types = s["layer_types"] or [SLIDING if s["sliding_window"] else FULL] * n
    dflash = {
        "block_size": s["block_size"],
        "mask_token_id": vocab - 1 if s["mask_token_id"] is None else s["mask_token_id"],
        "target_layer_ids": list(s["target_layer_ids"] or _default_taps(target["num_hidden_layers"])),
    }
    if s["family"] == DFLASH2:
        dflash.update(conv_kernel_size=s["conv_kernel_size"], conv_group_size=s["conv_group_size"],
                      selector_rank=s["selector_rank"], selector_top_k=s["selector_top_k"])
    for key in ("output_multiplier", "final_logit_softcapping", "input_embedding_scale"):
        if s[key] is not None:
            dflash[key] = s[key]
    if s["strategy"] == "dspark":
        dflash["projector_type"] = "dspark"
    plain = "DFlash2DraftModel" if s["family"] == DFLASH2 else "DFlashDraftModel"
    raw = {
        "model_type": "qwen3",
        "architectures": ["Qwen3DSparkModel" if s["strategy"] == "dspark" else plain],
        "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": n,
        "intermediate_size": s["intermediate_size"] or 2 * hidden,
        "num_attention_heads": s["num_attention_heads"], "num_key_value_heads": s["num_key_value_heads"],
        "head_dim": s["head_dim"], "rms_norm_eps": s["rms_norm_eps"], "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False,
        "max_position_embeddings": max_positions,
        "rope_parameters": _rope(s["rope"], max_positions), "layer_types": types,
        "sliding_window": s["sliding_window"], "use_sliding_window": bool(s["sliding_window"]),
        "num_target_layers": target["num_hidden_layers"], "dflash_config": dflash,
    }
    if s["is_causal"] is not None:
        raw["is_causal"] = s["is_causal"]
    return raw


def _tensor(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])  # per name: adding one shifts none
    normal = lambda std: rng.normal(0.0, std, shape)  # noqa: E731
    if name.endswith("norm.weight"):
        return 1.0 + rng.uniform(-0.2, 0.2, shape)
    if name.endswith("base_kernel"):
        # tap 0 near 1, earlier taps clearly non-zero: a conv that is not the identity
        arr = normal(0.3)
        arr[:, 0] += 1.0
        return arr
    if name.endswith("kernel_projection.weight"):
        return normal(0.3 / math.sqrt(shape[1]))
    if name.endswith("_codebook"):
        return normal(shape[1] ** -0.25)
    if name == "markov_head.w1":
        return normal(1.0)
    if name == "confidence_head.bias":
        return normal(0.5)
    return normal(1.0 / math.sqrt(shape[1]))


def write_fixture_drafter(dir, target_config_dict: dict, seed: int = 0, **shape) -> str:
    """Write config.json + model.safetensors of a random DFlash2 drafter; returns the directory."""
    raw = drafter_config(target_config_dict, **shape)
    cfg = parse_dflash_config(raw)
    s = {**_DEFAULTS, **shape}
    tensors = {name: _tensor(name, sh, seed) for name, sh in expected_tensors(cfg, s["family"]).items()}
    rank = s["markov_rank"] or s["selector_rank"]
    heads = {}
    if s["with_markov"]:
        heads["markov_head.w1"] = heads["markov_head.w2"] = (cfg.vocab_size, rank)
    if s["with_confidence"]:
        heads["confidence_head.weight"] = (1, cfg.hidden_size + (rank if s["with_markov"] else 0))
        heads["confidence_head.bias"] = (1,)
    for name, sh in heads.items():
        tensors[_SEED_NAMES[name] if s["family"] == DFLASH else name] = _tensor(name, sh, seed)
    dir = os.fspath(dir)
    os.makedirs(dir, exist_ok=True)
    with open(os.path.join(dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    write_safetensors(os.path.join(dir, "model.safetensors"), tensors, dtype=s["dtype"],
                      metadata={"format": "pt"})
    return dir
