"""The drafter's weight precision policy and ggml-compatible q8_0 / q4_0 block codecs.

A drafter only moves acceptance (the target verifies every token), so its projection weights may
be held coarser than the checkpoint. Each precision names an encoding; the drafter computes in
float32 on the values that encoding represents, `decode(encode(w))`:

* f32  — the checkpoint values as stored (bf16 widens exactly).
* bf16 — rounded to bfloat16 (nearest-even); a no-op on a bf16 checkpoint.
* q8_0 — ggml's block of 32: fp16 scale d = amax/127, then 32 int8 q = roundf(x/d).  34 bytes.
* q4_0 — ggml's block of 32: fp16 d = max/-8 (max = the signed value of largest magnitude),
         nibbles min(15, int(x/d + 8.5)); byte j holds element j (low) and j+16 (high).  18 bytes.

The encoders reproduce ggml's `quantize_row_q8_0_ref` / `quantize_row_q4_0_ref` byte for byte:
float32 arithmetic, the scale's reciprocal taken from the float32 d (not the fp16 one), C
`roundf` (half away from zero) and truncation where ggml uses them, and an fp16 scale that keeps
subnormals (as ggml's conversion does; the seed's encoder flushed them, zeroing tiny blocks).

    blob = encode_q8_0(w)                 # uint8 [rows * cols/32 * 34]
    w8 = decode_q8_0(blob, w.shape)       # float32, what a q8_0 drafter computes with
    held = held_values(w, "q4_0")         # the same round trip in one call
"""

from __future__ import annotations

import numpy as np

from memra.errors import InputError
from memra.safetensors_io import bf16_to_f32, f32_to_bf16

PRECISIONS = ("f32", "bf16", "q8_0", "q4_0")
QK = 32  # values per block in both ggml formats
F32 = np.float32

_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (QK,))])   # 34 bytes
_Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])  # 18 bytes


def _blocks(x, fmt: str) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    if x.ndim == 0 or x.shape[-1] % QK:
        raise InputError(f"{fmt} packs rows in blocks of {QK} values: a row of {x.shape[-1:] or 'scalar'} "
                         f"values does not fit; choose precision bf16 or f32 for this tensor")
    return np.ascontiguousarray(x).reshape(-1, QK)


def _reciprocal(d: np.ndarray) -> np.ndarray:
    """ggml's `id = d ? 1.0f/d : 0.0f` in float32."""
    out = np.zeros_like(d)
    np.divide(F32(1), d, out=out, where=d != 0)
    return out


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf (half away from zero) of float32 values; float64 makes |v| + 0.5 exact."""
    a = np.abs(v.astype(np.float64))
    return np.copysign(np.floor(a + 0.5), v)


def encode_q8_0(x) -> np.ndarray:
    """uint8 q8_0 blocks of x (rows of a multiple of 32 values, row-major)."""
    blk = _blocks(x, "q8_0")
    amax = np.abs(blk).max(axis=1)
    d = (amax / F32(127)).astype(F32)
    q = _roundf(blk * _reciprocal(d)[:, None])
    out = np.empty(blk.shape[0], _Q8_0)
    out["d"] = d.astype(np.float16)
    out["qs"] = np.clip(q, -127, 127).astype(np.int8)
    return out.view(np.uint8)


def decode_q8_0(blob, shape) -> np.ndarray:
    blk = np.frombuffer(np.ascontiguousarray(blob, dtype=np.uint8).tobytes(), _Q8_0)
    vals = blk["qs"].astype(F32) * blk["d"].astype(F32)[:, None]
    return vals.reshape(shape)


def encode_q4_0(x) -> np.ndarray:
    """uint8 q4_0 blocks of x (rows of a multiple of 32 values, row-major)."""
    blk = _blocks(x, "q4_0")
    rows = np.arange(blk.shape[0])
    signed_max = blk[rows, np.argmax(np.abs(blk), axis=1)]  # first of the largest magnitude, as ggml
    d = (signed_max / F32(-8)).astype(F32)
    scaled = (blk * _reciprocal(d)[:, None]).astype(F32) + F32(8.5)
    q = np.minimum(15, np.trunc(scaled).astype(np.int64)).astype(np.uint8)
    out = np.empty(blk.shape[0], _Q4_0)
    out["d"] = d.astype(np.float16)
    out["qs"] = q[:, : QK // 2] | (q[:, QK // 2:] << 4)
    return out.view(np.uint8)


def decode_q4_0(blob, shape) -> np.ndarray:
    blk = np.frombuffer(np.ascontiguousarray(blob, dtype=np.uint8).tobytes(), _Q4_0)
    qs = blk["qs"]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int64) - 8
    vals = q.astype(F32) * blk["d"].astype(F32)[:, None]
    return vals.reshape(shape)


def held_values(w, precision: str) -> np.ndarray:
    """float32 `decode(encode(w))` for one precision (rows = the last axis)."""
    w = np.asarray(w, dtype=F32)
    if precision == "f32":
        return np.array(w, dtype=F32)
    if precision == "bf16":
        return bf16_to_f32(f32_to_bf16(w))
    if precision == "q8_0":
        return decode_q8_0(encode_q8_0(w), w.shape)
    if precision == "q4_0":
        return decode_q4_0(encode_q4_0(w), w.shape)
    raise InputError(f"unknown drafter precision {precision!r}: choose one of {list(PRECISIONS)}")
