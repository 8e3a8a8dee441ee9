"""Shared fixtures: checkpoints written once per session by memra's own fixture writer."""

import pytest

from memra.checkpoint import write_fixture
from memra.config import preset


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    """fixture_dir(name, seed=0, dtype="float32") -> a checkpoint directory for a preset."""
    made = {}

    def make(name: str, seed: int = 0, dtype: str = "float32") -> str:
        key = (name, seed, dtype)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{name}-{seed}-{dtype}")
            made[key] = write_fixture(str(path), preset(name), seed=seed, dtype=dtype)
        return made[key]

    return make


@pytest.fixture(scope="session")
def no_mtp_dir(tmp_path_factory):
    """The `small` preset without its MTP block (seed 1): a checkpoint native-mtp cannot draft for."""
    cfg = {**preset("small"), "num_nextn_predict_layers": 0}
    return write_fixture(tmp_path_factory.mktemp("no-mtp"), cfg, seed=1)
