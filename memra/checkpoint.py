"""The glm5_next tensor contract: what a checkpoint must hold, and loading it.

A checkpoint arrives under several spellings (the release's `model.language_model.` prefix, a flat
`model.` or bare text-model export, transformers' live fused tensors) and in F32, BF16 or F16, or
as the FP8 release (F8_E4M3 matrices with 128x128 block scales: memra/checkpoint_fp8.py). This
module maps all of them to one set of canonical bare names (research/glm5_checkpoint.md section 1),
checks the result against `expected_tensors(cfg)` (memra/tensor_contract.py) and refuses with ONE `CheckpointError` that names
every missing, unexpected, misshaped, unsupported or non-finite (NaN/inf) tensor, so a broken
export is fixed in one pass. Before any tensor is read, the config's declared sizes are checked
against the headers (a tensor count the files cannot hold) and the memory plan (memra/memory.py).

    cfg = load_config(ckpt_dir)
    weights = load_checkpoint(ckpt_dir, cfg)          # canonical name -> float32 array
    write_fixture(tmp_dir, preset("small"), seed=0)   # a deterministic random checkpoint
"""

from __future__ import annotations

import os
import re

import numpy as np

from memra.config import ModelConfig
from memra.errors import CheckpointError, InputError
from memra.jsonfile import read_json_object
from memra.memory import check_weights_fit, weight_bytes
from memra.checkpoint_fp8 import FP8_KIND, check_quantization_config, pair_scales, unsupported_fp8_message
from memra.tensor_contract import expected_count, expected_tensors
from memra.safetensors_io import (
    READABLE_DTYPES, SUPPORTED_DTYPES, all_finite, bf16_to_f32, nonfinite_count, read_header, read_tensors,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PREFIXES = ("model.language_model.", "model.")
_COUNT_SLACK = 64      # tensors past 2x the files' count before a config is refused unenumerated
_LISTED_PER_LINE = 6  # offenders a one-line refusal names; the rest are counted (all in .details)


# ---- name normalisation -----------------------------------------------------------------------

def _canonical_name(raw: str, cfg: ModelConfig) -> str | None:
    """Strip the prefix; None for tensors memra deliberately ignores."""
    if raw.startswith("model.visual."):
        return None
    name = raw
    for prefix in _PREFIXES:
        if raw.startswith(prefix):
            name = raw[len(prefix):]
            break
    mtp = f"layers.{cfg.num_hidden_layers}."
    # hc_head is unused (the exit is a plain stream mean); the NextN block's own head and embedding
    # duplicate the trunk's and are read from there.
    if "hc_head" in name or name.startswith((mtp + "shared_head.head.", mtp + "embed_tokens.")):
        return None
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    return _rename_live(name)


_RENAMES = (
    (re.compile(r"^(layers\.\d+\.self_attn\.)forget_gate\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$"),
     r"\1\2"),
    (re.compile(r"^(layers\.\d+\.)(attn|ffn)_hc\.(fn|base|scale)$"), r"\1hc_\2_\3"),
)


def _rename_live(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


_FUSED = re.compile(
    r"^(layers\.\d+\.)(self_attn\.conv1d\.weight|mlp\.experts\.gate_up_proj|mlp\.experts\.down_proj)$")


def _unfuse(name: str, arr: np.ndarray) -> dict[str, np.ndarray] | str:
    """Split one of transformers' fused live tensors into on-disk tensors, or say why not."""
    layer, kind = _FUSED.match(name).groups()
    if kind == "self_attn.conv1d.weight":
        if arr.ndim != 3 or arr.shape[0] % 3:
            return f"fused {name} has shape {list(arr.shape)}, expected [3C, 1, K]"
        q, k, v = np.split(arr, 3, axis=0)  # contiguous row blocks already
        return {f"{layer}self_attn.{p}_conv1d.weight": t for p, t in zip("qkv", (q, k, v))}
    if arr.ndim != 3 or (kind.endswith("gate_up_proj") and arr.shape[1] % 2):
        want = "[E, 2I, D]" if kind.endswith("gate_up_proj") else "[E, D, I]"
        return f"fused {name} has shape {list(arr.shape)}, expected {want}"
    out = {}
    for e in range(arr.shape[0]):
        base = f"{layer}mlp.experts.{e}."
        if kind.endswith("down_proj"):
            out[base + "down_proj.weight"] = arr[e]
        else:  # gate rows first, then up rows (transformers splits with chunk(2))
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = np.split(arr[e], 2, axis=0)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# ---- finding and reading files ----------------------------------------------------------------

def _shard_plan(path: str) -> dict[str, list[str] | None]:
    """File path -> tensor names the index promises in it (None: take the whole file)."""
    if os.path.isfile(path):
        return {path: None}
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint path {path} does not exist: point at a checkpoint directory")
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return {single: None}
    index = os.path.join(path, INDEX_FILE)
    if not os.path.lexists(index):  # anything else there (a FIFO, a directory) the reader refuses
        raise CheckpointError(
            f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}: not a checkpoint directory")
    weight_map = _read_weight_map(index)
    plan: dict[str, list[str] | None] = {}
    for name, shard in weight_map.items():
        plan.setdefault(os.path.join(path, shard), []).append(name)
    for shard in plan:
        if not os.path.isfile(shard):
            raise CheckpointError(
                f"{index} names shard {os.path.basename(shard)} but it is missing from {path}")
    return plan


def _read_weight_map(index: str) -> dict[str, str]:
    fix = "re-export it (a JSON object with a weight_map)"
    weight_map = read_json_object(index, CheckpointError, fix).get("weight_map")
    # Shards must be plain file names beside the index: an index cannot send the loader elsewhere.
    ok = isinstance(weight_map, dict) and all(
        isinstance(s, str) and os.path.basename(s) == s and s not in ("", ".", "..") for s in weight_map.values())
    if not ok:
        raise CheckpointError(
            f"{index}: weight_map must map tensor names to shard file names in the same directory; re-export it")
    return weight_map


def _widen(arr: np.ndarray, dtype: str, keep_bf16: bool) -> np.ndarray:
    if dtype == "F8_E4M3":  # raw e4m3 bytes until pair_scales joins them with their scales
        return arr
    if dtype == "BF16":
        return arr if keep_bf16 else bf16_to_f32(arr)
    return arr.astype(np.float32, copy=False)


def _natural(text: str) -> list:
    """Sort key that puts layers.2 before layers.10."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text)]


class _Census:
    """Offenders against the contract, collected so one error can name them all."""

    KINDS = ("missing", "unexpected", "wrong shape", "unsupported dtype", FP8_KIND, "not finite", "duplicate",
             "malformed")

    def __init__(self):
        self.lines: dict[str, list[str]] = {kind: [] for kind in self.KINDS}

    def add(self, kind: str, line: str) -> None:
        self.lines[kind].append(line)

    def raise_if_any(self, path: str) -> None:
        kinds = {k: sorted(v, key=_natural) for k, v in self.lines.items() if v}
        if not kinds:
            return
        counts = ", ".join(f"{len(v)} {k}" for k, v in kinds.items())
        # One line: every kind's first offenders (a long "missing" list cannot hide the one wrong
        # shape that explains it); the full list rides on the error as `details`.
        share = max(_LISTED_PER_LINE // len(kinds), 1)
        listed = []
        for kind, lines in kinds.items():
            listed.append(f"{kind}: " + "; ".join(lines[:share])
                          + (f"; ... and {len(lines) - share} more {kind}" if len(lines) > share else ""))
        err = CheckpointError(
            f"checkpoint {path} breaks the tensor contract of its config ({counts}): " + " | ".join(listed)
            + " (the full list: --debug, or the error's .details); fix: re-export the checkpoint for this "
            "config.json, or fix config.json to match it")
        err.details = [f"{kind}: {line}" for kind, lines in kinds.items() for line in lines]
        raise err


def _parts(name: str, shape: tuple[int, ...]) -> int:
    """How many canonical tensors one stored tensor becomes (a fused live tensor splits)."""
    match = _FUSED.match(name)
    if match is None or len(shape) != 3:
        return 1
    kind = match.group(2)
    return 3 if kind == "self_attn.conv1d.weight" else shape[0] * (2 if kind.endswith("gate_up_proj") else 1)


def _check_declared_count(path: str, cfg: ModelConfig, kept: list) -> None:
    """Before the contract is enumerated: a config declaring far more tensors than the files hold
    (an absurd layer or expert count) is refused here, at the cost of a few multiplications. Up
    to twice the files' count the census runs and names each missing tensor, so what it
    enumerates stays linear in what the files hold."""
    held = sum(_parts(name, entry.shape) for name, entry in kept)
    declared = expected_count(cfg)
    if declared > 2 * held + _COUNT_SLACK:
        sparse = sum(t == "sparse" for t in cfg.mlp_layer_types) + cfg.has_mtp
        raise CheckpointError(
            f"config.json of {path} declares {declared} tensors (num_hidden_layers {cfg.num_hidden_layers}, "
            f"n_routed_experts {cfg.n_routed_experts} in each of {sparse} MoE layers, num_nextn_predict_layers "
            f"{cfg.num_nextn_predict_layers}) but the checkpoint files hold {held}: fix config.json to match "
            "the checkpoint, or re-export it")


def _headers(path: str, cfg: ModelConfig) -> list:
    """[(file, header, {raw name: canonical name} of its kept tensors)], every index promise checked."""
    out = []
    for file, promised in _shard_plan(path).items():
        header = read_header(file)
        for name in promised or ():
            if name not in header.entries:
                raise CheckpointError(f"{INDEX_FILE} maps {name} to {os.path.basename(file)}, "
                                      "but that shard does not hold it; re-download or re-export")
        kept = {raw: _canonical_name(raw, cfg) for raw in header.entries}
        out.append((file, header, {raw: name for raw, name in kept.items() if name is not None}))
    return out


def _file_tensors(file: str, header, kept: dict, keep_bf16: bool, census: _Census):
    """Yield (raw name, canonical name, shape, array or None) for one file's kept tensors."""
    readable = [raw for raw in kept if header.entries[raw].dtype in READABLE_DTYPES]
    arrays = read_tensors(file, header, readable)  # ignored tensors are never read
    for raw, name in kept.items():
        entry = header.entries[raw]
        if raw not in arrays:
            if entry.dtype.startswith("F8_"):
                census.add(FP8_KIND, unsupported_fp8_message(raw, entry.dtype))
            else:
                supported = ", ".join(SUPPORTED_DTYPES)
                census.add("unsupported dtype", f"{raw} is {entry.dtype} (memra reads {supported}, "
                                                "and F8_E4M3 with block scales)")
            yield raw, name, entry.shape, None
            continue
        arr = arrays.pop(raw)
        if not all_finite(arr, entry.dtype):  # NaN/inf weights decode garbage (token 0 forever)
            census.add("not finite", f"{raw} holds {nonfinite_count(arr, entry.dtype)} NaN/inf values")
        yield raw, name, entry.shape, _widen(arr, entry.dtype, keep_bf16)


def _collect(path: str, cfg: ModelConfig, keep_bf16: bool, census: _Census, only=None):
    """Canonical name -> (shape, array or None for an unsupported dtype), fused tensors split;
    with `only`, the tensors whose canonical names it accepts. Declared sizes are checked against
    the headers and the host's memory (for what is read) before any tensor is read."""
    files = _headers(path, cfg)
    entries = [(raw, header.entries[raw]) for _, header, kept in files for raw in kept]
    _check_declared_count(path, cfg, entries)
    if only is not None:
        files = [(file, header, {raw: n for raw, n in kept.items() if only(n)}) for file, header, kept in files]
    read = [header.entries[raw] for _, header, kept in files for raw in kept]
    if any(e.dtype.startswith("F8_") for e in read):
        check_quantization_config(path)
    check_weights_fit(weight_bytes(((e.dtype, e.shape) for e in read), keep_bf16), path)
    got: dict[str, tuple[tuple[int, ...], np.ndarray | None]] = {}
    source: dict[str, str] = {}
    dtypes: dict[str, str] = {}  # canonical name -> stored dtype (FP8 pairing reads it)
    for file, header, kept in files:
        for raw, name, shape, arr in _file_tensors(file, header, kept, keep_bf16, census):
            parts = {name: arr}
            fp8 = header.entries[raw].dtype == "F8_E4M3"  # a fused FP8 tensor stays whole: refused
            if arr is not None and _FUSED.match(name) and not fp8:
                parts = _unfuse(name, arr)
                if isinstance(parts, str):
                    census.add("malformed", parts)
                    continue
            for part, t in parts.items():
                if part in got:
                    census.add("duplicate", f"{part} (from {source[part]} and {raw})")
                    continue
                got[part], source[part] = (tuple(shape if t is None else t.shape), t), raw
                dtypes[part] = header.entries[raw].dtype
    pair_scales(got, dtypes, source, census, cfg)
    return got


def load_checkpoint(path, cfg: ModelConfig, keep_bf16: bool = False, only=None) -> dict[str, np.ndarray]:
    """Load a checkpoint directory (single file or sharded) or one .safetensors file.

    Returns canonical bare name -> float32 array (BF16/F16 widened); with keep_bf16 BF16 tensors
    stay raw uint16 bits; an FP8 tensor comes back as a memra.backend.fp8.Fp8Block (e4m3 bytes and
    their block scales), whatever keep_bf16 says. Raises one CheckpointError naming every contract offender (NaN/inf
    weights included), or one naming a declared size the files or the host memory cannot hold.
    `only(name) -> bool` reads just the tensors whose canonical names it accepts (a pipeline
    rank's own stage, memra.model.ranks.stage_tensors); the contract is then checked for those.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"checkpoint path must be a str or os.PathLike, got {type(path).__name__}: "
                         "pass the checkpoint directory")
    path = os.fspath(path)
    census = _Census()
    got = _collect(path, cfg, keep_bf16, census, only)
    expected = {name: shape for name, shape in expected_tensors(cfg).items() if only is None or only(name)}
    for name, shape in expected.items():
        if name not in got:
            census.add("missing", f"{name} {list(shape)}")
        elif got[name][0] != shape:
            census.add("wrong shape", f"{name} is {list(got[name][0])}, expected {list(shape)}")
    for name in got.keys() - expected.keys():
        census.add("unexpected", name)
    census.raise_if_any(path)
    return {name: got[name][1] for name in expected}


# The deterministic fixture writer lives in memra/fixtures.py; memra.checkpoint.write_fixture and
# fixture_tensor stay importable from here.
from memra.fixtures import fixture_tensor, write_fixture  # noqa: E402, F401
