"""Types at the API edge: every generate() argument of the wrong type or range is ONE InputError
naming that argument, on the plain and the speculative path alike, for max_new_tokens=0 too
(memra.arguments is the one validation path both share). Also load_model / load_config with a
non-path, SamplingParams with numpy scalars, tap_layers that are not layer indices, and the
SpecSession argument check the session's constructor calls.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import memra
from memra.arguments import check_session_args
from memra.errors import InputError
from memra.speculative.sampling import SamplingParams

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]

BAD = [  # (generate keyword arguments, the argument the refusal must name)
    *[({"num_draft_tokens": k}, "num_draft_tokens") for k in ("3", None, 3.0, True, 0, 15, np.float64(2))],
    *[({"draft": d}, "draft=") for d in (["native-mtp"], 3, "", b"native-mtp")],
    *[({"draft_options": o}, "draft_options") for o in ([1], "x", 5, {1: 2})],
    *[({"p_min": p}, "p_min") for p in (-0.1, 1.5, math.nan, math.inf, "0.5", None, True)],
    ({"p_min": 0.5, "pmin0": "yes"}, "pmin0"),
    *[({"eos": e}, "eos") for e in (3, "3", None, np.int64(3), b"\x03")],
    *[({"eos": e}, "EOS id") for e in ([1.0], [1.5], [True], [None], [10**9])],
    *[({"on_tokens": f}, "on_tokens") for f in (3, "print", [print])],
    *[({"sampling": s}, "sampling") for s in ({"temperature": 1.0}, 0.7)],
    *[({"max_new_tokens": n}, "max_new_tokens") for n in (3.0, -1, "3", True, None)],
    *[({"prompt_ids": p}, "prompt_ids") for p in ("abc", None, 5, np.int64(5), {1: 2}, {1, 2})],
    *[({"prompt_ids": p}, "prompt token id") for p in ([1.0, 2.0], [True, 1], [None], np.array([1.5, 2.0]),
                                                       [1, 2**70], [[1, 2]], [])],
]


@pytest.fixture(scope="module")
def model(fixture_dir):
    return memra.load_model(fixture_dir("small"), backend="numpy")


def call(model, case: dict, draft, n: int):
    kwargs = {"draft": draft, "num_draft_tokens": 3, **case}
    prompt = kwargs.pop("prompt_ids", PROMPT)
    if kwargs["draft"] is None:
        kwargs.pop("num_draft_tokens")  # plain decoding takes the default K, unused
    return memra.generate(model, prompt, kwargs.pop("max_new_tokens", n), **kwargs)


@pytest.mark.parametrize("n", [0, 3])
@pytest.mark.parametrize("draft", [None, "native-mtp"])
@pytest.mark.parametrize("case, name", BAD, ids=[f"{c}"[:50] for c, _ in BAD])
def test_each_bad_argument_is_one_input_error_naming_it(model, case, name, draft, n):
    if draft is None and "num_draft_tokens" in case:
        draft = "native-mtp"  # K is judged on the speculative path
    with pytest.raises(InputError) as info:
        call(model, case, draft, n)
    message = str(info.value)
    assert name in message and "\n" not in message, message
    if "num_draft_tokens" in case:
        assert "max_ctx" not in message  # a K out of range names K, not the cache it would size


def test_max_new_tokens_zero_still_checks_the_speculative_prompt(model):
    with pytest.raises(InputError, match="prompt of >= 2 tokens"):
        memra.generate(model, [7], 0, draft="native-mtp")
    assert memra.generate(model, [7], 0).tokens == []  # plain decoding takes one token


def test_speculative_only_arguments_are_refused_on_the_plain_path(model):
    for kwargs in ({"p_min": 0.5}, {"pmin0": True, "p_min": 0.5}, {"draft_options": {"d2t": [0]}}):
        with pytest.raises(InputError, match="plain"):
            memra.generate(model, PROMPT, 2, **kwargs)
    with pytest.raises(InputError, match="pmin0=True widens the p_min gate"):
        memra.generate(model, PROMPT, 2, draft="native-mtp", pmin0=True)


def test_valid_kinds_are_accepted_alike(model):
    """The green arm: numpy integers and arrays, sets of EOS ids, numpy floats give one answer."""
    tape = memra.generate(model, PROMPT, 6, draft="native-mtp", num_draft_tokens=3, eos=[]).tokens
    seen = []
    same = memra.generate(model, np.array(PROMPT, dtype=np.int32), np.int64(6), draft="native-mtp",
                          num_draft_tokens=np.int64(3), eos=np.array([], dtype=np.int64), p_min=np.float32(0),
                          draft_options={}, on_tokens=lambda ids, metrics: seen.extend(ids)).tokens
    assert same == tape and seen == tape
    assert memra.generate(model, PROMPT, 6, eos={tape[2], 10**0}).tokens == memra.generate(
        model, PROMPT, 6, eos=[tape[2], 1]).tokens


def test_sampling_params_take_numpy_scalars_as_plain_numbers_and_refuse_numpy_bools():
    sp = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9), seed=np.uint64(7))
    assert sp == SamplingParams(temperature=0.5, top_k=3, top_p=float(np.float64(0.9)), seed=7)
    assert type(sp.temperature) is float and type(sp.top_k) is int and type(sp.seed) is int
    for field in ("temperature", "top_k", "seed"):
        with pytest.raises(InputError, match=f"SamplingParams.{field}="):
            SamplingParams(**{field: np.bool_(True)})


@pytest.mark.parametrize("taps", ["01", "0", [0.5], [True], None, 0, {0: 1}, [99], [-1], iter([0])])
def test_tap_layers_must_be_layer_indices_and_a_refusal_moves_nothing(model, taps):
    cache = model.new_cache(32)
    with pytest.raises(InputError, match="tap"):
        model.prime_rows(PROMPT, cache, taps)
    assert cache.pos == 0 and all(p.length == 0 for p in cache.mla.values())
    model.prime(PROMPT, cache)
    with pytest.raises(InputError, match="tap"):
        model.verify_rows([1, 2], cache, taps)
    assert cache.pos == len(PROMPT) and all(p.length == len(PROMPT) for p in cache.mla.values())
    assert model.prime_rows(PROMPT, model.new_cache(32), (0, 2))[2].keys() == {0, 2}  # the green arm


@pytest.mark.parametrize("path", [123, None, ["dir"], b"dir", 1.5])
def test_load_model_and_load_config_with_a_non_path_name_the_path(path):
    with pytest.raises(InputError, match="path must be"):
        memra.load_model(path, backend="numpy")
    with pytest.raises(InputError, match="path must be"):
        memra.load_config(path)


@pytest.mark.parametrize("kwargs, name", [
    ({"prompt_ids": [5]}, "prompt of >= 2 tokens"), ({"prompt_ids": "ab"}, "prompt_ids"),
    ({"max_ctx": "64"}, "max_ctx"), ({"max_ctx": 64.0}, "max_ctx"), ({"p_min": 2}, "p_min"),
    ({"pmin0": 1}, "pmin0"), ({"sampling": "greedy"}, "sampling"),
])
def test_the_session_argument_check_names_each_argument(model, kwargs, name):
    args = {"prompt_ids": PROMPT, "max_ctx": 64, **kwargs}
    with pytest.raises(InputError, match=name):
        check_session_args(model, args.pop("prompt_ids"), args.pop("max_ctx"), **args)
    assert check_session_args(model, PROMPT, 64) == (PROMPT, None)


@pytest.mark.parametrize("not_a_model", [None, "model", 3])
def test_generate_and_sessions_refuse_what_is_not_a_model(not_a_model):
    with pytest.raises(InputError, match="model must be a model memra.load_model returned"):
        memra.generate(not_a_model, PROMPT, 4)
    with pytest.raises(InputError, match="model must be a model"):
        check_session_args(not_a_model, PROMPT, 64)


@pytest.mark.parametrize("stages, devices, needle", [
    (2, "ab", "devices must be a list of GPU indices"), (2, [-1, 5], "integers >= 0"), (2, [0.0, 1], "integers >= 0"),
    (2, [0], "1 stage devices [0] for 2 stages"), (1, [3], "this model is one stage"),
])
def test_load_model_refuses_stage_devices_before_reading_a_tensor(fixture_dir, monkeypatch, stages, devices, needle):
    import memra.checkpoint

    monkeypatch.setattr(memra.checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("read the tensors"))
    with pytest.raises(InputError) as info:
        memra.load_model(fixture_dir("small"), backend="numpy", stages=stages, devices=devices)
    assert needle in str(info.value)


@pytest.mark.parametrize("target", ["5", None, 2.0, -1, True])
def test_a_refused_burst_target_moves_no_session(model, target):
    """The anchor comes out of the first burst: a burst refused after it was emitted would lose it."""
    from memra.drafters.registry import load_drafter
    from memra.speculative.plain import PlainSession
    from memra.speculative.session import SpecSession

    want = memra.generate(model, PROMPT, 6, draft=None).tokens
    spec = SpecSession(model, PROMPT, load_drafter("native-mtp", model), 64)
    plain = PlainSession(model, PROMPT, 64)
    with pytest.raises(InputError, match="target must be a non-negative integer"):
        spec.burst(target, 3)
    assert spec.burst(6, 3)[0][:6] == want
    with pytest.raises(InputError, match="target must be a non-negative integer"):
        plain.burst(target)
    assert plain.burst(6) == want


def test_a_plain_session_ends_at_a_full_cache_keeping_what_it_made(model):
    """As SpecSession at its context guard: the burst stops (done) instead of raising and losing its
    tokens. With max_ctx = prompt + 5 a session holds the prime's token and five decoded ones."""
    from memra.speculative.plain import PlainSession

    session = PlainSession(model, PROMPT, len(PROMPT) + 5)
    tokens = session.burst(10)
    assert tokens == memra.generate(model, PROMPT, 6).tokens
    assert session.done and session.burst(1) == []


@pytest.mark.parametrize("eos", [{5}, frozenset({5, 7})])
def test_sessions_take_eos_as_a_set_as_generate_does(model, eos):
    from memra.drafters.registry import load_drafter
    from memra.speculative.plain import PlainSession
    from memra.speculative.session import SpecSession

    assert isinstance(PlainSession(model, PROMPT, 64).burst(3, eos), list)
    assert isinstance(SpecSession(model, PROMPT, load_drafter("native-mtp", model), 64).burst(3, 2, eos)[0], list)
    with pytest.raises(InputError, match="eos must be a sequence"):
        PlainSession(model, PROMPT, 64).burst(3, 5)
