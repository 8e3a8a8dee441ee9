"""Write a DemoTarget as a memra / HF checkpoint directory:

    export_target(model, out_dir)                     # config.json, model.safetensors (BF16),
                                                      # generation_config.json
    export_target(model, out_dir, dtype="float32")    # what the parity test compares exactly

Tensors go under the on-disk names both memra and transformers read (memra/checkpoint.py
`expected_tensors`, with the `model.` prefix, plus `lm_head.weight`), not transformers' live
names: the fused KDA `conv1d` splits into q/k/v_conv1d, `forget_gate.*` loses its prefix, mHC
`attn_hc.fn` becomes `hc_attn_fn`, the fused expert tensors split per expert (gate rows first),
and the MTP block lands at `model.layers.{num_hidden_layers}.*`. The written set is checked
against memra's contract before anything is written.
"""

from __future__ import annotations

import json
import os
import re

import torch

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _disk_names(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One live tensor (bare, `layers.N.` rooted) -> its on-disk tensors."""
    layer = re.match(r"^(layers\.\d+\.)", name)
    if name.endswith("self_attn.conv1d.weight"):  # [3C, 1, K]: q, k, v row blocks
        q, k, v = t.chunk(3, dim=0)
        return {name.replace("conv1d", f"{p}_conv1d"): x for p, x in zip("qkv", (q, k, v))}
    if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, D]: gate rows, then up rows
        base = name[: -len("gate_up_proj")]
        out = {}
        for e in range(t.shape[0]):
            gate, up = t[e].chunk(2, dim=0)
            out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        return out
    if name.endswith("mlp.experts.down_proj"):  # [E, D, I]
        base = name[: -len("down_proj")]
        return {f"{base}{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    name = name.replace("self_attn.forget_gate.", "self_attn.")
    m = re.match(r"^(layers\.\d+\.)(attn|ffn)_hc\.(fn|base|scale)$", name)
    if m:
        name = f"{m.group(1)}hc_{m.group(2)}_{m.group(3)}"
    assert layer is None or name.startswith(layer.group(1))
    return {name: t}


def export_tensors(model) -> dict[str, torch.Tensor]:
    """On-disk name -> float32 tensor for every weight memra reads (trunk, lm_head, MTP)."""
    out: dict[str, torch.Tensor] = {}
    n = model.num_layers
    for name, t in model.trunk.state_dict().items():
        for k, v in _disk_names(name, t).items():
            out["model." + k] = v
    out["lm_head.weight"] = model.lm_head.weight
    for name, t in model.mtp.state_dict().items():
        for k, v in _disk_names(f"layers.{n}.{name}", t).items():
            out["model." + k] = v
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in out.items()}


def _check_contract(cfg_dict: dict, names) -> None:
    from memra.checkpoint import expected_tensors
    from memra.config import ModelConfig

    want = {"lm_head.weight" if k == "lm_head.weight" else "model." + k
            for k in expected_tensors(ModelConfig.from_dict(cfg_dict))}
    missing, extra = sorted(want - set(names)), sorted(set(names) - want)
    if missing or extra:
        raise ValueError(f"export breaks memra's tensor contract: missing {missing[:8]}, unexpected {extra[:8]}")


def export_target(model, out_dir: str, dtype: str = "bfloat16") -> str:
    """config.json + model.safetensors (`dtype`) + generation_config.json in out_dir."""
    from safetensors.torch import save_file

    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(_TORCH_DTYPES)}")
    cfg = dict(model.cfg_dict, num_nextn_predict_layers=1)
    tensors = export_tensors(model)
    _check_contract(cfg, tensors)
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.to(_TORCH_DTYPES[dtype]) for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**cfg, "torch_dtype": dtype}, f, indent=2)
    gen = {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg.get("pad_token_id"),
           "do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=2)
    return out_dir
