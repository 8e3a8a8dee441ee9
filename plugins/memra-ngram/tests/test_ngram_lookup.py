"""The n-gram matcher, the option checks, and the context the state keeps across rounds."""

import pytest
from memra_ngram import NgramSource, lookup

from memra.errors import InputError
from memra.speculative.contract import RoundOutcome, SessionStart


@pytest.mark.parametrize("context, k, n, min_n, want", [
    ([1, 2, 3, 4, 2, 3], 4, 3, 1, [4, 2, 3]),        # [4,2,3] unseen, [2,3] seen at 1: what followed
    ([1, 2, 3, 4, 2, 3], 2, 3, 1, [4, 2]),           # at most k
    ([1, 2, 3, 4, 2, 3], 4, 3, 3, []),               # min_n forbids the shorter key
    ([5, 1, 7, 5, 1, 8, 5, 1], 3, 2, 1, [8, 5, 1]),  # the most recent earlier occurrence wins
    ([1, 2, 9, 1, 3, 2], 4, 2, 1, [9, 1, 3, 2]),     # falls back to n=1: [2] at 1
    ([7, 7, 7], 4, 3, 1, [7]),                       # overlapping match: what follows it, no more
    ([1, 2, 3], 4, 3, 1, []),                        # no earlier occurrence
    ([4], 4, 3, 1, []),                              # nothing before the anchor
])
def test_lookup_drafts_what_followed_the_last_n_tokens(context, k, n, min_n, want):
    assert lookup(context, k, n, min_n) == want


@pytest.mark.parametrize("options, message", [
    ({"m": 2}, "unknown options \\['m'\\]"),
    ({"n": 0}, "n must be a positive integer"),
    ({"n": True}, "n must be a positive integer"),
    ({"min_n": 2.0}, "min_n must be a positive integer"),
    ({"n": 2, "min_n": 3}, "min_n=3 is above n=2"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(InputError, match=message):
        NgramSource().load(None, options)


def test_the_state_tracks_committed_tokens_and_the_anchor():
    drafter = NgramSource().load(None, {"n": 2})
    assert (drafter.max_k, drafter.tap_layers) == (14, ())
    state = drafter.begin(SessionStart(None, [1, 2, 3, 1, 2], anchor=3, collapsed=None, taps={}, max_ctx=64))
    assert state.propose(4, None).tokens == [1, 2, 3]       # after [2, 3] at 1
    state.commit(RoundOutcome(kept=[3, 1], bonus=9, drafted=[1, 2, 3], collapsed=None))
    assert state.context == [1, 2, 3, 1, 2, 3, 1, 9]
    assert state.propose(4, None).tokens == []              # [1, 9] and [9] are new
