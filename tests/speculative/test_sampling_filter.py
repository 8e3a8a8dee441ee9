"""The sampling primitives: the Philox streams, the race draw, and the filter that defines p and q.

Philox4x32-10 is checked against Random123's `philox4x32 10` known answers and its stream
addressing (seed, counter, tag) -> uniforms strictly inside (0, 1); race_draw breaks exact ties
to the lower index (its distribution is tested in test_sampling_exactness).

filtered_probs applies temperature, then top-k (ties to the lower index), then top-p (the
smallest prefix of the ranked tokens whose mass reaches top_p), then min-p (relative to the
largest probability), renormalising after each cut. Pinned against an independent pure-Python
implementation (hypothesis), by hand-made cases for each knob, and by cases where any other
order of application gives a different answer. SamplingParams refuses bad values with an
InputError that names the field; temperature 0 is greedy decoding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import memra
from memra.backend.numpy_ref import NumpyBackend
from memra.errors import InputError
from memra.generate import generate
from memra.backend.philox import MASK32, TAG_ACCEPT, TAG_DRAW, host_u01, philox4x32_10, to_unit, uniforms, words
from memra.backend.sampling_filter import filtered_by_sort
from memra.speculative.sampling import SamplingParams, filtered_probs


def _by_sort(z, sp):
    """The filter by its definition: the whole temperature-scaled row z sorted (the oracle)."""
    return filtered_by_sort(z, sp.top_k, sp.top_p, sp.min_p)


# ---- Philox: known answers and stream addressing ----------------------------------------------------
KAT = [  # Random123 kat_vectors, philox4x32 10: (ctr, key) -> out
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr, key, want", KAT, ids=["zeros", "ones", "pi"])
def test_philox_matches_the_random123_known_answers(ctr, key, want):
    assert tuple(int(w) for w in philox4x32_10(ctr, key)) == want


def test_philox_known_answers_hold_inside_a_vectorised_call():
    ctr = np.array([k[0] for k in KAT], dtype=np.uint64).T
    key = np.array([k[1] for k in KAT], dtype=np.uint64).T
    out = np.stack(philox4x32_10(tuple(ctr), tuple(key)), axis=1)
    assert out.tolist() == [list(k[2]) for k in KAT]


def test_stream_words_are_philox_blocks_of_the_documented_counter():
    seed, counter, tag = 0x0123456789ABCDEF, 77, TAG_ACCEPT
    w = words(seed, counter, tag, 10)
    for i in range(10):
        block = philox4x32_10((i // 4, counter, tag, 0), (seed & MASK32, seed >> 32))
        assert int(w[i]) == int(block[i % 4])
    assert w.dtype == np.uint32


@pytest.mark.parametrize("n", [1, 3, 4, 5, 1000])
def test_uniforms_are_strictly_inside_the_unit_interval(n):
    u = uniforms(2**64 - 1, 2**32 - 1, TAG_DRAW, n)
    assert u.shape == (n,) and u.dtype == np.float64
    assert np.all((u > 0) & (u < 1))
    # the extreme words map inside too: (0 + 0.5) / 2^32 and (2^32 - 1 + 0.5) / 2^32
    ends = to_unit(np.array([0, MASK32], dtype=np.uint32))
    assert ends[0] > 0 and ends[1] < 1 and ends[1] == 1 - 2.0**-33


def test_uniforms_prefix_does_not_depend_on_n():
    assert np.array_equal(uniforms(5, 9, TAG_DRAW, 7), uniforms(5, 9, TAG_DRAW, 4099)[:7])


def test_different_addresses_give_different_streams():
    base = (11, 3, TAG_DRAW)
    streams = {base: uniforms(*base, 16)}
    for addr in [(12, 3, TAG_DRAW), (11 + 2**32, 3, TAG_DRAW), (11, 4, TAG_DRAW), (11, 3, TAG_ACCEPT), (11, 3, 1)]:
        streams[addr] = uniforms(*addr, 16)
    values = list(streams.values())
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            assert not np.any(values[i] == values[j]), (list(streams)[i], list(streams)[j])
    assert host_u01(11, 3) == uniforms(11, 3, TAG_ACCEPT, 1)[0]


def test_race_draw_breaks_exact_ties_to_the_lower_index():
    be = NumpyBackend()
    assert be.race_draw(np.zeros(6), 1, 2) == 0                        # nothing to draw: index 0
    one_hot = np.zeros(6)
    one_hot[4] = 1.0
    assert all(be.race_draw(one_hot, s, 0) == 4 for s in range(50))


# ---- an independent filter ----------------------------------------------------------------------------
def reference_filter(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, margin=None):
    """Pure Python, one knob after another, each renormalising. If `margin` is a list, the
    distance of every top-p / min-p decision from its threshold is appended to it."""
    z = [float(v) / temperature for v in logits]
    ranked = sorted(range(len(z)), key=lambda i: (-z[i], i))
    kept = ranked[:top_k] if top_k else ranked
    top = z[ranked[0]]
    weights = {i: math.exp(z[i] - top) for i in kept}
    total = math.fsum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    if top_p < 1.0:
        mass, prefix = 0.0, []
        for i in kept:
            prefix.append(i)
            mass = math.fsum(probs[t] for t in prefix)
            if margin is not None:
                margin.append(abs(mass - top_p))
            if mass >= top_p:
                break
        total = math.fsum(probs[i] for i in prefix)
        probs = {i: probs[i] / total for i in prefix}
    if min_p > 0.0:
        bar = min_p * max(probs.values())
        if margin is not None:
            margin.extend(abs(v - bar) for v in probs.values())
        survivors = {i: v for i, v in probs.items() if v >= bar}
        total = math.fsum(survivors.values())
        probs = {i: v / total for i, v in survivors.items()}
    out = np.zeros(len(z))
    for i, v in probs.items():
        out[i] = v
    return out


def logits_of(probs):
    return np.log(np.asarray(probs, dtype=np.float64))


logit_rows = st.lists(st.one_of(st.integers(-4, 4).map(float), st.floats(-8, 8)), min_size=1, max_size=40)
params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([1.0, 0.3, 0.7, 1.5, 4.0]),
    top_k=st.integers(0, 12),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.95)),
)


@settings(max_examples=400, deadline=None)
@given(logit_rows, params)
def test_filter_matches_an_independent_implementation(logits, sp):
    row = np.asarray(logits, dtype=np.float32)       # the model's logits are float32
    margin: list[float] = []
    want = reference_filter(row.tolist(), sp.temperature, sp.top_k, sp.top_p, sp.min_p, margin)
    assume(all(m > 1e-9 for m in margin))            # no decision sits on its threshold
    got = filtered_probs(row, sp)
    assert got.dtype == np.float64 and got.shape == (len(logits),)
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


tied_rows = st.lists(st.sampled_from([-np.inf, -3.0, -1.0, -0.0, 0.0, 0.5, 2.0, 2.5, np.nan]), min_size=1,
                     max_size=40)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # rows of infinities and NaNs: inf - inf on both paths
@settings(max_examples=600, deadline=None)
@given(st.one_of(logit_rows, tied_rows), params)
def test_filter_is_bit_for_bit_the_whole_row_sort(logits, sp):
    """filtered_probs skips the full sort where it can; every bit must still be the sorted
    definition's (ties, +-0, +-inf and NaN rows included)."""
    row = np.asarray(logits, dtype=np.float32)
    got, want = filtered_probs(row, sp), _by_sort(row.astype(np.float64) / sp.temperature, sp)
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.95),
                                SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.6, top_k=40,
                                                                                         top_p=0.9, min_p=0.02)])
