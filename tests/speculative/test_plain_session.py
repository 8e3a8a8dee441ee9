"""PlainSession: the plain tape as a resumable session, the path generate and the server share.

Its tokens are checked against the definition of plain decoding written out by hand (prime,
then one decode_step per token, argmax or a draw on the session's stream), for any cut of the
bursts; the cache never runs past the last token returned.
"""

import numpy as np
import pytest

from memra.speculative.plain import PlainSession
from memra.speculative.sampling import SampleStreams, SamplingParams, filtered_probs

from .battery import model_fixture, prompt_ids

model = model_fixture("numpy")

N = 12
CUTS = [[N], [1] * N, [3, 1, 5, 3], [2, 7, 1, 2]]


def by_hand(model, prompt, n, sampling=None):
    cache = model.new_cache(len(prompt) + n)
    streams = SampleStreams(model.be, sampling.seed) if sampling else None
    choose = (lambda z: int(np.argmax(z))) if sampling is None else \
        (lambda z: streams.draw(filtered_probs(z, sampling)))
    out = [choose(model.prime(prompt, cache))]
    while len(out) < n:
        out.append(choose(model.decode_step(out[-1], cache)))
    return out


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.8, top_p=0.9, seed=5)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("cuts", CUTS, ids=lambda c: "-".join(map(str, c)))
def test_bursts_cut_anywhere_give_the_hand_written_plain_tape(model, sampling, cuts):
    prompt = prompt_ids(model)
    session = PlainSession(model, prompt, len(prompt) + N, sampling)
    got = []
    for n in cuts:
        got += session.burst(n)
        assert session.cache.pos == len(prompt) + len(got) - 1  # the last token is not yet decoded
    assert got == by_hand(model, prompt, N, sampling)


def test_eos_is_kept_and_ends_the_session(model):
    prompt = prompt_ids(model)
    tape = by_hand(model, prompt, N)
    eos = tape[4]
    session = PlainSession(model, prompt, len(prompt) + N)
    got = session.burst(N, eos=(eos,))
    assert got == tape[:tape.index(eos) + 1] and session.done
    assert session.burst(N, eos=(eos,)) == []


def test_a_greedy_sampling_params_is_the_argmax(model):
    prompt = prompt_ids(model)
    session = PlainSession(model, prompt, len(prompt) + N, SamplingParams(temperature=0, seed=3))
    assert session.burst(N) == by_hand(model, prompt, N)
