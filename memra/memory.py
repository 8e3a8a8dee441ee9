"""The memory plan: what a model's weights and a cache of max_ctx positions take, checked before
anything is allocated, so a declared size that cannot fit is refused with the numbers instead of
exhausting memory (DESIGN.md section 4).

The estimate is simple on purpose, and this is all of it:
* weights: each kept tensor's elements times its bytes as loaded, from the safetensors headers
  (BF16 kept raw, as load_model keeps it: 2 bytes; F16 and F32 become float32: 4). Checked
  against the host's available memory: the loader reads every tensor into host memory first,
  on any backend.
* a cache, float32 throughout. Per position: every DSA layer's latent row (kv_lora_rank); for a
  layer with its own indexer, its key and gate rows (2 x index_head_dim) and one pool key per
  index_kpool positions; the MTP block's plane likewise when the model has one (the native
  drafter allocates it). Fixed: every KDA layer's conv ring ((K-1) x 3C) and state (Hk x dk x dk),
  and one verify walk's attention buffers (VERIFY_CAP rows x heads x index_width, scores and
  positions). Checked against the backend's free memory (`be.free_bytes()` where the backend
  offers it, else the host's available memory).

    per_pos, fixed = cache_bytes(cfg)
    check_cache_fits(cfg, be, max_ctx)               # InputError with the max_ctx that fits
    limit, why = context_limit(cfg, be)              # the largest max_ctx allowed, and what bounds it
"""

from __future__ import annotations

import math
import os

from memra.errors import CheckpointError, InputError
from memra.limits import VERIFY_CAP
from memra.schedules import DSA, KDA

F32 = 4
LOADED_BYTES = {"BF16": 2, "F16": 4, "F32": 4}  # bytes per element once read (see above)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def host_available_bytes() -> int | None:
    """The host memory a new allocation can take without swapping (Linux MemAvailable), else the
    free physical pages; None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def free_bytes(be) -> int | None:
    """Free memory where `be` allocates: the backend's own answer when it has one, else the host's."""
    ask = getattr(be, "free_bytes", None)
    return ask() if callable(ask) else host_available_bytes()


def weight_bytes(entries, keep_bf16: bool = True) -> int:
    """Bytes of (dtype, shape) tensors as loaded (BF16 widened to 4 bytes unless kept raw); dtypes
    memra cannot read count at 4 (the contract refuses them anyway)."""
    per = {**LOADED_BYTES, "BF16": 2 if keep_bf16 else 4}
    return sum(math.prod(shape) * per.get(dtype, 4) for dtype, shape in entries)


def check_weights_fit(nbytes: int, path: str) -> None:
    free = host_available_bytes()
    if free is not None and nbytes > free:
        raise CheckpointError(
            f"checkpoint {path} holds {gib(nbytes)} of weights (as loaded) but the host has {gib(free)} "
            "available: free memory, or use a machine with more")


def cache_bytes(cfg) -> tuple[int, int]:
    """(bytes per position, fixed bytes) of one sequence's cache for `cfg` (see the module doc)."""
    di, pool = cfg.index_head_dim, cfg.index_kpool
    indexer = 2 * di + di / pool  # key + gate rows, and a pool key every `pool` positions
    per_pos = 0.0
    for kind, mode in zip(cfg.layer_types, cfg.indexer_types):
        if kind == DSA:
            per_pos += cfg.kv_lora_rank + (indexer if mode == "full" else 0)
    if cfg.has_mtp:
        per_pos += cfg.kv_lora_rank + indexer
    n_kda = sum(kind == KDA for kind in cfg.layer_types)
    kda = (cfg.linear_conv_kernel_dim - 1) * 3 * cfg.linear_dim + cfg.linear_num_heads * cfg.linear_head_dim ** 2
    walk = 2 * VERIFY_CAP * cfg.num_attention_heads * cfg.index_width
    return math.ceil(per_pos * F32), (n_kda * kda + walk + di) * F32


def _fits(cfg, free: int) -> int:
    per_pos, fixed = cache_bytes(cfg)
    return max((free - fixed) // max(per_pos, 1), 0)


def context_limit(cfg, be) -> tuple[int, str]:
    """The largest max_ctx a cache may have here, and what sets it (the model, or memory)."""
    limit, why = cfg.max_position_embeddings, "the model's max_position_embeddings"
    free = free_bytes(be)
    if free is not None and _fits(cfg, free) < limit:
        limit, why = _fits(cfg, free), f"the cache that fits in the {gib(free)} free"
    return limit, why


def check_cache_fits(cfg, be, max_ctx: int) -> None:
    """Refuse a max_ctx whose cache does not fit, naming the max_ctx that does."""
    per_pos, fixed = cache_bytes(cfg)
    need = fixed + per_pos * max_ctx
    free = free_bytes(be)
    if free is not None and need > free:
        raise InputError(
            f"max_ctx {max_ctx} needs a {gib(need)} cache ({per_pos} bytes per position + {gib(fixed)}) but "
            f"{gib(free)} is free: at most max_ctx {_fits(cfg, free)} fits; ask for less")
