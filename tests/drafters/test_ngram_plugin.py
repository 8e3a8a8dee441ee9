"""The installed memra-ngram plugin, through memra's registry: the plain tape for every K."""

import pytest

from memra import load_model
from memra.drafters import registry
from memra.generate import generate

N = 40
CASES = {  # preset -> (fixture seed, a prompt whose continuation the n-gram lookup partly predicts)
    "mini": (0, [1, 2, 3, 4, 1, 2, 3, 4]),
    "small": (13, [160] * 8),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, fixture_dir):
    registry.reset_registry()
    if "ngram" not in registry.list_draft_sources():
        pytest.skip("the ngram plugin is not installed: pip install -e plugins/memra-ngram")
    seed, prompt = CASES[request.param]
    model = load_model(fixture_dir(request.param, seed=seed), backend="numpy")
    return model, prompt, generate(model, prompt, N).tokens


@pytest.mark.parametrize("k", range(1, 15))
def test_ngram_keeps_the_plain_tape(case, k):
    model, prompt, tape = case
    spec = generate(model, prompt, N, draft="ngram", num_draft_tokens=k, draft_options={"n": 3, "min_n": 1})
    assert spec.tokens == tape


def test_ngram_drafts_land_on_these_prompts(case):
    """Guards the tape tests above: they must exercise accepted drafts, not only rejections."""
    model, prompt, tape = case
    spec = generate(model, prompt, N, draft="ngram", num_draft_tokens=4)
    assert spec.tokens == tape and spec.stats["num_accepted_tokens"] > 0
