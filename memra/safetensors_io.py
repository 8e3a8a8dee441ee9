"""Safetensors reading and writing with numpy alone, bfloat16 included.

memra must load checkpoints on machines without torch, and numpy has no bfloat16, so this module
parses the format itself: an 8-byte little-endian header length, a UTF-8 JSON header, then the raw
tensor bytes. Every way a file can be broken (truncated, lying header, overlapping tensors, unknown
dtype) is refused with a `CheckpointError` naming the file and the problem, never a raw
KeyError/ValueError/struct.error.

    tensors = read_safetensors("model.safetensors")     # name -> (dtype, shape, array)
    write_safetensors("out.safetensors", {"w": w}, dtype="bfloat16")

BF16 tensors come back as their raw uint16 bits; `bf16_to_f32` widens them exactly. F8_E4M3
tensors (raw bytes) are read by `read_tensors` for the checkpoint loader, which pairs each with its
block scales; `read_safetensors` refuses them.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import NamedTuple

import numpy as np

from memra.errors import CheckpointError, InputError
from memra.jsonfile import parse_json

SUPPORTED_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
# FP8 e4m3 reads as its raw bytes, but only the checkpoint loader takes it: a tensor means nothing
# without its `_scale_inv` sibling (memra/backend/fp8.py), so read_safetensors still refuses it.
FP8_DTYPES = {"F8_E4M3": np.dtype("u1")}
READABLE_DTYPES = {**SUPPORTED_DTYPES, **FP8_DTYPES}
# Bits per element of every dtype the format defines: a file holding one of the unsupported ones is
# still well-formed, so its byte counts are checked and the caller decides what to do with it.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the official reader's bound; anything larger is corrupt
_MAX_DIM = 2**62  # numpy cannot shape an array past int64, even an empty one
_MAX_NDIM = 32


class TensorEntry(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data section
    end: int


class Header(NamedTuple):
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the data section


# ---- bfloat16 ---------------------------------------------------------------------------------

def f32_to_bf16(x) -> np.ndarray:
    """Round float32 to bfloat16 bits (uint16), nearest-even; NaN stays a (quiet) NaN, sign kept."""
    f32 = np.asarray(x, dtype=np.float32)
    bits = np.ascontiguousarray(f32).reshape(-1).view(np.uint32)  # 1-D: 0-d math would warn on wrap
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    # Adding 0x7FFF plus the lowest kept bit rounds half-way cases towards an even mantissa.
    lsb = (bits >> 16) & 1
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | 0x0040).astype(np.uint16)
    return np.where(is_nan, quiet_nan, rounded).reshape(f32.shape)


def bf16_to_f32(u16) -> np.ndarray:
    """Widen bfloat16 bits (uint16) to float32; exact."""
    u16 = np.asarray(u16, dtype=np.uint16)
    return (u16.reshape(-1).astype(np.uint32) << 16).view(np.float32).reshape(u16.shape)


# ---- reading ----------------------------------------------------------------------------------

def _fail(path, problem: str) -> CheckpointError:
    return CheckpointError(f"{os.fspath(path)}: {problem}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_json(path, raw: bytes) -> dict:
    header = parse_json(raw, f"{os.fspath(path)}: header", CheckpointError, "the file is corrupt",
                        limit=MAX_HEADER_BYTES)
    if not isinstance(header, dict):
        raise _fail(path, f"header must be a JSON object, got {type(header).__name__}")
    return header


def _parse_metadata(path, value) -> dict[str, str]:
    ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    if not ok:
        raise _fail(path, "__metadata__ must be an object mapping strings to strings")
    return dict(value)


def _parse_entry(path, name: str, spec, data_len: int) -> TensorEntry:
    where = f"tensor {name!r}"
    if not isinstance(spec, dict):
        raise _fail(path, f"{where}: header entry must be an object, got {type(spec).__name__}")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in spec:
            raise _fail(path, f"{where}: header entry has no {key!r}")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _fail(path, f"{where}: unknown dtype {dtype!r} (supported: {', '.join(SUPPORTED_DTYPES)})")
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM:
        raise _fail(path, f"{where}: shape must be a list of at most {_MAX_NDIM} dims, got {shape!r:.80}")
    if not all(_is_int(d) and 0 <= d < _MAX_DIM for d in shape):
        raise _fail(path, f"{where}: shape dims must be non-negative integers, got {shape!r:.80}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise _fail(path, f"{where}: data_offsets must be [begin, end] integers, got {offsets!r:.80}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise _fail(path, f"{where}: data_offsets {offsets} need 0 <= begin <= end")
    if end > data_len:
        raise _fail(path, f"{where}: ends at byte {end} but the data section holds {data_len} bytes "
                          "(truncated file; re-download it)")
    nbits = math.prod(shape) * DTYPE_BITS[dtype]
    if nbits % 8 or nbits // 8 != end - begin:
        raise _fail(path, f"{where}: header lies: shape {shape} of {dtype} needs {nbits / 8:g} bytes "
                          f"but data_offsets span {end - begin}")
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_overlaps(path, entries: dict[str, TensorEntry]) -> None:
    spans = sorted((e.begin, e.end, n) for n, e in entries.items() if e.end > e.begin)
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise _fail(path, f"tensors {prev!r} and {name!r} overlap in the data section")


def read_header(path) -> Header:
    """Parse and validate a safetensors header without reading tensor data."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _fail(path, f"file is {size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte bound (corrupt file)")
            if n > size - 8:
                raise _fail(path, f"header length {n} runs past the end of the {size}-byte file (truncated?)")
            raw = f.read(n)
    except OSError as exc:
        raise _fail(path, f"cannot read safetensors file ({exc.strerror or exc})") from None
    header = _parse_json(path, raw)
    data_len = size - 8 - n
    metadata = _parse_metadata(path, header.pop("__metadata__")) if "__metadata__" in header else {}
    entries = {name: _parse_entry(path, name, spec, data_len) for name, spec in header.items()}
    _check_overlaps(path, entries)
    return Header(entries, metadata, 8 + n)


def read_tensors(path, header: Header, names) -> dict[str, np.ndarray]:
    """Read the named tensors (each of a READABLE_DTYPES dtype) into memory-owning arrays."""
    out = {}
    try:
        with open(path, "rb") as f:
            for name in names:
                entry = header.entries[name]
                dtype = READABLE_DTYPES[entry.dtype]
                f.seek(header.data_start + entry.begin)
                count = (entry.end - entry.begin) // dtype.itemsize
                # Copies rather than memmaps: a later rewrite of the file cannot pull data from
                # under an array the caller still holds.
                arr = np.fromfile(f, dtype=dtype, count=count)
                if arr.size != count:
                    raise _fail(path, f"tensor {name!r}: file shrank while reading")
                out[name] = arr.reshape(entry.shape)
    except OSError as exc:
        raise _fail(path, f"cannot read safetensors file ({exc.strerror or exc})") from None
    return out


# Per readable dtype: the unsigned view, the mask dropping the sign, and the first non-finite
# pattern (all exponent bits set: inf, then every NaN above it).
_NONFINITE_BITS = {"F32": (np.uint32, 0x7FFFFFFF, 0x7F800000), "F16": (np.uint16, 0x7FFF, 0x7C00),
                   "BF16": (np.uint16, 0x7FFF, 0x7F80), "F8_E4M3": (np.uint8, 0x7F, 0x7F)}  # e4m3fn: NaN only
_FINITE_CHUNK = 1 << 18  # elements per pass: the masked copy stays in cache


def all_finite(arr: np.ndarray, dtype: str) -> bool:
    """Whether every element of a tensor read as `dtype` (raw bits for BF16) is finite: one
    vectorised pass over the bits, in chunks, so the check costs no tensor-sized temporary."""
    view, mask, first_bad = _NONFINITE_BITS[dtype]
    bits = np.ascontiguousarray(arr).reshape(-1).view(view)
    for start in range(0, bits.size, _FINITE_CHUNK):
        if int(np.bitwise_and(bits[start:start + _FINITE_CHUNK], view(mask)).max()) >= first_bad:
            return False
    return True


def nonfinite_count(arr: np.ndarray, dtype: str) -> int:
    view, mask, first_bad = _NONFINITE_BITS[dtype]
    bits = np.ascontiguousarray(arr).reshape(-1).view(view)
    return int(np.count_nonzero(np.bitwise_and(bits, view(mask)) >= first_bad))


def _unsupported_message(names_dtypes) -> str:
    listed = ", ".join(f"{n!r} is {d}" for n, d in list(names_dtypes)[:10])
    return (f"unsupported dtype ({listed}); memra reads {', '.join(SUPPORTED_DTYPES)}: "
            "convert the checkpoint to bf16 or f32")


def read_safetensors(path) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """name -> (header dtype, shape, array): F32 float32, F16 float16, BF16 raw uint16 bits."""
    header = read_header(path)
    bad = [(n, e.dtype) for n, e in header.entries.items() if e.dtype not in SUPPORTED_DTYPES]
    if bad:
        raise _fail(path, _unsupported_message(bad))
    arrays = read_tensors(path, header, header.entries)
    return {n: (e.dtype, e.shape, arrays[n]) for n, e in header.entries.items()}


# ---- writing ----------------------------------------------------------------------------------

_WRITE_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


def _encode(arr: np.ndarray, dtype: str) -> bytes:
    f32 = np.ascontiguousarray(arr, dtype=np.float32)
    if dtype == "F32":
        return f32.astype("<f4").tobytes()
    return f32_to_bf16(f32).astype("<u2").tobytes()


def write_raw_safetensors(path, entries: dict[str, tuple[str, tuple[int, ...], bytes]], metadata=None) -> None:
    """Write pre-encoded tensors (name -> (dtype string, shape, bytes)) in sorted-name order.

    No checks on the dtype or byte counts: tests use it to build files of any dtype.
    """
    header: dict = {}
    if metadata is not None:
        if not (isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in metadata.items())):
            raise InputError("safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in sorted(entries):
        dtype, shape, data = entries[name]
        header[name] = {"dtype": dtype, "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(entries):
            f.write(entries[name][2])


def write_safetensors(path, tensors: dict[str, np.ndarray], dtype: str = "float32", metadata=None) -> None:
    """Write float tensors as F32 or BF16 (round-to-nearest-even) safetensors."""
    if dtype not in _WRITE_DTYPES:
        raise InputError(f"write dtype {dtype!r} is not supported: choose one of {sorted(_WRITE_DTYPES)}")
    code = _WRITE_DTYPES[dtype]
    entries = {}
    for name, arr in tensors.items():
        if not isinstance(name, str):
            raise InputError(f"tensor names must be strings, got {name!r}")
        arr = np.asarray(arr)
        entries[name] = (code, arr.shape, _encode(arr, code))
    write_raw_safetensors(path, entries, metadata)
