"""Fixtures shared by the draft-source contract tests: a `model` (`mini` on numpy; a module may
param over more with battery.model_fixture), a prompt for it, and plain decoding's tape of 60
tokens after that prompt (a module may define its own length)."""

import pytest

from memra import load_model

from .battery import plain_tape, prompt_ids


@pytest.fixture(scope="module")
def model(fixture_dir):
    return load_model(fixture_dir("mini"), backend="numpy")


@pytest.fixture(scope="module")
def prompt(model):
    return prompt_ids(model)


@pytest.fixture(scope="module")
def tape(model, prompt):
    return plain_tape(model, prompt, 60)
