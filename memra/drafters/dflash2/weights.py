"""The DFlash-family tensor contract, its census, and loading at a chosen precision.

The census names the family from the tensors themselves: any dynamic-conv or candidate-selector
tensor makes a DFlash2 checkpoint (`dflash2`: every conv and selector tensor is then required);
none makes the plain backbone of DFlash v1 and DSpark exports (`dflash`: the seed's format, whose
drafts are each row's own argmax or draw). Every expected tensor must be present with its shape
(one `CheckpointError` names every offender). The optional heads are mapped when present: the
markov head (`markov_head.w1`, `markov_head.w2`, both [V, rank]) and the confidence head
(`confidence_head.weight` [1, H] or [1, H + rank] with its `confidence_head.bias` [1]; either one
alone, or another width, is refused). Any other tensor is unmapped: a DSpark-strategy export
refuses it (a tensor we would silently drop is a program we would not run), a DFlash export warns.

Precision: the backbone projections (fc and every q/k/v/o, gate/up/down) take the chosen
encoding; norms, convs, selector and heads, which are small or gathered by row, stay bf16
(or exact at f32). Everything comes back as float32 host arrays of the held values.

    tensors = load_weights(dir, cfg, precision="q8_0")   # canonical name -> float32 ndarray
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from memra.drafters.dflash2.quant import PRECISIONS, QK, held_values
from memra.errors import CheckpointError, InputError
from memra.safetensors_io import (
    SUPPORTED_DTYPES,
    bf16_to_f32,
    read_header,
    read_safetensors,
    read_tensors,
)

WEIGHTS_FILE = "model.safetensors"
_BLOCKWISE = ("q8_0", "q4_0")

# canonical name -> the spellings exports use for it (the canonical one first)
_ALIASES = {
    "candidate_selector.predecessor_codebook": ("candidate_selector.predecessor_codebook.weight",),
    "candidate_selector.successor_codebook": ("candidate_selector.successor_codebook.weight",),
    "markov_head.w1": ("markov_head.w1.weight", "markov_head.markov_w1.weight"),
    "markov_head.w2": ("markov_head.w2.weight", "markov_head.markov_w2.weight"),
    "confidence_head.weight": ("confidence_head.proj.weight",),
    "confidence_head.bias": ("confidence_head.proj.bias",),
}
HEADS = ("markov_head.w1", "markov_head.w2", "confidence_head.weight", "confidence_head.bias")
DFLASH2, DFLASH = "dflash2", "dflash"     # the families: with convs + selector, the plain backbone
_DFLASH2_PARTS = (".attention_conv.", ".mlp_conv.", "candidate_selector.")


def family_of(names) -> str:
    """`dflash2` when any tensor belongs to the dynamic convs or the candidate selector."""
    return DFLASH2 if any(part in name for name in names for part in _DFLASH2_PARTS) else DFLASH


def _layer_tensors(cfg, i: int, family: str) -> dict[str, tuple[int, ...]]:
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    k, groups = cfg.conv_kernel_size, cfg.hidden_size // cfg.conv_group_size
    shapes = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q_out, h),
        "self_attn.k_proj.weight": (kv_out, h),
        "self_attn.v_proj.weight": (kv_out, h),
        "self_attn.o_proj.weight": (h, q_out),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    for conv in ("attention_conv", "mlp_conv") if family == DFLASH2 else ():
        shapes[f"{conv}.base_kernel"] = (2, k, h)
        shapes[f"{conv}.kernel_projection.weight"] = (2 * k * groups, h)
    return {f"layers.{i}.{name}": shape for name, shape in shapes.items()}


def expected_tensors(cfg, family: str = DFLASH2) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor a checkpoint of `family` must hold."""
    if family not in (DFLASH2, DFLASH):
        raise InputError(f"unknown drafter family {family!r}: choose {DFLASH2!r} or {DFLASH!r}")
    h, r, v = cfg.hidden_size, cfg.selector_rank, cfg.vocab_size
    out = {"fc.weight": (h, len(cfg.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    if family == DFLASH2:
        out.update({
            "candidate_selector.hidden_projection.weight": (r, h),
            "candidate_selector.predecessor_codebook": (v, r),
            "candidate_selector.successor_codebook": (v, r),
        })
    for i in range(cfg.num_hidden_layers):
        out.update(_layer_tensors(cfg, i, family))
    return out


def is_projection(name: str) -> bool:
    """The tensors the blockwise precisions encode: fc and the attention / MLP projections."""
    return name == "fc.weight" or (name.startswith("layers.") and name.endswith("_proj.weight"))


def _canonical_names(path: str, names) -> dict[str, str]:
    """file name -> canonical name for every name an alias table maps; others map to themselves."""
    reverse = {alias: canon for canon, aliases in _ALIASES.items() for alias in aliases}
    out, seen = {}, {}
    for name in names:
        canon = reverse.get(name, name)
        if canon in seen:
            raise CheckpointError(f"{path}: tensors {seen[canon]!r} and {name!r} are both {canon!r}; "
                                  "keep one of them")
        seen[canon] = name
        out[name] = canon
    return out


def _head_shapes(cfg, shapes: dict) -> dict[str, tuple[int, ...]]:
    """Expected shapes of the optional heads present in `shapes` (canonical -> file shape)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    want, rank = {}, None
    markov = [n for n in ("markov_head.w1", "markov_head.w2") if n in shapes]
    if markov:
        w1 = shapes.get("markov_head.w1", ())
        if len(markov) == 1 or len(w1) != 2:
            raise CheckpointError("markov head: needs both markov_head.w1 and markov_head.w2 as [vocab, rank] "
                                  f"matrices, found {', '.join(f'{n} {list(shapes[n])}' for n in markov)}")
        rank = w1[1]
        want["markov_head.w1"] = want["markov_head.w2"] = (v, rank)
    if "confidence_head.weight" in shapes or "confidence_head.bias" in shapes:
        want.update(_confidence_shapes(shapes, h, rank))
    return want


def _confidence_shapes(shapes: dict, h: int, rank: int | None) -> dict[str, tuple[int, ...]]:
    """The confidence head is a weight [1, in_dim] and its bias, together; in_dim is the hidden
    size, or hidden + markov rank when the head was trained on the markov embedding too."""
    present = [n for n in ("confidence_head.weight", "confidence_head.bias") if n in shapes]
    if len(present) == 1:
        other = "bias" if present[0].endswith("weight") else "weight"
        raise CheckpointError(f"confidence head: {present[0]} {list(shapes[present[0]])} has no "
                              f"confidence_head.{other} beside it; the head is a weight [1, in_dim] and a "
                              "bias [1]: export both, or neither")
    weight = shapes["confidence_head.weight"]
    widths = {h: "hidden_size"} if rank is None else {h: "hidden_size", h + rank: "hidden_size + markov rank"}
    if len(weight) != 2 or weight[0] != 1 or weight[1] not in widths:
        named = " or ".join(f"{w} ({what})" for w, what in widths.items())
        raise CheckpointError(f"confidence head: confidence_head.weight is {list(weight)}, and its input "
                              f"must be [1, {named}]; the head was trained for another drafter (or "
                              "without its markov head): re-export it with this drafter")
    return {"confidence_head.weight": weight, "confidence_head.bias": (1,)}


def census(path: str, cfg, file_shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Check the tensor contract; return canonical name -> file name of every mapped tensor."""
    canon = _canonical_names(path, file_shapes)
    shapes = {canon[n]: tuple(s) for n, s in file_shapes.items()}
    family = family_of(shapes)
    expected = expected_tensors(cfg, family)
    expected.update(_head_shapes(cfg, shapes))
    missing = [n for n in expected if n not in shapes]
    misshaped = [f"{n} is {list(shapes[n])}, expected {list(s)}" for n, s in expected.items()
                 if n in shapes and shapes[n] != s and not (n == "confidence_head.bias" and shapes[n] == ())]
    if missing or misshaped:
        parts = ([f"missing {len(missing)}: {', '.join(missing)}"] if missing else []) \
            + ([f"misshaped: {'; '.join(misshaped)}"] if misshaped else [])
        what = "DFlash2 (convs + candidate selector)" if family == DFLASH2 else "DFlash / DSpark backbone"
        raise CheckpointError(f"{path}: not the {what} checkpoint its config.json describes ({' | '.join(parts)}); "
                              "re-export the drafter or fix its config")
    extra = sorted(n for n in shapes if n not in expected)
    if extra:
        listed = ", ".join(extra[:12]) + (" ..." if len(extra) > 12 else "")
        if cfg.strategy_dspark:
            raise CheckpointError(f"{path}: DSpark-strategy export holds {len(extra)} unmapped tensors ({listed}); "
                                  "memra would silently drop what they compute: use an export without them")
        warnings.warn(f"{path}: ignoring {len(extra)} unmapped tensors ({listed})", stacklevel=3)
    inverse = {c: n for n, c in canon.items()}
    return {c: inverse[c] for c in expected}


def _widen(dtype: str, arr: np.ndarray) -> np.ndarray:
    return bf16_to_f32(arr) if dtype == "BF16" else arr.astype(np.float32)


def load_weights(dir, cfg, precision: str) -> dict[str, np.ndarray]:
    """Census then read: canonical name -> float32 host array of the held values."""
    if precision not in PRECISIONS:
        raise InputError(f"unknown drafter precision {precision!r}: choose one of {list(PRECISIONS)}")
    path = os.path.join(os.fspath(dir), WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"no {WEIGHTS_FILE} at {path}: point at a DFlash2 drafter directory")
    header = read_header(path)
    mapped = census(path, cfg, {n: e.shape for n, e in header.entries.items()})
    bad = [(f, header.entries[f].dtype) for f in mapped.values() if header.entries[f].dtype not in SUPPORTED_DTYPES]
    if bad:
        listed = ", ".join(f"{n} is {d}" for n, d in bad[:6])
        raise CheckpointError(f"{path}: unsupported dtype ({listed}); memra reads {', '.join(SUPPORTED_DTYPES)}: "
                              "convert the drafter to bf16 or f32")
    if precision in _BLOCKWISE:
        uneven = [f"{c} (rows of {header.entries[f].shape[-1]})" for c, f in mapped.items()
                  if is_projection(c) and header.entries[f].shape[-1] % QK]
        if uneven:
            raise InputError(f"precision {precision} packs rows in blocks of {QK}, and {', '.join(uneven)} "
                             "do not divide; choose precision bf16 or f32 for this drafter")
    raw = read_tensors(path, header, mapped.values())
    out = {}
    for canon, name in mapped.items():
        values = _widen(header.entries[name].dtype, raw.pop(name))
        kind = precision if precision == "f32" or is_projection(canon) else "bf16"
        out[canon] = held_values(values, kind)
    return out


def load_mask_embedding(source, hidden: int) -> np.ndarray:
    """The [H] mask-row override from an array, an .npy file, or a one-tensor .safetensors file
    (or one holding `embedding` / `mask_embedding`)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise CheckpointError(f"mask embedding file {path} does not exist")
        if path.endswith(".npy"):
            try:
                arr = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{path}: cannot read the mask embedding ({exc})") from None
        elif path.endswith(".safetensors"):
            tensors = read_safetensors(path)
            named = [n for n in ("mask_embedding", "embedding") if n in tensors]
            if not named and len(tensors) != 1:
                raise CheckpointError(f"{path}: holds {len(tensors)} tensors; put the mask embedding alone "
                                      "or under the name 'mask_embedding'")
            dtype, _, arr = tensors[named[0] if named else next(iter(tensors))]
            arr = _widen(dtype, arr)
        else:
            raise InputError(f"mask embedding {path}: give an .npy or .safetensors file (convert a .pt "
                             "with torch.save -> numpy.save)")
    else:
        arr = source
    get = getattr(arr, "get", None)  # a cupy array comes to the host
    arr = np.asarray(get() if callable(get) and not isinstance(arr, np.ndarray) else arr)
    arr = bf16_to_f32(arr) if arr.dtype == np.uint16 else arr.astype(np.float32)
    if arr.size != hidden or arr.ndim not in (1, 2):
        raise InputError(f"mask embedding has shape {list(arr.shape)}; the drafter needs [{hidden}] "
                         "(its hidden_size)")
    arr = arr.reshape(hidden)
    if not np.all(np.isfinite(arr)):
        raise InputError("mask embedding holds non-finite values; re-export it")
    return arr
