"""Loading the FP8 release format (memra/checkpoint_fp8.py, memra/fixtures.py dtype="fp8").

* the FP8 fixture round-trips: the release's FP8/BF16/F32 split, each FP8 tensor an Fp8Block that
  dequantizes to `fp8_fixture_twin`, every other tensor the bf16 fixture's value;
* FP8-ness comes from the `_scale_inv` sibling, never the name: o_proj is FP8 on DSA layers only;
* every FP8 kind memra does not read is refused by name, in the one contract error: e5m2, an e4m3
  tensor without scales, per-tensor / per-channel / misshaped scales, non-F32, non-finite or
  non-positive scales, NaN weight codes, FP8 where the release keeps BF16, scales of a BF16
  tensor, and a quantization_config other than fine-grained fp8 [128, 128] e4m3 dynamic.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from memra.backend.fp8 import Fp8Block, dequantize
from memra.checkpoint import load_checkpoint, write_fixture
from memra.config import ModelConfig, preset
from memra.errors import CheckpointError
from memra.fixtures import fp8_fixture_twin
from memra.safetensors_io import bf16_to_f32, read_header, write_raw_safetensors

SMALL = ModelConfig.from_dict(preset("small"))
ST = "model.safetensors"


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("fp8"), preset("small"), seed=2, dtype="fp8")


def _raw(path):
    header = read_header(path)
    with open(path, "rb") as f:
        blob = f.read()
    return {n: (e.dtype, e.shape, blob[header.data_start + e.begin:header.data_start + e.end])
            for n, e in header.entries.items()}


def _copy(src, dst, edit=None, config=None):
    """A copy of checkpoint src in dst with its raw entries edited (name -> entry, None drops)."""
    os.makedirs(dst, exist_ok=True)
    entries = _raw(os.path.join(src, ST))
    for name, entry in (edit or {}).items():
        if entry is None:
            entries.pop(name)
        else:
            entries[name] = entry
    write_raw_safetensors(os.path.join(dst, ST), entries)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.update(config or {})
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


def _refusal(path) -> str:
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, SMALL, keep_bf16=True)
    return str(err.value)


def _f32(arr):
    return ("F32", arr.shape, np.ascontiguousarray(arr, "<f4").tobytes())


Q_A = "model.layers.1.self_attn.q_a_proj.weight"  # FP8 in the release (a DSA layer), [32, 64]


def test_fp8_fixture_round_trips_to_its_dequantized_twin(fp8_dir):
    weights = load_checkpoint(fp8_dir, SMALL, keep_bf16=True)
    twin = fp8_fixture_twin(preset("small"), seed=2)
    assert weights.keys() == twin.keys()
    for name, w in weights.items():
        got = dequantize(w) if isinstance(w, Fp8Block) else (bf16_to_f32(w) if w.dtype == np.uint16 else w)
        assert got.tobytes() == twin[name].tobytes(), name
    fp8 = {n for n, w in weights.items() if isinstance(w, Fp8Block)}
    assert "layers.1.self_attn.o_proj.weight" in fp8 and "layers.0.self_attn.o_proj.weight" not in fp8  # DSA / KDA
    assert {"layers.1.self_attn.kv_b_proj.weight", "lm_head.weight", "layers.1.mlp.gate.weight",
            "layers.1.self_attn.indexer.wk.weight", "layers.6.eh_proj.weight"}.isdisjoint(fp8)
    assert {"layers.0.mlp.down_proj.weight", "layers.1.mlp.experts.7.up_proj.weight",
            "layers.6.self_attn.q_b_proj.weight", "layers.2.mlp.shared_experts.gate_proj.weight"} <= fp8
    kinds = {e[0] for e in _raw(os.path.join(fp8_dir, ST)).values()}
    assert kinds == {"F8_E4M3", "F32", "BF16"}
    qc = json.load(open(os.path.join(fp8_dir, "config.json")))["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]


def test_fp8_is_decided_by_the_scale_sibling_not_the_name(fp8_dir, tmp_path):
    """The same q_a_proj dequantized to BF16 (no sibling) loads as a plain BF16 matrix."""
    from memra.safetensors_io import f32_to_bf16
    raw = _raw(os.path.join(fp8_dir, ST))
    w = load_checkpoint(fp8_dir, SMALL, keep_bf16=True)["layers.1.self_attn.q_a_proj.weight"]
    bf16 = f32_to_bf16(dequantize(w))
    path = _copy(fp8_dir, tmp_path, {Q_A: ("BF16", bf16.shape, bf16.astype("<u2").tobytes()), Q_A + "_scale_inv": None})
    got = load_checkpoint(path, SMALL, keep_bf16=True)["layers.1.self_attn.q_a_proj.weight"]
    assert got.dtype == np.uint16 and np.array_equal(got, bf16)
    assert raw[Q_A][0] == "F8_E4M3"


def _scale(shape, value=1.0):
    return _f32(np.full(shape, value, np.float32))


REFUSALS = {
    "e5m2": ({Q_A: ("F8_E5M2", (32, 64), bytes(32 * 64))}, "is F8_E5M2 .*F8_E4M3 with"),
    "no scale sibling": ({Q_A + "_scale_inv": None}, "is F8_E4M3 without its .*q_a_proj.weight_scale_inv"),
    "per-tensor scale": ({}, "a per-tensor scale of shape \\[\\]"),
    "per-channel scale": ({Q_A + "_scale_inv": _scale((32,))}, "per-channel scales of shape \\[32\\]"),
    "misshaped grid": ({Q_A + "_scale_inv": _scale((1, 2))}, "a scale grid of shape \\[1, 2\\].*shape \\[1, 1\\]"),
    "bf16 scale": ({Q_A + "_scale_inv": ("BF16", (1, 1), b"\x80\x3f")}, "are BF16, memra reads F32 scales"),
    "e4m3 scale": ({Q_A + "_scale_inv": ("F8_E4M3", (1, 1), b"\x38")}, "are F8_E4M3, memra reads F32 scales"),
    "zero scale": ({Q_A + "_scale_inv": _scale((1, 1), 0.0)}, "1 scales that are not finite and positive"),
    "negative scale": ({Q_A + "_scale_inv": _scale((1, 1), -2.0)}, "not finite and positive"),
    "nan scale": ({Q_A + "_scale_inv": _scale((1, 1), np.nan)}, "not finite and positive"),
    "nan weight code": ({Q_A: ("F8_E4M3", (32, 64), b"\x7f" + bytes(32 * 64 - 1))}, "q_a_proj.weight holds 1 NaN"),
    "fp8 where the release keeps bf16": (
        {"model.layers.0.self_attn.o_proj.weight": ("F8_E4M3", (64, 64), bytes(64 * 64)),
         "model.layers.0.self_attn.o_proj.weight_scale_inv": _scale((1, 1))},
        "layers.0.self_attn.o_proj.weight is F8_E4M3, but the release keeps this tensor in BF16"),
    "fp8 lm_head": ({"lm_head.weight": ("F8_E4M3", (256, 64), bytes(256 * 64)),
                     "lm_head.weight_scale_inv": _scale((2, 1))}, "lm_head.weight is F8_E4M3, but the release keeps"),
    "scales of a bf16 tensor": ({"model.layers.1.self_attn.kv_b_proj.weight_scale_inv": _scale((1, 1))},
                                "kv_b_proj.weight_scale_inv scales .*kv_b_proj.weight, which is BF16"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_unreadable_fp8_kind_is_refused_by_name(fp8_dir, tmp_path, case):
    edit, pattern = REFUSALS[case]
    if case == "per-tensor scale":
        edit = {Q_A + "_scale_inv": ("F32", (), np.float32(1).tobytes())}
        # a 1x1 grid is also one number: give the tensor two column blocks so the grid is [1, 2]
        edit[Q_A] = ("F8_E4M3", (32, 200), bytes(32 * 200))
    msg = _refusal(_copy(fp8_dir, tmp_path, edit))
    assert __import__("re").search(pattern, msg), msg


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size None"),
    ({"quant_method": "fp8", "weight_block_size": [1, 128]}, "weight_block_size \\[1, 128\\]"),
    ({"quant_method": "fp8", "weight_block_size": 128}, "weight_block_size 128"),
    ({"quant_method": "fp8", "weight_block_size": True}, "weight_block_size True"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
])
def test_a_quantization_config_other_than_fine_grained_fp8_is_refused(fp8_dir, tmp_path, qc, named):
    msg = _refusal(_copy(fp8_dir, tmp_path, config={"quantization_config": qc}))
    assert __import__("re").search(named, msg) and "fine-grained fp8" in msg, msg


def test_an_absent_quantization_config_leaves_the_tensors_to_decide(fp8_dir, tmp_path):
    path = _copy(fp8_dir, tmp_path)
    cfg = json.load(open(os.path.join(path, "config.json")))
    del cfg["quantization_config"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    assert isinstance(load_checkpoint(path, SMALL, keep_bf16=True)[Q_A[len("model."):]], Fp8Block)


def test_every_fp8_offender_is_named_in_one_error(fp8_dir, tmp_path):
    edit = {**REFUSALS["e5m2"][0], **REFUSALS["fp8 lm_head"][0], **REFUSALS["scales of a bf16 tensor"][0]}
    msg = _refusal(_copy(fp8_dir, tmp_path, edit))
    # the e5m2 tensor's own scales are named too: they scale a tensor that is not F8_E4M3
    assert "4 fp8 format" in msg
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(_copy(fp8_dir, tmp_path, edit), SMALL)
    details = "\n".join(err.value.details)
    for needle in ("q_a_proj.weight is F8_E5M2", "lm_head.weight is F8_E4M3", "kv_b_proj.weight_scale_inv scales",
                   "q_a_proj.weight_scale_inv scales model.layers.1.self_attn.q_a_proj.weight, which is F8_E5M2"):
        assert needle in details, needle
