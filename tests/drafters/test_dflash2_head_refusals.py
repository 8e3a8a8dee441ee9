"""The optional heads' loading refusals: a confidence head without its bias (or bias without its
weight), and a confidence head whose input width is neither hidden nor hidden + markov rank.
Each refusal is one CheckpointError naming the tensor, its shape and the widths that would fit;
the green arms beside them load the same checkpoints before the edit."""

import numpy as np
import pytest

from memra.drafters.dflash2 import DflashDraft
from memra.errors import CheckpointError

from .dflash2_helpers import F32, drafter, rewrite

H, RANK = 64, 16   # the small target's hidden size; the fixture's markov rank (selector_rank)


def test_a_confidence_head_loads_with_its_bias(tmp_path, target):
    for name, shape, width in (("plain", {}, H), ("markov", {"with_markov": True}, H + RANK)):
        draft = DflashDraft.load(drafter(tmp_path, name, with_confidence=True, **shape), target, precision="f32")
        assert draft.conf_w.shape == (width,) and isinstance(draft.conf_b, float)


@pytest.mark.parametrize("dropped, kept", [("confidence_head.bias", "confidence_head.weight"),
                                           ("confidence_head.weight", "confidence_head.bias")])
def test_a_confidence_head_without_its_other_half_is_refused(tmp_path, target, dropped, kept):
    d = drafter(tmp_path, with_confidence=True, strategy="dspark")
    rewrite(d, lambda t: t.pop(dropped))
    with pytest.raises(CheckpointError, match=rf"{kept} \[1(, {H})?\] has no {dropped} beside it"):
        DflashDraft.load(d, target)


def test_a_confidence_head_spelled_the_seeds_way_without_its_bias_is_refused(tmp_path, target):
    d = drafter(tmp_path, with_confidence=True)

    def edit(t):
        t["confidence_head.proj.weight"] = t.pop("confidence_head.weight")
        del t["confidence_head.bias"]
    rewrite(d, edit)
    with pytest.raises(CheckpointError, match="has no confidence_head.bias beside it"):
        DflashDraft.load(d, target)


@pytest.mark.parametrize("markov, width, fits", [
    (False, H + RANK, f"1, {H} \\(hidden_size\\)"),                       # a markov-trained head, no markov head
    (False, H - 1, f"1, {H} \\(hidden_size\\)"),
    (True, H + RANK + 1, f"1, {H} \\(hidden_size\\) or {H + RANK} \\(hidden_size \\+ markov rank\\)"),
    (True, RANK, f"1, {H} \\(hidden_size\\) or {H + RANK}"),
])
def test_a_confidence_head_of_another_width_is_refused_naming_both_fits(tmp_path, target, markov, width, fits):
    d = drafter(tmp_path, with_confidence=True, with_markov=markov)
    rewrite(d, lambda t: t.update({"confidence_head.weight": np.ones((1, width), F32)}))
    with pytest.raises(CheckpointError, match=rf"confidence_head.weight is \[1, {width}\], and its input must be \[{fits}"):
        DflashDraft.load(d, target)


def test_a_confidence_weight_that_is_not_one_row_is_refused(tmp_path, target):
    d = drafter(tmp_path, with_confidence=True)
    rewrite(d, lambda t: t.update({"confidence_head.weight": np.ones((2, H), F32)}))
    with pytest.raises(CheckpointError, match=rf"is \[2, {H}\]"):
        DflashDraft.load(d, target)
