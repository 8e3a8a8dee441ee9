"""FP8 checkpoints: which tensors may be FP8, their block scales, and the quantization_config.

The FP8 release of GLM-5-Next stores some matrices as F8_E4M3 with a `<name>_scale_inv` F32
sibling of shape [ceil(out/128), ceil(in/128)] (research/glm5_checkpoint.md, "FP8 release
extras"). Whether a tensor is FP8 is decided by its dtype and that sibling, never by its name;
the name only decides whether FP8 is allowed there: the release quantizes the DSA and MTP
attention projections q_a, q_b, kv_a and o_proj, the dense MLP and the shared and routed experts,
and keeps kv_b_proj, every KDA tensor (o_proj included), the indexer, the router, norms, the
embedding, lm_head and eh_proj in BF16. Everything else FP8-shaped is refused by name: e5m2,
an e4m3 tensor without scales, per-tensor or per-channel scales, a misshaped grid, scales that
are not F32, not finite or not positive, and a quantization_config other than fine-grained fp8
with [128, 128] e4m3 blocks and dynamic activations.

    check_quantization_config(ckpt_dir)          # before any tensor is read, when FP8 is present
    pair_scales(got, dtypes, source, census, cfg)  # F8 arrays + scales -> Fp8Block, in place
"""

from __future__ import annotations

import math
import os
import re

import numpy as np

from memra.backend.fp8 import BLOCK, Fp8Block, scale_grid
from memra.config import KDA, ModelConfig
from memra.errors import CheckpointError
from memra.jsonfile import read_json_object

SCALE_SUFFIX = "_scale_inv"
FP8_KIND = "fp8 format"  # the census kind of every FP8 refusal
_ATTN = re.compile(r"^layers\.(\d+)\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight$")
_MLP = re.compile(r"^layers\.\d+\.mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj\.weight$")
RELEASE_FP8 = ("q_a_proj, q_b_proj, kv_a_proj_with_mqa and o_proj of DSA and MTP layers, the dense MLP, "
               "the shared and routed experts")


def fp8_allowed(name: str, cfg: ModelConfig) -> bool:
    """Whether the release can hold canonical tensor `name` in FP8 (see the module doc)."""
    if _MLP.match(name):
        return True
    attn = _ATTN.match(name)
    if attn is None:
        return False
    layer = int(attn.group(1))
    return layer == cfg.num_hidden_layers or (layer < cfg.num_hidden_layers and cfg.layer_types[layer] != KDA)


def unsupported_fp8_message(raw: str, dtype: str) -> str:
    return (f"{raw} is {dtype} (memra reads FP8 as F8_E4M3 with a {raw}{SCALE_SUFFIX} F32 sibling of "
            f"{BLOCK}x{BLOCK} block scales: re-export with e4m3 block quantization, or in bf16)")


# ---- quantization_config ----------------------------------------------------------------------

def _config_path(path: str) -> str:
    return os.path.join(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)), "config.json")


def quantization_config(path: str) -> dict | None:
    """The checkpoint's quantization_config (top level, or inside text_config), None when absent."""
    raw = read_json_object(_config_path(path), CheckpointError, "fix config.json", absent={})
    for where in (raw, raw.get("text_config")):
        if isinstance(where, dict) and where.get("quantization_config") is not None:
            return where["quantization_config"]
    return None


def check_quantization_config(path: str) -> None:
    """Refuse a quantization_config that is not the release's fine-grained fp8 (absent is fine:
    the tensors and their scale grids say everything)."""
    qc = quantization_config(path)
    if qc is None:
        return
    fix = ("memra reads fine-grained fp8: quant_method 'fp8', fmt 'e4m3', weight_block_size [128, 128], "
           "activation_scheme 'dynamic'; re-export the checkpoint in that format or in bf16")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{_config_path(path)}: quantization_config must be an object; {fix}")
    problems = []
    if qc.get("quant_method") != "fp8":
        problems.append(f"quant_method {qc.get('quant_method')!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        problems.append(f"fmt {qc.get('fmt')!r}")
    if qc.get("weight_block_size", [BLOCK, BLOCK]) != [BLOCK, BLOCK]:  # a list equal to it, nothing else
        problems.append(f"weight_block_size {qc.get('weight_block_size')!r} (per-tensor or per-channel scales)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme {qc.get('activation_scheme')!r}")
    if problems:
        raise CheckpointError(f"{_config_path(path)}: quantization_config has {', '.join(problems)}; {fix}")


# ---- pairing each FP8 tensor with its scales ------------------------------------------------------

def _scale_problem(raw_scale: str, dtype: str, scale, weight_shape) -> str | None:
    grid = scale_grid(weight_shape)
    if dtype != "F32":
        return f"its scales {raw_scale} are {dtype}, memra reads F32 scales"
    shape = tuple(scale.shape)
    if shape != grid:
        n_out = weight_shape[0]
        if math.prod(shape) == 1:
            kind = "a per-tensor scale"
        elif shape in ((n_out,), (n_out, 1)):
            kind = "per-channel scales"
        else:
            kind = "a scale grid"
        return (f"{raw_scale} is {kind} of shape {list(shape)}, memra reads one F32 scale per "
                f"{BLOCK}x{BLOCK} block: shape {list(grid)}")
    bad = int(np.count_nonzero(~(np.isfinite(scale) & (scale > 0))))
    if bad:
        return f"{raw_scale} holds {bad} scales that are not finite and positive"
    return None


def pair_scales(got: dict, dtypes: dict, source: dict, census, cfg: ModelConfig) -> None:
    """Replace every F8_E4M3 entry of `got` (canonical name -> (shape, array)) by an Fp8Block with
    its scales and drop the scale entries; every offender goes to the census as FP8_KIND."""
    for name in [n for n, d in dtypes.items() if d == "F8_E4M3" and not n.endswith(SCALE_SUFFIX)]:
        shape, data = got.pop(name)
        raw, scale_name = source[name], name + SCALE_SUFFIX
        if scale_name not in got:
            census.add(FP8_KIND, f"{raw} is F8_E4M3 without its {raw}{SCALE_SUFFIX} sibling "
                                 f"(one F32 scale per {BLOCK}x{BLOCK} block): re-export it with its scales")
            got[name] = (shape, None)
            continue
        _, scale = got.pop(scale_name)
        if not fp8_allowed(name, cfg):
            census.add(FP8_KIND, f"{raw} is F8_E4M3, but the release keeps this tensor in BF16 "
                                 f"(FP8 only for {RELEASE_FP8})")
        elif len(shape) != 2:
            census.add(FP8_KIND, f"{raw} is F8_E4M3 of shape {list(shape)}: memra reads FP8 matrices "
                                 "[out, in] under their on-disk names (not fused live tensors)")
        elif (problem := _scale_problem(source[scale_name], dtypes[scale_name], scale, shape)) is not None:
            census.add(FP8_KIND, f"{raw} is F8_E4M3, but {problem}")
        elif data is not None:
            got[name] = (shape, Fp8Block(data, scale))
            continue
        got[name] = (shape, None)
    for name in [n for n in got if n.endswith(SCALE_SUFFIX)]:
        base = name[:-len(SCALE_SUFFIX)]
        if base in dtypes:
            got.pop(name)
            census.add(FP8_KIND, f"{source[name]} scales {source[base]}, which is {dtypes[base]}, not F8_E4M3 "
                                 "(drop the scales, or store the tensor as F8_E4M3)")
