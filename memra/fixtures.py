"""The deterministic fixture checkpoint: random weights of the contract's shapes, one seed.

Every test and benchmark model is written here (or built in memory from `fixture_tensor`):
values are drawn per tensor name, so adding a tensor shifts none of the others, and each
constant-initialised HF parameter is randomised so a test cannot pass on a missing load.

    write_fixture(tmp_dir, preset("small"), seed=0)     # config.json + model.safetensors
"""

from __future__ import annotations

import json
import math
import os
import zlib

import numpy as np

from memra.config import ModelConfig
from memra.safetensors_io import write_safetensors

_LOGIT_STD = 2.5  # target spread of fixture logits over the vocab


def fixture_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> np.ndarray:
    """One deterministic random float32 tensor of the fixture checkpoint (write_fixture writes them;
    the benchmarks build them in memory); every constant-initialised HF parameter is randomised."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])  # per-name: adding a tensor shifts none
    d, n = cfg.hidden_size, cfg.hc_mult
    leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]
    normal = lambda std: rng.normal(0.0, std, shape)  # noqa: E731
    uniform = lambda lo, hi: rng.uniform(lo, hi, shape)  # noqa: E731
    if name == "embed_tokens.weight":
        # Tied: the embedding is also the head, so scale it to give logits of std ~_LOGIT_STD.
        arr = normal(_LOGIT_STD / math.sqrt(d) if cfg.tie_word_embeddings else 1.0)
    elif name == "lm_head.weight":
        arr = normal(_LOGIT_STD / math.sqrt(d))
    elif name.endswith("norm.weight"):
        arr = 1.0 + uniform(-0.3, 0.3)
    elif name.endswith("k_norm.bias"):
        arr = normal(0.2)
    elif leaf == "A_log":
        arr = uniform(0.0, math.log(16.0))
    elif leaf == "dt_bias":
        arr = normal(0.5)
    elif leaf.endswith("_base") and leaf.startswith("hc_"):
        arr = normal(0.5)
    elif leaf.endswith("_scale") and leaf.startswith("hc_"):
        arr = uniform(0.5, 1.5)
    elif leaf.endswith("_fn") and leaf.startswith("hc_"):
        arr = normal(0.5 / math.sqrt(n * d))
    elif leaf == "index_kpool_compress_ape":
        arr = normal(0.5)
    elif leaf == "index_kpool_compress_gate":
        arr = normal(1.0 / math.sqrt(d))
    elif leaf == "e_score_correction_bias":
        arr = uniform(-0.1, 0.1)
    elif leaf.endswith("conv1d"):
        arr = normal(0.5)
    elif len(shape) == 2:
        arr = normal(1.0 / math.sqrt(shape[1]))
    else:
        raise AssertionError(f"no fixture distribution for {name}")
    return arr.astype(np.float32)


def write_fixture(dir, config_dict: dict, seed: int = 0, dtype: str = "float32") -> str:
    """Write config.json + model.safetensors (names under `model.`) for a random `config_dict` model."""
    from memra.checkpoint import SINGLE_FILE, expected_tensors  # checkpoint re-exports this module

    cfg = ModelConfig.from_dict(config_dict)
    dir = os.fspath(dir)
    os.makedirs(dir, exist_ok=True)
    # transformers defaults pad_token_id to the real vocab's 154820, which a tiny vocab cannot
    # embed; memra ignores the key, so a missing one is pinned to 0 to keep fixtures HF-loadable.
    on_disk = {**config_dict, "pad_token_id": config_dict.get("pad_token_id", 0)}
    with open(os.path.join(dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(on_disk, f, indent=2)
    tensors = {}
    for name, shape in expected_tensors(cfg).items():
        disk = name if name == "lm_head.weight" else "model." + name
        tensors[disk] = fixture_tensor(name, shape, cfg, seed)
    write_safetensors(os.path.join(dir, SINGLE_FILE), tensors, dtype=dtype, metadata={"format": "pt"})
    return dir
