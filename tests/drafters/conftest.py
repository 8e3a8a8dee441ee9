"""Fixtures of the draft-source tests."""

import pytest

from memra import load_model


@pytest.fixture(scope="module")
def target(fixture_dir):
    """The `small` target on numpy: what the DFlash2 network tests draft for."""
    return load_model(fixture_dir("small"), backend="numpy")
