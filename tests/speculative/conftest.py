"""Fixtures shared by the draft-source contract tests: the `mini` model on numpy, a prompt for it,
and plain decoding's tape of 60 tokens after that prompt (a module may define its own)."""

import pytest

from memra import load_model

from .battery import plain_tape, prompt_ids


@pytest.fixture(scope="module")
def mini(fixture_dir):
    return load_model(fixture_dir("mini"), backend="numpy")


@pytest.fixture(scope="module")
def prompt(mini):
    return prompt_ids(mini)


@pytest.fixture(scope="module")
def tape(mini, prompt):
    return plain_tape(mini, prompt, 60)