def test_filter_at_a_real_vocabulary_is_bit_for_bit_the_whole_row_sort(sp):
    row = (np.random.default_rng(3).standard_normal(154880) * 4).astype(np.float32)
    row[[7, 90000]] = row.max()  # a tie at the top
    assert np.array_equal(filtered_probs(row, sp), _by_sort(row.astype(np.float64) / sp.temperature, sp))


def test_a_nucleus_boundary_tie_keeps_the_sorted_rows_first_token():
    """At the top-p boundary, equal probabilities follow the sorted row's order (value, then
    index): two tokens share the boundary probability and only the lower index fits the nucleus
    (keeping the other, or both, fails here and in the bit-for-bit test above)."""
    row = np.log(np.array([0.25, 0.25, 0.5], dtype=np.float64)).astype(np.float32)
    sp = SamplingParams(temperature=1.0, top_p=0.7)
    p = filtered_probs(row, sp)
    assert np.count_nonzero(p) == 2 and p[0] > 0 and p[1] == 0  # the lower index of the tie survives
    assert np.array_equal(p, _by_sort(row.astype(np.float64), sp))


@settings(max_examples=300, deadline=None)
@given(logit_rows, params)
def test_filter_is_a_distribution_that_keeps_the_argmax(logits, sp):
    p = filtered_probs(logits, sp)
    assert np.all(p >= 0) and math.isclose(p.sum(), 1.0, rel_tol=1e-12)
    assert p[int(np.argmax(logits))] > 0              # the first maximum survives every cut
    if sp.top_k:
        assert np.count_nonzero(p) <= sp.top_k


