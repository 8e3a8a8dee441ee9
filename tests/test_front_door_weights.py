"""Weights that are not finite: a checkpoint holding NaN or inf is refused at load, naming the tensor.

Without the check such a checkpoint loads, and every logit row is NaN, so argmax decodes token 0
forever: silent garbage. Here one element of one tensor is poisoned, in each stored dtype (F32,
BF16 raw bits, F16) and each non-finite kind, and load_model must refuse with one CheckpointError
naming that tensor and the count. The extremes of each dtype that ARE finite still load.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import memra
from memra.errors import CheckpointError
from memra.safetensors_io import bf16_to_f32, f32_to_bf16, read_safetensors, write_raw_safetensors

POISONED = "model.layers.2.mlp.experts.3.up_proj.weight"
ENCODE = {  # dtype -> float32 array -> bytes as stored
    "F32": lambda a: a.astype("<f4").tobytes(),
    "BF16": lambda a: f32_to_bf16(a).astype("<u2").tobytes(),
    "F16": lambda a: a.astype("<f2").tobytes(),
}


def rewrite(src: str, dst, dtype: str, edit) -> str:
    """A copy of checkpoint `src` with every tensor stored as `dtype` after edit(name -> float32)."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = {n: (bf16_to_f32(a) if d == "BF16" else a.astype(np.float32)) for n, (d, _, a) in
               read_safetensors(path).items()}
    edit(tensors)
    write_raw_safetensors(path, {n: (dtype, a.shape, ENCODE[dtype](a)) for n, a in tensors.items()})
    return dst


def poison(value, count=1):
    def edit(tensors):
        flat = tensors[POISONED].reshape(-1)
        flat[-count:] = value
    return edit


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", list(ENCODE))
def test_a_non_finite_weight_is_refused_at_load_naming_the_tensor(fixture_dir, tmp_path, dtype, value):
    d = rewrite(fixture_dir("small"), tmp_path / "ckpt", dtype, poison(value, count=3))
    with pytest.raises(CheckpointError) as info:
        memra.load_model(d, backend="numpy")
    message = str(info.value)
    assert f"not finite: {POISONED} holds 3 NaN/inf values" in message and "\n" not in message
    assert "1 not finite" in message


def test_every_poisoned_tensor_is_counted_and_listed_in_details(fixture_dir, tmp_path):
    names = [f"model.layers.{i}.input_layernorm.weight" for i in range(6)]

    def edit(tensors):
        for name in names:
            tensors[name][0] = np.nan
    d = rewrite(fixture_dir("small"), tmp_path / "ckpt", "F32", edit)
    with pytest.raises(CheckpointError, match="6 not finite") as info:
        memra.load_model(d, backend="numpy")
    assert sorted(info.value.details) == sorted(f"not finite: {n} holds 1 NaN/inf values" for n in names)


@pytest.mark.parametrize("dtype, big", [("F32", 3.4e38), ("BF16", 3.38e38), ("F16", 65504.0)])
def test_the_largest_finite_values_of_each_dtype_still_load(fixture_dir, tmp_path, dtype, big):
    """The green arm: the check tests the exponent bits, so the top finite value is not inf."""
    d = rewrite(fixture_dir("small"), tmp_path / "ckpt", dtype, poison(big))
    model = memra.load_model(d, backend="numpy")
    assert model.cfg.vocab_size == 256
