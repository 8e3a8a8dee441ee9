"""Memory accounting: what a model's weights and a cache of max_ctx positions take, checked before
anything is allocated, so a declared size that cannot fit is refused with the numbers instead of
exhausting memory (DESIGN.md section 4). The per-device plan built on it: memra/memory_plan.py.

The estimate is simple on purpose, and this is all of it:
* weights on the host: each kept tensor's elements times its bytes as read, from the safetensors
  headers (BF16 kept raw, as load_model keeps it: 2 bytes; F8_E4M3 1, its `_scale_inv` F32 4;
  F16 and F32 become float32: 4). Checked against the host's available memory: the loader reads
  every tensor into host memory first, on any backend.
* weights on a device (held_bytes): projection matrices as stored (bf16 2 bytes, fp8 1 plus its
  float32 block scales), every other tensor widened to float32; grouped by trunk layer, embedding,
  head and MTP block (WeightBytes), from the headers or, with no files, from the tensor contract
  (config_weight_bytes, layer_weight_bytes: what a pipeline balances its stages by).
* a cache, float32 throughout. Per position: every DSA layer's latent row (kv_lora_rank); for a
  layer with its own indexer, its key and gate rows (2 x index_head_dim) and one pool key per
  index_kpool positions; the MTP block's plane likewise when the model has one (the native
  drafter allocates it). Fixed: every KDA layer's conv ring ((K-1) x 3C), VERIFY_CAP + 1 times
  (the live one and the ring before each row of a verify walk), its state (Hk x dk x dk)
  1 + kda_mark_count(VERIFY_CAP) times (the live one and the ones a verify walk keeps every
  KDA_MARK_ROWS rows) and a verify walk's recorded rows (VERIFY_CAP x Hk x kda_record_width):
  the rollback and rewind buffers, made at the first verify walk; and one
  verify walk's attention buffers (VERIFY_CAP rows x heads x index_width, scores and positions).
  Checked against the backend's free memory (`be.free_bytes()` where the backend offers it, else
  the host's available memory).
* on a GPU, a prompt walk's transient buffers (prime_buffer_bytes): the device plan counts them,
  the cache check above does not (they come and go with each prompt).

    per_pos, fixed = cache_bytes(cfg)
    check_cache_fits(cfg, be, max_ctx)               # InputError with the max_ctx that fits
    limit, why = context_limit(cfg, be)              # the largest max_ctx allowed, and what bounds it
    layer_weight_bytes(cfg, "fp8")                   # device bytes of each trunk layer, FP8 release
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from memra.backend.numpy_kda import kda_mark_count, kda_record_width
from memra.backend.pieces import head_bytes, head_group
from memra.checkpoint_fp8 import SCALE_SUFFIX
from memra.errors import CheckpointError, InputError
from memra.limits import ATTEND_BYTES, ATTEND_ROWS, HEAD_ROWS, MOE_ROWS, PRIME_CHUNK, VERIFY_CAP
from memra.schedules import DSA, KDA

F32 = 4
LOADED_BYTES = {"BF16": 2, "F16": 4, "F32": 4, "F8_E4M3": 1}  # bytes per element once read (see above)


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


# ---- weight bytes per layer, as a device holds them --------------------------------------------
# The model keeps projection matrices in their stored precision (be.matrix) and widens every other
# tensor to float32 (be.weight: norms, biases, the embedding table, the router, hc, conv, ape;
# memra/model/*.py). A tensor is held in float32 when it is 1-D or one of these:
_HELD_F32 = re.compile(r"(^embed_tokens\.weight$|\.hc_\w+_fn$|conv1d\.weight$|\.mlp\.gate\.weight$"
                       r"|\.index_kpool_compress_ape$)")
# Tensors the release stores in F32 whatever its weight dtype (research/glm5_checkpoint.md section 2).
_RELEASE_F32 = re.compile(r"(\.hc_\w+_(base|scale)$|\.A_log$|\.dt_bias$|\.e_score_correction_bias$)")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_BY_BYTES = {4: "f32", 2: "bf16", 1: "fp8"}


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """Device weight bytes of a model, grouped the way a pipeline splits it: `layers[i]` holds every
    `layers.{i}.*` tensor of the trunk; `embed` (embed_tokens) goes with the first stage; `head`
    (final norm + lm_head) and `mtp` (the NextN block, layers.{L}.*) with the last. `parts` keeps
    each group's bytes by how they are held ("bf16", "fp8", "fp8_scale", "f32")."""

    parts: dict  # group (trunk layer index, "embed", "head" or "mtp") -> {held dtype: bytes}
    num_layers: int

    def group(self, key) -> int:
        return sum(self.parts.get(key, {}).values())

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.group(i) for i in range(self.num_layers))

    @property
    def embed(self) -> int:
        return self.group("embed")

    @property
    def head(self) -> int:
        return self.group("head")

    @property
    def mtp(self) -> int:
        return self.group("mtp")

    def by_dtype(self, groups=None) -> dict[str, int]:
        """Held dtype -> bytes over `groups` (default: all)."""
        out: dict[str, int] = {}
        for key in self.parts if groups is None else groups:
            for kind, nbytes in self.parts.get(key, {}).items():
                out[kind] = out.get(kind, 0) + nbytes
        return out

    @property
    def total(self) -> int:
        return sum(self.by_dtype().values())