# ---- each knob ----------------------------------------------------------------------------------------
def test_temperature_scales_the_logits():
    logits = np.array([2.0, 1.0, 0.0, -1.0])
    for t in (0.25, 1.0, 3.0):
        e = np.exp(logits / t)
        np.testing.assert_allclose(filtered_probs(logits, SamplingParams(temperature=t)), e / e.sum(), rtol=1e-14)


def test_top_k_keeps_exactly_k_and_breaks_ties_to_the_lower_index():
    logits = np.array([0.0, 2.0, 2.0, 2.0, 1.0, 2.0])
    assert np.flatnonzero(filtered_probs(logits, SamplingParams(top_k=2))).tolist() == [1, 2]
    assert np.flatnonzero(filtered_probs(logits, SamplingParams(top_k=5))).tolist() == [1, 2, 3, 4, 5]
    assert np.count_nonzero(filtered_probs(logits, SamplingParams(top_k=99))) == 6
    np.testing.assert_allclose(filtered_probs(logits, SamplingParams(top_k=3))[[1, 2, 3]], 1 / 3)


@pytest.mark.parametrize("top_p, kept", [(0.3, [0]), (0.49, [0]), (0.51, [0, 1]), (0.79, [0, 1]), (0.81, [0, 1, 2]),
                                         (0.96, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p, kept):
    p = np.array([0.5, 0.3, 0.15, 0.05])
    got = filtered_probs(logits_of(p)[[2, 0, 3, 1]], SamplingParams(top_p=top_p))   # ranked 1, 3, 0, 2
    order = [1, 3, 0, 2]
    assert np.flatnonzero(got).tolist() == sorted(order[i] for i in kept)
    np.testing.assert_allclose(got[[order[i] for i in kept]], p[kept] / p[kept].sum(), rtol=1e-12)


def test_top_p_ties_at_the_cut_go_to_the_lower_index():
    got = filtered_probs(np.array([1.0, 0.0, 1.0, 1.0]), SamplingParams(top_p=0.5))
    assert np.flatnonzero(got).tolist() == [0, 2]


@pytest.mark.parametrize("min_p, kept", [(0.05, 4), (0.2, 3), (0.5, 2), (0.9, 1)])
def test_min_p_is_relative_to_the_largest_probability(min_p, kept):
    p = np.array([0.5, 0.3, 0.15, 0.05])                # thresholds 0.025, 0.1, 0.25, 0.45
    got = filtered_probs(logits_of(p), SamplingParams(min_p=min_p))
    assert np.flatnonzero(got).tolist() == list(range(kept))
    np.testing.assert_allclose(got[:kept], p[:kept] / p[:kept].sum(), rtol=1e-12)


# ---- the order: temperature, top-k, top-p, min-p ---------------------------------------------------------
def test_top_p_sees_the_top_k_renormalised_mass():
    # top-k 2 -> (0.571, 0.429): top-p 0.5 keeps one; top-p first would keep two
    got = filtered_probs(logits_of([0.4, 0.3, 0.2, 0.1]), SamplingParams(top_k=2, top_p=0.5))
    assert np.flatnonzero(got).tolist() == [0]


def test_min_p_comes_after_top_p():
    # top-p 0.75 keeps (0.4, 0.3, 0.2); min-p 0.3 (bar 0.12 of the max) keeps all three.
    # min-p first would drop 0.1, renormalise to (0.444, 0.333, 0.222), and top-p would keep two.
    got = filtered_probs(logits_of([0.4, 0.3, 0.2, 0.1]), SamplingParams(top_p=0.75, min_p=0.3))
    assert np.flatnonzero(got).tolist() == [0, 1, 2]
    np.testing.assert_allclose(got[:3], np.array([0.4, 0.3, 0.2]) / 0.9, rtol=1e-12)


def test_temperature_comes_before_top_p_and_min_p():
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    # at T = 0.5 the probabilities are (0.69, 0.25, 0.06, 0.007): top-p 0.85 keeps two, not three
    assert np.count_nonzero(filtered_probs(logits, SamplingParams(temperature=0.5, top_p=0.85))) == 2
    assert np.count_nonzero(filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.85))) == 3
    # min-p 0.2 relative to the max: 0.15 / 0.5 = 0.3 passes at T = 1; (0.3)^2 = 0.09 fails at T = 0.5
    assert np.count_nonzero(filtered_probs(logits, SamplingParams(temperature=0.5, min_p=0.2))) == 2
    assert np.count_nonzero(filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))) == 3


