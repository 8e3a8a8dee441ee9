"""A checkpoint whose weights are finite but overflow float32 inside the model (here a final norm
weight of 3e38) is refused with a CheckpointError once its prompt is primed: NaN wins every argmax,
so greedy decoding would print token 0 over and over (the red arm shows it does, unchecked)."""

import shutil

import numpy as np
import pytest
from cli_helpers import run_cli
from safetensors.numpy import load_file, save_file

import memra
from memra.errors import CheckpointError
from memra.model import trunk

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow itself


@pytest.fixture(scope="module")
def overflowing_dir(fixture_dir, tmp_path_factory):
    path = shutil.copytree(fixture_dir("small"), tmp_path_factory.mktemp("overflow") / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = np.full_like(tensors["model.norm.weight"], 3e38)
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def overflowing(overflowing_dir):
    return memra.load_model(overflowing_dir, backend="numpy")


@pytest.mark.parametrize("draft", [None, "native-mtp"])
def test_logits_that_overflow_are_refused_naming_the_checkpoint(overflowing, draft):
    with pytest.raises(CheckpointError, match="logits after the prompt are not finite .* overflow float32"):
        memra.generate(overflowing, PROMPT, 4, draft=draft)


def test_red_arm_unchecked_the_same_model_prints_token_zero(overflowing, monkeypatch):
    monkeypatch.setattr(trunk, "_finite_logits", lambda row: row)
    assert memra.generate(overflowing, PROMPT, 4, draft=None).tokens == [0, 0, 0, 0]


def test_the_cli_says_it_in_one_line(overflowing_dir):
    """No numpy overflow warning before it: the run's own check judges the numbers."""
    proc = run_cli("--checkpoint", overflowing_dir, "--prompt-ids", "1,2,3", "-n", "2")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("memra: the logits after the prompt are not finite")
