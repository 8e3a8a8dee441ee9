"""The glm5_next tensor contract: what a checkpoint must hold, loading it, and writing fixtures.

A checkpoint arrives under several spellings (the release's `model.language_model.` prefix, a flat
`model.` or bare text-model export, transformers' live fused tensors) and in F32, BF16 or F16. This
module maps all of them to one set of canonical bare names (research/glm5_checkpoint.md section 1),
checks the result against `expected_tensors(cfg)` and refuses with ONE `CheckpointError` that lists
every missing, unexpected, misshaped or unsupported tensor, so a broken export is fixed in one pass.

    cfg = load_config(ckpt_dir)
    weights = load_checkpoint(ckpt_dir, cfg)          # canonical name -> float32 array
    write_fixture(tmp_dir, preset("small"), seed=0)   # a deterministic random checkpoint
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib

import numpy as np

from memra.config import KDA, ModelConfig
from memra.errors import CheckpointError
from memra.safetensors_io import (
    SUPPORTED_DTYPES, bf16_to_f32, read_header, read_tensors, write_safetensors,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PREFIXES = ("model.language_model.", "model.")
_MAX_LISTED = 40  # offenders shown in one error; the rest are counted


# ---- the contract -----------------------------------------------------------------------------

def _kda(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, c, hk, dk = cfg.hidden_size, cfg.linear_dim, cfg.linear_num_heads, cfg.linear_head_dim
    k = cfg.linear_conv_kernel_dim
    out = {f"{p}_proj.weight": (c, d) for p in "qkv"}
    out.update({f"{p}_conv1d.weight": (c, 1, k) for p in "qkv"})
    out.update({
        "f_a_proj.weight": (dk, d), "f_b_proj.weight": (c, dk), "A_log": (hk,), "dt_bias": (c,),
        "b_proj.weight": (hk, d), "g_a_proj.weight": (dk, d), "g_b_proj.weight": (c, dk),
        "o_norm.weight": (dk,), "o_proj.weight": (d, c),
    })
    return out


def _dsa(cfg: ModelConfig, with_indexer: bool) -> dict[str, tuple[int, ...]]:
    d, h, rq, rkv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    out = {
        "q_a_proj.weight": (rq, d), "q_a_layernorm.weight": (rq,), "q_b_proj.weight": (h * (dn + dr), rq),
        "kv_a_proj_with_mqa.weight": (rkv + dr, d), "kv_a_layernorm.weight": (rkv,),
        "kv_b_proj.weight": (h * (dn + dv), rkv), "o_proj.weight": (d, h * dv),
    }
    if with_indexer:
        hi, di, p = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
        out.update({f"indexer.{k}": v for k, v in {
            "wq_b.weight": (hi * di, rq), "wk.weight": (di, d), "k_norm.weight": (di,),
            "k_norm.bias": (di,), "weights_proj.weight": (hi, d),
            "index_kpool_compress_gate": (di, d), "index_kpool_compress_ape": (p, di),
        }.items()})
    return out


def _swiglu(inner: int, d: int) -> dict[str, tuple[int, ...]]:
    return {"gate_proj.weight": (inner, d), "up_proj.weight": (inner, d), "down_proj.weight": (d, inner)}


def _moe(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, e = cfg.hidden_size, cfg.n_routed_experts
    out = {"gate.weight": (e, d), "gate.e_score_correction_bias": (e,)}
    for i in range(e):
        out.update({f"experts.{i}.{k}": v for k, v in _swiglu(cfg.moe_intermediate_size, d).items()})
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    out.update({f"shared_experts.{k}": v for k, v in _swiglu(shared, d).items()})
    return out


def _hc(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    n, d = cfg.hc_mult, cfg.hidden_size
    m = (2 + n) * n
    out = {}
    for site in ("attn", "ffn"):
        out.update({f"hc_{site}_fn": (m, n * d), f"hc_{site}_base": (m,), f"hc_{site}_scale": (3,)})
    return out


def _prefixed(prefix: str, block: dict) -> dict[str, tuple[int, ...]]:
    return {prefix + k: v for k, v in block.items()}


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical bare tensor name -> shape for every tensor a checkpoint of `cfg` must hold."""
    d, v, n_layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    out = {"embed_tokens.weight": (v, d), "norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    for i in range(n_layers):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        out.update(_prefixed(p, _hc(cfg)))
        kind = cfg.layer_types[i]
        mixer = _kda(cfg) if kind == KDA else _dsa(cfg, cfg.indexer_types[i] == "full")
        out.update(_prefixed(p + "self_attn.", mixer))
        ffn = _swiglu(cfg.intermediate_size, d) if cfg.mlp_layer_types[i] == "dense" else _moe(cfg)
        out.update(_prefixed(p + "mlp.", ffn))
    if cfg.has_mtp:
        p = f"layers.{n_layers}."
        for name in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
            out[f"{p}{name}.weight"] = (d,)
        out[p + "eh_proj.weight"] = (d, 2 * d)
        out.update(_prefixed(p + "self_attn.", _dsa(cfg, with_indexer=True)))
        out.update(_prefixed(p + "mlp.", _moe(cfg)))
    return out


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
    if not os.path.isfile(index):
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
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{index} is not a JSON object with a weight_map ({exc}); re-export it") from None
    # Shards must be plain file names beside the index: an index cannot send the loader elsewhere.
    ok = isinstance(weight_map, dict) and all(
        isinstance(s, str) and os.path.basename(s) == s and s not in ("", ".", "..") for s in weight_map.values())
    if not ok:
        raise CheckpointError(
            f"{index}: weight_map must map tensor names to shard file names in the same directory")
    return weight_map


def _widen(arr: np.ndarray, dtype: str, keep_bf16: bool) -> np.ndarray:
    if dtype == "BF16":
        return arr if keep_bf16 else bf16_to_f32(arr)
    return arr.astype(np.float32, copy=False)


def _natural(text: str) -> list:
    """Sort key that puts layers.2 before layers.10."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text)]


class _Census:
    """Offenders against the contract, collected so one error can list them all."""

    def __init__(self):
        self.lines: dict[str, list[str]] = {"missing": [], "unexpected": [], "wrong shape": [],
                                            "unsupported dtype": [], "duplicate": [], "malformed": []}

    def add(self, kind: str, line: str) -> None:
        self.lines[kind].append(line)

    def raise_if_any(self, path: str) -> None:
        total = sum(len(v) for v in self.lines.values())
        if not total:
            return
        kinds = {k: sorted(v, key=_natural) for k, v in self.lines.items() if v}
        counts = ", ".join(f"{len(v)} {k}" for k, v in kinds.items())
        # Each kind gets its share of the listing, so a long "missing" list cannot hide the one
        # wrong shape that explains it.
        share = max(_MAX_LISTED // len(kinds), 3)
        listed = []
        for kind, lines in kinds.items():
            listed += [f"  {kind}: {line}" for line in lines[:share]]
            if len(lines) > share:
                listed.append(f"  ... and {len(lines) - share} more {kind}")
        raise CheckpointError(
            f"checkpoint {path} breaks the tensor contract of its config ({counts}):\n"
            + "\n".join(listed)
            + "\nFix: re-export the checkpoint for this config.json, or fix config.json to match it.")


def _file_tensors(file: str, promised, cfg: ModelConfig, keep_bf16: bool, census: _Census):
    """Yield (raw name, canonical name, shape, array or None) for one file's kept tensors."""
    header = read_header(file)
    for name in promised or ():
        if name not in header.entries:
            raise CheckpointError(f"{INDEX_FILE} maps {name} to {os.path.basename(file)}, "
                                  "but that shard does not hold it; re-download or re-export")
    kept = {raw: _canonical_name(raw, cfg) for raw in header.entries}
    kept = {raw: name for raw, name in kept.items() if name is not None}
    readable = [raw for raw in kept if header.entries[raw].dtype in SUPPORTED_DTYPES]
    arrays = read_tensors(file, header, readable)  # ignored tensors are never read
    for raw, name in kept.items():
        entry = header.entries[raw]
        if raw not in arrays:
            supported = ", ".join(SUPPORTED_DTYPES)
            census.add("unsupported dtype", f"{raw} is {entry.dtype} (memra reads {supported})")
            yield raw, name, entry.shape, None
        else:
            yield raw, name, entry.shape, _widen(arrays.pop(raw), entry.dtype, keep_bf16)


def _collect(path: str, cfg: ModelConfig, keep_bf16: bool, census: _Census):
    """Canonical name -> (shape, array or None for an unsupported dtype), fused tensors split."""
    got: dict[str, tuple[tuple[int, ...], np.ndarray | None]] = {}
    source: dict[str, str] = {}
    for file, promised in _shard_plan(path).items():
        for raw, name, shape, arr in _file_tensors(file, promised, cfg, keep_bf16, census):
            parts = {name: arr}
            if arr is not None and _FUSED.match(name):
                parts = _unfuse(name, arr)
                if isinstance(parts, str):
                    census.add("malformed", parts)
                    continue
            for part, t in parts.items():
                if part in got:
                    census.add("duplicate", f"{part} (from {source[part]} and {raw})")
                    continue
                got[part], source[part] = (tuple(shape if t is None else t.shape), t), raw
    return got


def load_checkpoint(path, cfg: ModelConfig, keep_bf16: bool = False) -> dict[str, np.ndarray]:
    """Load a checkpoint directory (single file or sharded) or one .safetensors file.

    Returns canonical bare name -> float32 array (BF16/F16 widened); with keep_bf16 BF16 tensors
    stay raw uint16 bits. Raises one CheckpointError listing every contract offender.
    """
    path = os.fspath(path)
    census = _Census()
    got = _collect(path, cfg, keep_bf16, census)
    expected = expected_tensors(cfg)
    for name, shape in expected.items():
        if name not in got:
            census.add("missing", f"{name} {list(shape)}")
        elif got[name][0] != shape:
            census.add("wrong shape", f"{name} is {list(got[name][0])}, expected {list(shape)}")
    for name in got.keys() - expected.keys():
        census.add("unexpected", name)
    census.raise_if_any(path)
    return {name: got[name][1] for name in expected}


# ---- fixtures ---------------------------------------------------------------------------------

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
