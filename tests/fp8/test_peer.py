"""Peer gate (CPU): an FP8 checkpoint's logits equal those of the same model with dequantized
float32 weights (`fp8_fixture_twin`: e4m3 * scale_inv, every other tensor the bf16 fixture's)
within REL_TOL * max|logits|, on prime and on each decode step. The FP8 exact class and a plain
float32 matmul differ only in summation order (and the twin's one rounding of e4m3 * scale), so
the bound is tight; the red arm (the same twin with ONE FP8 matrix left unquantized) misses it.
"""

from __future__ import annotations

import numpy as np
import pytest

from memra.backend import get_backend
from memra.checkpoint import load_checkpoint, write_fixture
from memra.config import ModelConfig, preset
from memra.fixtures import fixture_tensor, fp8_fixture_twin
from memra.model.trunk import Glm5Model

REL_TOL = 1e-5  # observed ~1e-6 on `small`
SMALL = ModelConfig.from_dict(preset("small"))


def _logits(model, tokens, steps=4):
    cache = model.new_cache(64)
    out = [model.prime(tokens, cache)]
    for _ in range(steps):
        out.append(model.decode_step(int(np.argmax(out[-1])), cache))
    return np.stack(out)


@pytest.fixture(scope="module")
def fp8_logits(tmp_path_factory):
    path = write_fixture(tmp_path_factory.mktemp("fp8peer"), preset("small"), seed=1, dtype="fp8")
    model = Glm5Model(SMALL, load_checkpoint(path, SMALL, keep_bf16=True), get_backend("numpy"))
    return _logits(model, np.random.default_rng(0).integers(0, 256, 40))


def _twin_logits(twin):
    return _logits(Glm5Model(SMALL, twin, get_backend("numpy")), np.random.default_rng(0).integers(0, 256, 40))


def test_fp8_logits_match_the_dequantized_float32_model(fp8_logits):
    want = _twin_logits(fp8_fixture_twin(preset("small"), seed=1))
    assert np.abs(fp8_logits - want).max() <= REL_TOL * np.abs(want).max()


def test_red_arm_one_unquantized_matrix_misses_the_peer_bound(fp8_logits):
    twin = fp8_fixture_twin(preset("small"), seed=1)
    name = "layers.1.self_attn.q_b_proj.weight"
    twin[name] = fixture_tensor(name, twin[name].shape, SMALL, 1)
    assert np.abs(fp8_logits - _twin_logits(twin)).max() > REL_TOL * np.abs(fp8_logits).max()
