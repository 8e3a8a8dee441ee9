"""The deterministic fixture checkpoint: random weights of the contract's shapes, one seed.

Every test and benchmark model is written here (or built in memory from `fixture_tensor`):
values are drawn per tensor name, so adding a tensor shifts none of the others, and each
constant-initialised HF parameter is randomised so a test cannot pass on a missing load.

    write_fixture(tmp_dir, preset("small"), seed=0)     # config.json + model.safetensors
    write_fixture(tmp_dir, preset("small"), dtype="fp8")  # the FP8 release's split, with scales

dtype "fp8" writes what the bf16 fixture of the same seed holds, with the release's FP8 matrices
(memra/checkpoint_fp8.py) block-quantized from those bf16 values (scale_inv = amax / 448 per
128 x 128 block), the release's F32 tensors as F32 and a fine-grained fp8 quantization_config.
`fp8_fixture_twin` gives the float32 weights that checkpoint dequantizes to, for peer tests.
"""

from __future__ import annotations

import json
import math
import os
import zlib

import numpy as np

from memra.backend.fp8 import BLOCK, dequantize, quantize
from memra.config import ModelConfig
from memra.safetensors_io import bf16_to_f32, f32_to_bf16, write_raw_safetensors, write_safetensors

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


# Tensors the release stores in F32 (research/glm5_checkpoint.md section 2); the rest is BF16 or FP8.
_RELEASE_F32 = ("hc_attn_base", "hc_ffn_base", "hc_attn_scale", "hc_ffn_scale", "A_log", "dt_bias",
                "e_score_correction_bias")


def _disk_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def write_fixture(dir, config_dict: dict, seed: int = 0, dtype: str = "float32") -> str:
    """Write config.json + model.safetensors (names under `model.`) for a random `config_dict` model;
    dtype "float32", "bfloat16" or "fp8" (see the module doc)."""
    from memra.checkpoint import SINGLE_FILE  # checkpoint re-exports this module
    from memra.tensor_contract import expected_tensors

    cfg = ModelConfig.from_dict(config_dict)
    dir = os.fspath(dir)
    os.makedirs(dir, exist_ok=True)
    # transformers defaults pad_token_id to the real vocab's 154820, which a tiny vocab cannot
    # embed; memra ignores the key, so a missing one is pinned to 0 to keep fixtures HF-loadable.
    on_disk = {**config_dict, "pad_token_id": config_dict.get("pad_token_id", 0)}
    tensors = {}
    for name, shape in expected_tensors(cfg).items():
        tensors[name] = fixture_tensor(name, shape, cfg, seed)
    path = os.path.join(dir, SINGLE_FILE)
    if dtype == "fp8":
        on_disk["quantization_config"] = _write_fp8(path, tensors, cfg)
    else:
        write_safetensors(path, {_disk_name(n): t for n, t in tensors.items()}, dtype=dtype,
                          metadata={"format": "pt"})
    with open(os.path.join(dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(on_disk, f, indent=2)
    return dir


def _fp8_split(tensors: dict, cfg: ModelConfig) -> dict:
    """Canonical name -> "fp8" | "F32" | "BF16": how the release stores each tensor."""
    from memra.checkpoint_fp8 import fp8_allowed

    def kind(name):
        if fp8_allowed(name, cfg):
            return "fp8"
        return "F32" if name.rsplit(".", 1)[-1] in _RELEASE_F32 else "BF16"
    return {name: kind(name) for name in tensors}


def _bf16_values(arr: np.ndarray) -> np.ndarray:
    return bf16_to_f32(f32_to_bf16(arr))  # what the bf16 fixture of the same seed holds


def _write_fp8(path: str, tensors: dict, cfg: ModelConfig) -> dict:
    entries, bf16_modules = {}, []
    for name, kind in _fp8_split(tensors, cfg).items():
        disk, values = _disk_name(name), _bf16_values(tensors[name])
        if kind == "fp8":
            block = quantize(values)
            entries[disk] = ("F8_E4M3", block.shape, block.data.tobytes())
            entries[disk + "_scale_inv"] = ("F32", block.scale_inv.shape, block.scale_inv.astype("<f4").tobytes())
        elif kind == "F32":
            entries[disk] = ("F32", values.shape, values.astype("<f4").tobytes())
        else:
            entries[disk] = ("BF16", values.shape, f32_to_bf16(values).astype("<u2").tobytes())
            if values.ndim == 2 and disk.endswith(".weight"):
                bf16_modules.append(disk[:-len(".weight")])
    write_raw_safetensors(path, entries, metadata={"format": "pt"})
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": sorted(bf16_modules)}


def fp8_fixture_twin(config_dict: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Canonical name -> float32 weights that write_fixture(..., dtype="fp8") dequantizes to:
    each FP8 matrix as e4m3 * scale_inv, every other tensor the bf16 fixture's value."""
    from memra.tensor_contract import expected_tensors

    cfg = ModelConfig.from_dict(config_dict)
    tensors = {name: fixture_tensor(name, shape, cfg, seed) for name, shape in expected_tensors(cfg).items()}
    split = _fp8_split(tensors, cfg)
    return {name: dequantize(quantize(_bf16_values(t))) if split[name] == "fp8" else _bf16_values(t)
            for name, t in tensors.items()}
