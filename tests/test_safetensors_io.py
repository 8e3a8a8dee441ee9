"""memra's own safetensors parser: exact round trips, bf16 rounding, interop, and strict refusals."""

import json
import struct
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memra.errors import CheckpointError, InputError
from memra.safetensors_io import (
    bf16_to_f32, f32_to_bf16, read_header, read_safetensors, write_raw_safetensors, write_safetensors,
)


def _pack(header, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _write(tmp_path, blob: bytes, name="t.safetensors"):
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


# ---- bf16 rounding against a value-based reference --------------------------------------------

def _f32_value(bits: int) -> Fraction:
    return Fraction(struct.unpack("<f", struct.pack("<I", bits))[0])


def _bf16_value(b16: int) -> Fraction:
    if b16 & 0x7FFF == 0x7F80:  # infinity: the next step of the exponent ladder, 2**128
        return Fraction(2**128) * (-1 if b16 & 0x8000 else 1)
    return _f32_value(b16 << 16)


def _reference_bf16(x: np.float32) -> int:
    """Nearest bf16 by exact rational distance; ties go to the even mantissa."""
    bits = int(np.float32(x).view(np.uint32))
    if bits & 0x7FFFFFFF == 0x7F800000:
        return bits >> 16
    low = bits >> 16
    high = low + 1  # next bf16 away from zero (same sign)
    target = _f32_value(bits)
    d_low, d_high = abs(target - _bf16_value(low)), abs(_bf16_value(high) - target)
    if d_low != d_high:
        return low if d_low < d_high else high
    return low if low % 2 == 0 else high


def _interesting_f32(n: int = 3000) -> np.ndarray:
    rng = np.random.default_rng(7)
    random_bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    # Exact ties (low half == 0x8000) with odd and even kept mantissas, just-above/below ties,
    # the overflow edge to infinity, subnormals, zeros.
    ties = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF818000, 0x7F7F8000,
                     0x7F7FFFFF, 0xFF7F8000, 0x00008000, 0x00018000, 0x00000001, 0, 0x80000000,
                     0x7F800000, 0xFF800000], dtype=np.uint32)
    bits = np.concatenate([random_bits, ties])
    bits = bits[(bits & 0x7FFFFFFF) <= 0x7F800000]  # NaNs are checked separately
    return bits.view(np.float32)


def test_bf16_rounding_matches_exact_nearest_even_reference():
    x = _interesting_f32()
    got = f32_to_bf16(x)
    want = np.array([_reference_bf16(v) for v in x], dtype=np.uint16)
    assert np.array_equal(got, want)


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    x = _interesting_f32()
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(f32_to_bf16(x), want)


def test_bf16_rounds_ties_to_even():
    one_plus_half_ulp = np.array([0x3F808000, 0x3F818000], dtype=np.uint32).view(np.float32)
    assert f32_to_bf16(one_plus_half_ulp).tolist() == [0x3F80, 0x3F82]


def test_bf16_nan_stays_nan_and_keeps_its_sign():
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF], dtype=np.uint32)
    out = f32_to_bf16(nans.view(np.float32))
    assert np.isnan(bf16_to_f32(out)).all()
    assert ((out >> 15) == (nans >> 31)).all()


def test_bf16_widening_is_exact_for_every_bit_pattern():
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    wide = bf16_to_f32(every)
    finite = ~np.isnan(wide)
    assert np.array_equal(f32_to_bf16(wide)[finite], every[finite])
    assert np.array_equal(wide.view(np.uint32) >> 16, every.astype(np.uint32))


# ---- round trips and interop ------------------------------------------------------------------

def _sample_tensors():
    rng = np.random.default_rng(1)
    return {"b.w": rng.standard_normal((3, 5)).astype(np.float32),
            "a.bias": rng.standard_normal(7).astype(np.float32),
            "scalar": np.float32(2.5).reshape(()), "empty": np.zeros((0, 4), np.float32)}


def test_f32_round_trip_is_exact(tmp_path):
    tensors = _sample_tensors()
    write_safetensors(tmp_path / "f.safetensors", tensors, metadata={"format": "pt"})
    got = read_safetensors(tmp_path / "f.safetensors")
    assert set(got) == set(tensors)
    for name, arr in tensors.items():
        dtype, shape, loaded = got[name]
        assert (dtype, shape, loaded.dtype) == ("F32", arr.shape, np.float32)
        assert np.array_equal(loaded, arr)
    assert read_header(tmp_path / "f.safetensors").metadata == {"format": "pt"}


