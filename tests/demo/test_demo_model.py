"""The shipped demo model on numpy: the held-out loss its model card states, greedy speculative
tapes byte-identical to plain for both shipped draft sources, and acceptance far from zero.

The excerpt is the first tokens of held-out files (never trained on) named by the card, read from
this interpreter's standard library only where their sha256 matches training/manifest; the card's
number for it was computed by training/export.py with transformers' model, not memra's."""

import json
from pathlib import Path

import pytest

from benchmarks.heldout import excerpt_ids
from memra import demo_model, load_model
from memra.demo_model.score import heldout_nats
from memra.generate import generate
from memra.tokenizer import load_tokenizer

CARD = json.loads((Path(demo_model.__file__).parent / "card.json").read_text())


@pytest.fixture(scope="module")
def model():
    return load_model(demo_model.TARGET, backend="numpy")


@pytest.fixture(scope="module")
def excerpt(model):
    spec = CARD["heldout_excerpt"]
    tok = load_tokenizer(demo_model.TARGET, model.cfg.vocab_size)
    ids = excerpt_ids(tok, spec["files"], spec["tokens_per_file"], model.cfg.eos_token_id[0])
    if ids is None:
        pytest.skip(f"the card's held-out files {spec['files']} are not in this interpreter's stdlib "
                    "with their recorded sha256")
    assert len(ids) == spec["tokens"]
    return ids


def test_the_held_out_loss_is_the_one_the_model_card_states(model, excerpt):
    nats = heldout_nats(model, excerpt)
    stated = CARD["heldout_excerpt_nats"]
    assert abs(nats - stated) <= 0.01 * stated, (nats, stated)
    assert nats < 0.5 * 9.01  # it has learned something: a uniform guess over 8192 ids is ln 8192 = 9.01


def test_a_red_arm_bites_the_loss_check(model, excerpt):
    """The check is not vacuous: the excerpt with every id moved by one scores far from the card."""
    wrong = [(t + 1) % model.cfg.vocab_size for t in excerpt[:256]]
    assert abs(heldout_nats(model, wrong) - CARD["heldout_excerpt_nats"]) > 0.01 * CARD["heldout_excerpt_nats"]


@pytest.mark.parametrize("draft", ["native-mtp", "dflash2"])
def test_greedy_spec_equals_plain_and_accepts_far_from_zero(model, excerpt, draft):
    options = {"path": demo_model.DFLASH2} if draft == "dflash2" else None
    accepted = drafted = 0
    for start in (0, 257, 514):
        prompt = excerpt[start + 16:start + 80]
        plain = generate(model, prompt, 40).tokens
        spec = generate(model, prompt, 40, draft=draft, num_draft_tokens=4, draft_options=options)
        assert spec.tokens == plain
        accepted += spec.stats["num_accepted_tokens"]
        drafted += spec.stats["num_draft_tokens"]
    assert accepted / drafted > 0.2, (draft, accepted, drafted)  # random weights accept ~0
