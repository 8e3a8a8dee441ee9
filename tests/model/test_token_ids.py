"""Token ids have one check (memra/model/tokens.py) and every door calls it: the model's steps,
generate (prompt and EOS ids, plain and speculative), SpecSession (prompt, EOS ids, each
proposal) and the CLI. A bad id is an InputError naming the argument, the bound and the fix,
raised before anything runs; floats, bools, strings and None are refused even where int() would
take them. The green twins: ints, numpy integers, arrays and generators all pass, alike.
"""

import numpy as np
import pytest

from memra.backend.numpy_ref import NumpyBackend
from memra.errors import InputError
from memra.generate import generate
from memra.model.tokens import check_token_ids
from memra.model.trunk import Glm5Model
from memra.speculative.contract import Proposal
from memra.speculative.session import SpecSession
from tests.model.test_inputs import CFG, PROMPT, VOCAB, random_weights

REFUSED = [
    ("float", [1, 2.0], r"prompt token ids must be integers .*got 2\.0 \(float\)"),
    ("float_array", np.array([1.0, 2.5]), r"prompt token ids must be integers"),
    ("bool", [1, True], r"got True \(bool\)"),
    ("numpy_bool", [1, np.bool_(False)], r"False_? \(bool\)"),
    ("string", ["1"], r"got '1' \(str\)"),
    ("bytes", b"ab", r"got b'ab' \(bytes\)"),
    ("none", [None], r"got None \(NoneType\)"),
    ("nested", [[1, 2], [3, 4]], r"1-D sequence of integers, got shape \(2, 2\)"),
    ("empty", [], r"non-empty 1-D sequence of integers, got an empty one"),
    ("at_vocab", [1, VOCAB], rf"prompt token id {VOCAB} is outside the vocab 0\.\.{VOCAB - 1}: check the tokenizer"),
    ("negative", [-1], rf"prompt token id -1 is outside the vocab 0\.\.{VOCAB - 1}"),
]


@pytest.mark.parametrize("ids,message", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_check_token_ids_refuses_by_the_arguments_name(ids, message):
    with pytest.raises(InputError, match=message):
        check_token_ids(ids, VOCAB, "prompt token id")


def test_ints_numpy_integers_arrays_and_generators_pass_alike():
    want = [3, 0, VOCAB - 1]
    for ids in (want, tuple(want), np.array(want, np.int32), np.array(want, np.uint64),
                [np.int64(3), np.int8(0), VOCAB - 1], (t for t in want), range(3, 4)):
        got = check_token_ids(ids, VOCAB)
        assert got == (want if not isinstance(ids, range) else [3])
        assert all(type(t) is int for t in got)
    assert check_token_ids(np.int64(5), VOCAB) == [5]  # a lone id is a sequence of one
    assert check_token_ids((), VOCAB, "EOS id", allow_empty=True) == []


@pytest.fixture(scope="module")
def model() -> Glm5Model:
    return Glm5Model(CFG, random_weights(CFG), NumpyBackend())


DOORS = {
    "model.prime": lambda m, ids: m.prime(ids, m.new_cache(16)),
    "generate plain": lambda m, ids: generate(m, ids, 3),
    "generate speculative": lambda m, ids: generate(m, ids, 3, draft="native-mtp", num_draft_tokens=2),
    "generate, no new tokens": lambda m, ids: generate(m, ids, 0),
    "SpecSession": lambda m, ids: SpecSession(m, ids, _Drafter([]), 64),
}


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("ids,why", [([1, 2, 2.7], "integers"), ([1, 2, True], "integers"),
                                     ([1, 2, VOCAB], "outside the vocab")], ids=["float", "bool", "at_vocab"])
def test_every_door_refuses_a_bad_prompt_the_same_way(model, door, ids, why):
    with pytest.raises(InputError, match=f"token id.*{why}"):
        DOORS[door](model, ids)


@pytest.mark.parametrize("eos,why", [((2.0,), "EOS ids must be integers"), ((VOCAB,), "EOS id .* outside the vocab"),
                                     ((True,), "EOS ids must be integers")], ids=["float", "at_vocab", "bool"])
def test_generate_refuses_bad_eos_ids(model, eos, why):
    for draft in (None, "native-mtp"):
        with pytest.raises(InputError, match=why):
            generate(model, PROMPT, 3, draft=draft, eos=eos)


def test_a_session_refuses_bad_eos_ids_before_a_round(model):
    session = SpecSession(model, PROMPT, _Drafter([1]), 64)
    with pytest.raises(InputError, match=rf"EOS id {VOCAB} is outside the vocab"):
        session.burst(4, 1, eos=(VOCAB,))
    assert session.cache.pos == len(PROMPT) and not session.anchor_emitted


@pytest.mark.parametrize("drafts,why", [([1, 2.0], r"draft token ids must be integers"),
                                        ([1, VOCAB], rf"draft token id {VOCAB} is outside the vocab.*another model")],
                         ids=["float", "at_vocab"])
def test_a_session_refuses_bad_draft_ids_by_name(model, drafts, why):
    session = SpecSession(model, PROMPT, _Drafter(drafts), 64)
    with pytest.raises(InputError, match=why):
        session.burst(4, 2)
    assert session.cache.pos == len(PROMPT)


class _Drafter:
    """Proposes the same tokens every round (the core casts and checks them, not the source)."""

    max_k, tap_layers = 14, ()

    def __init__(self, tokens):
        self.tokens = tokens

    def begin(self, start):
        return self

    def propose(self, k, sampling=None):
        return Proposal(tokens=list(self.tokens))

    def commit(self, outcome):
        pass