def test_bf16_round_trip_stores_rounded_bits(tmp_path):
    tensors = _sample_tensors()
    write_safetensors(tmp_path / "b.safetensors", tensors, dtype="bfloat16")
    got = read_safetensors(tmp_path / "b.safetensors")
    for name, arr in tensors.items():
        dtype, shape, raw = got[name]
        assert (dtype, shape, raw.dtype) == ("BF16", arr.shape, np.uint16)
        assert np.array_equal(raw, f32_to_bf16(arr))


def test_header_is_padded_to_eight_bytes_with_sorted_contiguous_tensors(tmp_path):
    write_safetensors(tmp_path / "p.safetensors", _sample_tensors())
    blob = (tmp_path / "p.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    assert n % 8 == 0 and blob[8 + n - 1:8 + n] in (b" ", b"}")
    names = sorted(header)
    ends = [0] + [header[k]["data_offsets"][1] for k in names]
    assert [header[k]["data_offsets"][0] for k in names] == ends[:-1]
    assert ends[-1] == len(blob) - 8 - n


def test_official_safetensors_loads_our_files(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    tensors = _sample_tensors()
    write_safetensors(tmp_path / "f.safetensors", tensors)
    write_safetensors(tmp_path / "b.safetensors", tensors, dtype="bfloat16")
    f32, b16 = load_file(tmp_path / "f.safetensors"), load_file(tmp_path / "b.safetensors")
    for name, arr in tensors.items():
        assert np.array_equal(f32[name].numpy(), arr)
        assert b16[name].dtype == torch.bfloat16
        assert np.array_equal(b16[name].float().numpy(), bf16_to_f32(f32_to_bf16(arr)))


def test_we_load_files_from_official_safetensors(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    x = torch.randn(4, 6)
    save_file({"x32": x, "x16": x.half(), "xb": x.bfloat16()}, tmp_path / "o.safetensors")
    got = read_safetensors(tmp_path / "o.safetensors")
    assert np.array_equal(got["x32"][2], x.numpy())
    assert got["x16"][0] == "F16" and np.array_equal(got["x16"][2], x.half().numpy())
    assert np.array_equal(bf16_to_f32(got["xb"][2]), x.bfloat16().float().numpy())


def test_writer_refuses_unknown_dtype_and_non_string_metadata(tmp_path):
    with pytest.raises(InputError, match="float16"):
        write_safetensors(tmp_path / "x.safetensors", {"w": np.zeros(2)}, dtype="float16")
    with pytest.raises(InputError, match="metadata"):
        write_safetensors(tmp_path / "x.safetensors", {"w": np.zeros(2)}, metadata={"k": 1})


# ---- strict header validation -----------------------------------------------------------------

_GOOD = {"w": _entry()}
_DATA = b"\0" * 8

CORRUPTIONS = {
    "empty file": (b"", "shorter than the 8-byte"),
    "shorter than 8 bytes": (b"\x10\0\0", "shorter than the 8-byte"),
    "header length past end of file": (_pack(_GOOD, _DATA, length=4096), "runs past the end"),
    "absurd header length": (_pack(_GOOD, _DATA, length=2**40), "exceeds the"),
    "header not utf-8": (_pack(b"\xff\xfe{}  "), "not UTF-8"),
    "header not json": (_pack(b"{nope"), "not valid JSON"),
    "header deeply nested": (_pack(b"[" * 100000), "not valid JSON|must be a JSON object"),
    "header not an object": (_pack([1, 2]), "must be a JSON object"),
    "duplicate tensor name": (_pack(b'{"w":' + json.dumps(_entry()).encode() + b',"w":'
                                    + json.dumps(_entry()).encode() + b"}", _DATA), "duplicate key"),
    "entry not an object": (_pack({"w": 5}), "must be an object"),
    "entry without dtype": (_pack({"w": {"shape": [2], "data_offsets": [0, 8]}}, _DATA), "no 'dtype'"),
    "entry without shape": (_pack({"w": {"dtype": "F32", "data_offsets": [0, 8]}}, _DATA), "no 'shape'"),
    "entry without offsets": (_pack({"w": {"dtype": "F32", "shape": [2]}}, _DATA), "no 'data_offsets'"),
    "unknown dtype": (_pack({"w": _entry("Q7")}, _DATA), "unknown dtype 'Q7' .*F32, F16, BF16"),
    "unsupported I64": (_pack({"w": _entry("I64", (1,))}, _DATA), "'w' is I64.*F32, F16, BF16"),
    "unsupported F8_E4M3": (_pack({"w": _entry("F8_E4M3", (8,))}, _DATA), "'w' is F8_E4M3"),
    "negative dim": (_pack({"w": _entry(shape=(-2,))}, _DATA), "non-negative integers"),
    "float dim": (_pack({"w": _entry(shape=(2.0,))}, _DATA), "non-negative integers"),
    "dim past int64 on an empty tensor": (_pack({"w": _entry(shape=(0, 2**64), offsets=(0, 0))}),
                                          "non-negative integers"),
    "bool dim": (_pack({"w": _entry(shape=(True, 2))}, _DATA), "non-negative integers"),
    "shape not a list": (_pack({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, _DATA), "shape must"),
    "offsets not a pair": (_pack({"w": _entry(offsets=(0, 4, 8))}, _DATA), r"\[begin, end\]"),
    "offsets not ints": (_pack({"w": _entry(offsets=(0, "8"))}, _DATA), r"\[begin, end\]"),
    "offsets reversed": (_pack({"w": _entry(offsets=(8, 0))}, _DATA), "begin <= end"),
    "offsets negative": (_pack({"w": _entry(offsets=(-8, 0))}, _DATA), "begin <= end"),
    "truncated data": (_pack(_GOOD, _DATA[:5]), "truncated file"),
    "header lies about size": (_pack({"w": _entry(shape=(3,))}, _DATA), "header lies"),
    "overlapping tensors": (_pack({"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(4, 12))}, b"\0" * 12),
                            "overlap"),
    "metadata not strings": (_pack({"__metadata__": {"k": 1}, **_GOOD}, _DATA), "__metadata__"),
    "metadata not an object": (_pack({"__metadata__": ["k"], **_GOOD}, _DATA), "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_file_raises_checkpoint_error_naming_file_and_problem(tmp_path, case):
    blob, problem = CORRUPTIONS[case]
    path = _write(tmp_path, blob, "bad_file.safetensors")
    with pytest.raises(CheckpointError, match=problem) as info:
        read_safetensors(path)
    assert "bad_file.safetensors" in str(info.value)


def test_valid_counterpart_of_the_corruptions_loads(tmp_path):
    blob = _pack({"__metadata__": {"format": "pt"}, "a": _entry(offsets=(0, 8)),
                  "b": _entry("BF16", (2, 2), (8, 16)), "z": _entry(shape=(0, 3), offsets=(16, 16))},
                 b"\0" * 16)
    got = read_safetensors(_write(tmp_path, blob))
    assert got["b"][1] == (2, 2) and got["z"][2].shape == (0, 3)


@pytest.mark.parametrize("where", ["missing", "directory"])
def test_unreadable_path_raises_checkpoint_error(tmp_path, where):
    path = tmp_path / "nope.safetensors" if where == "missing" else tmp_path
    with pytest.raises(CheckpointError, match="cannot read"):
        read_safetensors(path)


# ---- fuzzing: anything either loads or is a CheckpointError -----------------------------------

def _valid_blob(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "valid.safetensors"
    rng = np.random.default_rng(0)
    write_raw_safetensors(path, {
        "a": ("F32", (2, 3), rng.standard_normal(6).astype("<f4").tobytes()),
        "b": ("BF16", (4,), f32_to_bf16(rng.standard_normal(4).astype(np.float32)).tobytes()),
        "c": ("F16", (1, 2), rng.standard_normal(2).astype("<f2").tobytes()),
    }, metadata={"format": "pt"})
    return path.read_bytes()


def _load_or_refuse(path) -> None:
    try:
        got = read_safetensors(path)
    except CheckpointError:
        return
    for dtype, shape, arr in got.values():
        assert arr.shape == shape and dtype in ("F32", "F16", "BF16")


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzzcases"), _valid_blob(tmp_path_factory)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 400)), tail=st.binary(max_size=16))
def test_mutated_file_loads_or_raises_checkpoint_error(fuzz_dir, edits, cut, tail):
    directory, valid = fuzz_dir
    blob = bytearray(valid)
    for pos, byte in edits:
        if pos < len(blob):
            blob[pos] = byte
    blob = bytes(blob[:cut]) + tail if cut is not None else bytes(blob)
    _load_or_refuse(_write(directory, blob, "mutated.safetensors"))


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
_dims = st.lists(st.integers(-3, 2**64) | st.just(2) | st.just(0), max_size=4)
_entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "F8_E4M3", "F4", "Q7", 3]),
    "shape": _dims | _json,
    "data_offsets": st.lists(st.integers(0, 40), min_size=2, max_size=2)
    | st.lists(st.integers(-4, 40), max_size=3) | _json,
})
_headers = st.dictionaries(st.sampled_from(["a", "b", "__metadata__", ""]), _entries | _json, max_size=4) | _json


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=_headers, data=st.binary(max_size=40))
def test_random_header_loads_or_raises_checkpoint_error(fuzz_dir, header, data):
    directory, _ = fuzz_dir
    raw = json.dumps(header, allow_nan=True).encode()
    _load_or_refuse(_write(directory, _pack(raw, data), "random_header.safetensors"))