def test_all_knobs_together_match_the_reference():
    logits = np.array([3.0, 2.5, 2.5, 1.0, 0.5, -1.0, 2.9, 0.0])
    sp = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.1)
    np.testing.assert_allclose(filtered_probs(logits, sp), reference_filter(logits, 0.8, 6, 0.9, 0.1), rtol=1e-12)


def test_a_subnormal_temperature_is_refused_and_the_smallest_one_is_the_argmax():
    with pytest.raises(InputError, match="temperature"):
        SamplingParams(temperature=1e-310)
    p = filtered_probs(np.array([1.0, 3.0, 2.0]), SamplingParams(temperature=1e-6))
    np.testing.assert_array_equal(p, [0.0, 1.0, 0.0])


# ---- SamplingParams: refusals ------------------------------------------------------------------------
BAD = [
    ("temperature", -0.5), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("temperature", True), ("temperature", None),
    ("top_k", -1), ("top_k", 2.0), ("top_k", True), ("top_k", "3"),
    ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.5), ("top_p", float("nan")), ("top_p", "0.9"),
    ("min_p", 1.0), ("min_p", -0.01), ("min_p", float("nan")), ("min_p", float("inf")),
    ("seed", -1), ("seed", 2**64), ("seed", 1.5), ("seed", True), ("seed", "7"),
    ("repetition_penalty", float("nan")), ("presence_penalty", float("inf")), ("frequency_penalty", "0.1"),
]


@pytest.mark.parametrize("field, value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_sampling_params_refuse_bad_values_naming_the_field(field, value):
    with pytest.raises(InputError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_sampling_params_accept_the_edges():
    SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    SamplingParams(temperature=1e-3, top_k=1, top_p=1e-9, min_p=0.999, seed=2**64 - 1)
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(presence_penalty=0.5).penalised and not SamplingParams().penalised


# ---- temperature 0 is greedy ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mini(fixture_dir):
    return memra.load_model(fixture_dir("mini"), backend="numpy")


@pytest.mark.parametrize("draft", [None, "native-mtp"])
def test_temperature_zero_is_greedy_decoding_whatever_the_other_knobs(mini, draft):
    prompt = [5, 17, 2, 30, 9, 9, 11]
    tape = generate(mini, prompt, 10).tokens
    for seed, extra in ((0, {}), (7, {"top_k": 2, "top_p": 0.3, "min_p": 0.5})):
        sp = SamplingParams(temperature=0, seed=seed, **extra)
        assert generate(mini, prompt, 10, draft=draft, num_draft_tokens=3, sampling=sp).tokens == tape
