"""End to end through memra's plugin registry: `draft="ngram"` keeps the plain greedy tape."""

import pytest

from memra import generate, load_model, preset
from memra.checkpoint import write_fixture
from memra.drafters.registry import draft_source_origins, reset_registry

PROMPT = [160] * 8   # the small seed-13 model continues this run, which the lookup predicts
N = 40


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    reset_registry()
    path = write_fixture(str(tmp_path_factory.mktemp("small")), preset("small"), seed=13)
    return load_model(path, backend="numpy")


def test_the_plugin_is_registered_from_its_distribution():
    reset_registry()
    assert draft_source_origins()["ngram"] == "memra-ngram 0.1.0"


def test_ngram_keeps_the_plain_tape_for_every_k_and_some_drafts_land(model):
    tape = generate(model, PROMPT, N).tokens
    accepted = []
    for k in range(1, 15):
        spec = generate(model, PROMPT, N, draft="ngram", num_draft_tokens=k)
        assert spec.tokens == tape, f"K={k}"
        accepted.append(spec.stats["num_accepted_tokens"])
    assert max(accepted) > 0