def held_bytes(name: str, shape, dtype: str) -> tuple[str, int]:
    """(held dtype, device bytes) of one canonical tensor stored as safetensors `dtype`: float32
    tensors (see _HELD_F32), and F16/F32 matrices, take 4 bytes an element; BF16 matrices 2;
    F8_E4M3 matrices 1 (their `_scale_inv` sibling, F32, is counted on its own as "fp8_scale")."""
    n = math.prod(shape)
    if name.endswith(SCALE_SUFFIX):
        return "fp8_scale", n * F32
    if len(shape) <= 1 or _HELD_F32.search(name) or dtype not in ("BF16", "F8_E4M3"):
        return "f32", n * F32
    return ("bf16", n * 2) if dtype == "BF16" else ("fp8", n)


def release_dtypes(cfg, dtype: str = "bf16") -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical name -> (safetensors dtype, shape) of every tensor a release checkpoint of `cfg`
    holds: "f32" (all F32), "bf16" (the BF16 release) or "fp8" (the FP8 release, scales included),
    from the tensor contract memra.tensor_contract.expected_tensors, so it never drifts from a load."""
    from memra.backend.fp8 import scale_grid
    from memra.tensor_contract import expected_tensors
    from memra.checkpoint_fp8 import fp8_allowed

    if dtype not in ("f32", "bf16", "fp8"):
        raise InputError(f"weight dtype {dtype!r} is not one memra plans: choose f32, bf16 or fp8")
    out = {}
    for name, shape in expected_tensors(cfg).items():
        if dtype == "f32" or _RELEASE_F32.search(name):
            out[name] = ("F32", shape)
        elif dtype == "fp8" and fp8_allowed(name, cfg):  # the release's FP8 set, by name: no files to ask
            out[name] = ("F8_E4M3", shape)
            out[name + SCALE_SUFFIX] = ("F32", scale_grid(shape))
        else:
            out[name] = ("BF16", shape)
    return out


def group_weight_bytes(cfg, tensors) -> WeightBytes:
    """WeightBytes of (canonical name, safetensors dtype, shape) triples (a `_scale_inv` name rides
    with its weight's layer)."""
    n = cfg.num_hidden_layers
    parts: dict = {}
    for name, dtype, shape in tensors:
        kind, nbytes = held_bytes(name, shape, dtype)
        layer = _LAYER.match(name)
        if layer is None:
            key = "embed" if name.startswith("embed_tokens.") else "head"
        else:
            key = int(layer.group(1)) if int(layer.group(1)) < n else "mtp"
        group = parts.setdefault(key, {})
        group[kind] = group.get(kind, 0) + nbytes
    return WeightBytes(parts, n)


def config_weight_bytes(cfg, dtype: str = "bf16") -> WeightBytes:
    """WeightBytes of a release checkpoint of `cfg` in `dtype` ("f32", "bf16" or "fp8"), without files."""
    return group_weight_bytes(cfg, ((k, d, s) for k, (d, s) in release_dtypes(cfg, dtype).items()))


def layer_weight_bytes(cfg, bytes_per_element: int | str = 2) -> list[int]:
    """Device bytes of each trunk layer's weights (index i -> every `layers.{i}.*` tensor) for a
    release checkpoint whose projections take `bytes_per_element` bytes: 2 / "bf16", 1 / "fp8"
    (the FP8 release's split, with its scales), 4 / "f32". The embedding, head and MTP bytes:
    config_weight_bytes(cfg, dtype).embed / .head / .mtp."""
    dtype = _BY_BYTES.get(bytes_per_element, bytes_per_element)
    return list(config_weight_bytes(cfg, dtype).layers)


def check_weights_fit(nbytes: int, path: str) -> None:
    free = host_available_bytes()
    if free is not None and nbytes > free:
        raise CheckpointError(
            f"checkpoint {path} holds {gib(nbytes)} of weights (as loaded) but the host has {gib(free)} "
            "available: free memory, or use a machine with more")


def cache_parts(cfg, layers, mtp: bool) -> tuple[float, int]:
    """(float32 elements per position, fixed float32 elements) of the state planes of trunk
    `layers` (and of the MTP block's plane when `mtp`): see the module doc."""
    di, pool = cfg.index_head_dim, cfg.index_kpool
    indexer = 2 * di + di / pool  # key + gate rows, and a pool key every `pool` positions
    per_pos, n_kda = 0.0, 0
    for i in layers:
        if cfg.layer_types[i] == DSA:
            per_pos += cfg.kv_lora_rank + (indexer if cfg.indexer_types[i] == "full" else 0)
        n_kda += cfg.layer_types[i] == KDA
    if mtp:
        per_pos += cfg.kv_lora_rank + indexer
    hk, dk = cfg.linear_num_heads, cfg.linear_head_dim
    ring = (cfg.linear_conv_kernel_dim - 1) * 3 * cfg.linear_dim
    record = VERIFY_CAP * hk * kda_record_width(dk, dk)
    states = 1 + kda_mark_count(VERIFY_CAP)  # live, and a walk's marks
    return per_pos, n_kda * (ring * (VERIFY_CAP + 1) + states * hk * dk * dk + record)


def walk_buffer_bytes(cfg) -> int:
    """One verify walk's attention buffers (scores and positions of VERIFY_CAP rows), plus a pool
    key row of slack."""
    return (2 * VERIFY_CAP * cfg.num_attention_heads * cfg.index_width + cfg.index_head_dim) * F32


PRIME_MARGIN = 1.25  # for what prime_buffer_bytes leaves out: index arrays, GEMM workspace, rounding


def prime_buffer_bytes(cfg, layers, max_ctx: int) -> int:
    """The largest transient working set of a prompt walk (the CUDA prime class,
    memra/backend/cuda/prime.py) over trunk `layers`: at most PRIME_CHUNK rows (and no more than
    max_ctx), scoring up to max_ctx positions. Per row, the mHC streams in and out and six
    float32 [D] rows; then the largest phase among the layers':
    * routed experts (sparse MLP), MOE_ROWS rows at a time, k + n_shared slots a row, each slot's
      activation pieces, gate and up GEMM rows, hidden pieces and down GEMM rows (18 D + 30 I bytes;
      a slot of an expert on the exact tiles needs less: its row, hidden row and output, 8 D + 4 I);
    * DSA attention, the larger of its two forms (_attention_bytes);
    * KDA: eleven float32 [C] rows a row (projections, the q, k, v planes, normalised q and k,
      gate, output and its gate).
    Times PRIME_MARGIN. On the H200 the sum before the margin is 0.5-1% above the peak a
    `bench` prime allocates with every expert on GEMMs (702, 2809, 5618, 6484 MiB at 512, 2048,
    4096, 8192 tokens); experts of few slots on the exact tiles only lower it."""
    rows = min(PRIME_CHUNK, max(max_ctx, 1))
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    phases = [0]
    if any(cfg.mlp_layer_types[j] == "sparse" for j in layers):
        slots = min(rows, MOE_ROWS) * (cfg.num_experts_per_tok + cfg.n_shared_experts)
        phases.append(slots * (18 * d + 30 * i))
    if any(cfg.layer_types[j] == DSA for j in layers):
        phases.append(_attention_bytes(cfg, rows, max_ctx))
    if any(cfg.layer_types[j] == KDA for j in layers):
        phases.append(11 * rows * cfg.linear_dim * F32)
    streams = rows * (2 * cfg.hc_mult + 6) * d * F32
    return math.ceil(PRIME_MARGIN * (streams + max(phases)))


def _attention_bytes(cfg, rows: int, max_ctx: int) -> int:
    """A prompt's DSA attention over `rows` rows and a `max_ctx` span, the larger of its forms:
    absorbed, the queries and outputs in the latent (2 x heads x rank floats a row), the key and
    value piece copies over the span (six bf16 copies each: 24 x rank bytes a position) and one
    chunk's scores and probability pieces (4 + 6 bytes a score, at most ATTEND_BYTES); per head
    (where it runs: pieces.head_group), the outputs (heads x dv floats a row), the latent's pieces,
    one pass of heads' expanded keys and values and that pass's chunk of scores."""
    heads, rank, dn, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    scores = lambda h, chunk: min(ATTEND_BYTES, min(rows, chunk) * h * max_ctx * (F32 + 6))
    absorbed = 2 * rows * heads * rank * F32 + 24 * rank * max_ctx + scores(heads, ATTEND_ROWS)
    group = head_group(max_ctx, heads, dn, dv, ATTEND_BYTES) if dn + dv < 2 * rank else 0
    if not group:
        return absorbed
    expanded = group * max_ctx * head_bytes(dn, dv)
    return max(absorbed, rows * heads * dv * F32 + 6 * rank * max_ctx + expanded + scores(group, HEAD_ROWS))


def cache_bytes(cfg) -> tuple[int, int]:
    """(bytes per position, fixed bytes) of one sequence's cache for `cfg` (see the module doc)."""
    per_pos, kda = cache_parts(cfg, range(cfg.num_hidden_layers), cfg.has_mtp)
    return math.ceil(per_pos * F32), kda * F32 + walk_buffer_bytes(cfg)


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
