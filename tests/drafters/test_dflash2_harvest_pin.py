"""Which drafter output rows become drafts, pinned at the source: every round's proposal is
recomputed from the block forward with the convention's rows written out literally.

mask-fill (`dflash`) drafts from rows 1..k, shifted (`dspark`) from rows 0..k-1
(memra/drafters/dflash2/harvest.py). Reading the rows one off (the seed's harvest postmortem)
keeps the tape exact, since the target verifies every draft, so only a row-level reference sees
it: the drafted tokens, the selector's confidences and the confidence head's scores all come
from the harvested rows. test_a_harvest_one_row_off_is_caught is that red arm, run through the
same comparison.
"""

import numpy as np
import pytest

import memra
from memra.config import preset
from memra.drafters.dflash2 import DFlash2Source, write_fixture_drafter
from memra.drafters.dflash2.dense import dense_walk
from memra.drafters.dflash2.window import sigmoid
from memra.speculative.session import SpecSession

FIRST_ROW = {"dflash": 1, "dspark": 0}   # the conventions, literally: not read from harvest.py
PROMPT_LEN, MAX_CTX, N = 12, 96, 16
VARIANTS = {   # (checkpoint shape, harvest option)
    "dflash": ({"strategy": "dflash"}, None),
    "dspark": ({"strategy": "dspark"}, None),
    "dspark-markov-confidence": ({"strategy": "dspark", "with_markov": True, "with_confidence": True}, None),
    "dspark-harvested-as-dflash": ({"strategy": "dspark"}, "dflash"),
    "v1-dflash": ({"family": "dflash", "strategy": "dflash"}, None),          # the seed's format
    "v1-dspark-markov-confidence": ({"family": "dflash", "strategy": "dspark", "with_markov": True,
                                     "with_confidence": True}, None),
}


@pytest.fixture(scope="module")
def model(fixture_dir):
    return memra.load_model(fixture_dir("mini"), backend="numpy")


@pytest.fixture(scope="module")
def prompt(model):
    return [int(t) for t in np.random.default_rng(3).integers(0, model.cfg.vocab_size, PROMPT_LEN)]


def load(model, tmp_path_factory, variant):
    shape, harvest = VARIANTS[variant]
    path = write_fixture_drafter(tmp_path_factory.mktemp(variant), preset("mini"), seed=2, **shape)
    options = {"path": path, "window": "ladder", "adapt": False}
    if harvest:
        options["harvest"] = harvest
    return DFlash2Source().load(model, options)


def reference(drafter, kv, anchor: int, k: int, first_row: int):
    """(tokens, confidences) of a round drafted from rows first_row..first_row+k-1."""
    draft, cfg = drafter.draft, drafter.cfg
    hidden = draft.forward_block(kv, [anchor] + [cfg.mask_token_id] * (cfg.block_size - 1), kv.len)
    rows = hidden[first_row:first_row + k]
    bias = drafter.markov.row_bias if drafter.markov_bias else None
    if drafter.selector is None:
        walk = dense_walk(draft.logits(rows), anchor, row_bias=bias)
    else:
        walk = drafter.selector.walk(draft.logits(rows), rows, anchor, row_bias=bias)
    if drafter.confidence is None:
        return walk.path, walk.confidences
    embs = drafter.markov.embeddings([anchor] + walk.path[:-1]) if drafter.confidence.with_markov else None
    return walk.path, [sigmoid(r) for r in drafter.confidence.raw_scores(rows, embs)]


def off_rounds(session, k: int, first_row: int) -> tuple[list[str], int]:
    """Run the session; return the rounds whose proposal is not the reference's, and the count."""
    state, bad, rounds = session.state, [], [0]
    propose = state.propose

    def checked(kk, sampling):
        anchor = state.anchor
        prop = propose(kk, sampling)    # ingests first: state.kv now holds the committed context
        tokens, confs = reference(state.drafter, state.kv, anchor, kk, first_row)
        n = len(prop.tokens)
        if prop.tokens != tokens[:n] or not np.array_equal(prop.confidences, confs[:n]):
            bad.append(f"round {rounds[0]}: {prop.tokens} vs {tokens[:n]}")
        rounds[0] += 1
        return prop

    state.propose = checked
    out: list[int] = []
    while len(out) < N and not session.done:
        out.extend(session.burst(N - len(out), k)[0])
    return bad, rounds[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_round_drafts_from_the_conventions_rows(model, prompt, tmp_path_factory, variant):
    drafter = load(model, tmp_path_factory, variant)
    convention = VARIANTS[variant][1] or VARIANTS[variant][0]["strategy"]
    assert drafter.harvest.value == convention
    for k in (3, drafter.max_k):
        bad, rounds = off_rounds(SpecSession(model, prompt, drafter, MAX_CTX), k, FIRST_ROW[convention])
        assert rounds >= 3 and bad == []


@pytest.mark.parametrize("variant, wrong_first_row", [("dflash", 0), ("dflash", 2), ("dspark", 1), ("v1-dflash", 2)])
def test_a_harvest_one_row_off_is_caught(model, prompt, tmp_path_factory, variant, wrong_first_row):
    """Red arm: the comparison above, made against rows one off the convention, fails from the
    first round (the dspark case is the postmortem's: shifted rows harvested as mask-fill)."""
    drafter = load(model, tmp_path_factory, variant)
    k = 3
    bad, rounds = off_rounds(SpecSession(model, prompt, drafter, MAX_CTX), k, wrong_first_row)
    assert bad and bad[0].startswith("round 0:") and len(bad) == rounds
