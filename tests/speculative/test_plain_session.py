"""PlainSession: the plain tape as a resumable session, the path generate and the server share.

Its tokens are checked against the definition of plain decoding written out by hand (prime,
then one decode_step per token, argmax or a draw on the session's stream), for any cut of the
bursts. A sampled session never decodes past the last token returned; a greedy one runs one step
ahead, only where max_ctx leaves room for the token after it, so it never decodes a token it
cannot return.
"""

import numpy as np
import pytest

from memra.errors import ContextOverflowError
from memra.speculative.plain import PlainSession
from memra.speculative.sampling import SamplingParams

from .battery import feed_next_id_over, hand_tape, model_fixture, prompt_ids

model = model_fixture("numpy")

N = 12
CUTS = [[N], [1] * N, [3, 1, 5, 3], [2, 7, 1, 2]]


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.8, top_p=0.9, seed=5)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("cuts", CUTS, ids=lambda c: "-".join(map(str, c)))
def test_bursts_cut_anywhere_give_the_hand_written_plain_tape(model, sampling, cuts):
    prompt = prompt_ids(model)
    session = PlainSession(model, prompt, len(prompt) + N, sampling)
    got = []
    for n in cuts:
        got += session.burst(n)
        # a greedy step ahead has decoded the last token returned, from the first decode on (the
        # prime made token 1) while the cache has room for a token after it
        ahead = sampling is None and 2 <= len(got) < N
        assert session.cache.pos == len(prompt) + len(got) - 1 + ahead
        assert (session.ahead is not None) == ahead
    assert got == hand_tape(model, prompt, N, sampling)


def test_eos_is_kept_and_ends_the_session(model):
    prompt = prompt_ids(model)
    tape = hand_tape(model, prompt, N)
    eos = tape[4]
    session = PlainSession(model, prompt, len(prompt) + N)
    got = session.burst(N, eos=(eos,))
    assert got == tape[:tape.index(eos) + 1] and session.done
    assert session.burst(N, eos=(eos,)) == []


def test_greedy_steps_ahead_feed_the_argmax_where_it_lies(model, monkeypatch):
    """Every step after the first is fed the NextToken of the step before (its id never went
    through the host), and the tape is still the hand-written one."""
    prompt, fed = prompt_ids(model), []
    decode_next = type(model).decode_next
    monkeypatch.setattr(type(model), "decode_next", lambda self, token, cache: (
        fed.append(type(token).__name__), decode_next(self, token, cache))[1])
    session = PlainSession(model, prompt, len(prompt) + N)
    assert session.burst(N) == hand_tape(model, prompt, N)
    assert fed == ["int"] + ["NextToken"] * (N - 2)


def test_red_arm_a_step_ahead_fed_another_id_leaves_the_tape(model, monkeypatch):
    """The tape check above can fail: steps ahead fed the next id over instead of the argmax."""
    prompt = prompt_ids(model)
    feed_next_id_over(monkeypatch, model)
    session = PlainSession(model, prompt, len(prompt) + N)
    assert session.burst(N) != hand_tape(model, prompt, N)


def test_a_device_id_from_a_chain_needs_room_like_a_host_id(model):
    prompt = prompt_ids(model)
    cache = model.new_cache(len(prompt) + 1)
    step = model.decode_next(int(np.argmax(model.prime(prompt, cache))), cache)
    with pytest.raises(ContextOverflowError, match="would pass max_ctx"):
        model.decode_next(step, cache)
    assert cache.pos == len(prompt) + 1


def test_a_greedy_sampling_params_is_the_argmax(model):
    prompt = prompt_ids(model)
    session = PlainSession(model, prompt, len(prompt) + N, SamplingParams(temperature=0, seed=3))
    assert session.burst(N) == hand_tape(model, prompt, N)
