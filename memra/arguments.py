"""The API edge: every argument generate() and the sessions take, checked in one place.

Plain and speculative generation both call `check_request` before anything is loaded or
allocated, so a bad argument is refused by its name on either path, max_new_tokens=0 included
(an empty request still gets every check). Token ids keep their own home (memra/model/tokens.py);
this module adds what surrounds them: sequences that are not sequences (a lone int, a string),
counts, K, probabilities, flags, callbacks, options, the sampling parameters and tap layers.

    req = check_request(model, prompt_ids, 64, draft="native-mtp", num_draft_tokens=4)
    req.prompt, req.k, req.sampling, req.eos
    prompt, sampling = check_session_args(model, prompt_ids, max_ctx, p_min, pmin0, sampling)
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Mapping, Set
from dataclasses import dataclass

import numpy as np

from memra.errors import InputError
from memra.limits import MAX_K, VERIFY_CAP
from memra.model.tokens import check_token_ids
from memra.speculative.sampling import SamplingParams, refuse_penalties

VOCAB_FIX = "pass ids of this model's vocab"


@dataclass(frozen=True)
class Request:
    """A checked generate() call."""

    prompt: list[int]
    max_new_tokens: int
    draft: str | None
    k: int
    draft_options: dict | None
    sampling: SamplingParams | None  # None: greedy
    eos: tuple[int, ...]
    p_min: float
    pmin0: bool
    on_tokens: object


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _lone(value) -> bool:
    """A single value where a sequence belongs (an int, a float, None, a 0-d array)."""
    return not isinstance(value, Iterable) or (isinstance(value, np.ndarray) and value.ndim == 0)


def check_count(n, name: str = "max_new_tokens") -> int:
    if not _is_int(n) or n < 0:
        raise InputError(f"{name} must be a non-negative integer, got {n!r} ({type(n).__name__})")
    return int(n)


def check_k(k, bound: int = MAX_K, why: str = "", name: str = "num_draft_tokens") -> int:
    """K, drafts per round: an integer in 1..bound (bound <= MAX_K: K + 1 verify rows <= VERIFY_CAP)."""
    if not _is_int(k) or not 1 <= k <= bound:
        why = why or f"K + 1 verify rows must stay <= {VERIFY_CAP}"
        raise InputError(f"{name}={k!r} must be an integer in 1..{bound} ({why}): at most {bound}")
    return int(k)


def check_draft_k(k: int, max_k: int, source: str) -> int:
    """K against the loaded draft source's own bound (its max_k, as contract.check_drafter read it)."""
    if max_k >= MAX_K:
        return check_k(k)
    return check_k(k, max_k, why=f"draft source {source!r} makes at most {max_k} drafts per round")


def check_probability(p, name: str) -> float:
    if not isinstance(p, numbers.Real) or isinstance(p, (bool, np.bool_)) or not 0 <= p <= 1:
        raise InputError(f"{name}={p!r} must be a number in [0, 1] (0 = off)")
    return float(p)


def check_flag(v, name: str) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise InputError(f"{name}={v!r} must be True or False")
    return bool(v)


def check_draft(draft) -> str | None:
    if draft is not None and (not isinstance(draft, str) or not draft.strip()):
        raise InputError(f"draft={draft!r} must be a draft source name (a non-empty str) or None for plain "
                         "decoding: see memra.drafters.registry.list_draft_sources()")
    return draft


def check_draft_options(options) -> dict | None:
    if options is None:
        return None
    if not isinstance(options, Mapping) or not all(isinstance(key, str) for key in options):
        raise InputError(f"draft_options must be a mapping of option names (str) to values, or None, got "
                         f"{type(options).__name__}")
    return dict(options)


def check_sampling(sampling) -> SamplingParams | None:
    """The sampling parameters, or None for greedy (temperature 0 is greedy too)."""
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise InputError(f"sampling must be a memra.SamplingParams (or None for greedy), got "
                         f"{type(sampling).__name__}")
    refuse_penalties(sampling)
    return None if sampling is None or sampling.greedy else sampling


def check_callback(fn, name: str = "on_tokens"):
    if fn is not None and not callable(fn):
        raise InputError(f"{name} must be callable as {name}(new_ids, metrics), or None, got {type(fn).__name__}")
    return fn


def check_id_sequence(ids, vocab: int, what: str, name: str, fix: str = VOCAB_FIX, allow_empty: bool = False,
                      ordered: bool = True) -> list[int]:
    """A sequence of token ids: a lone id, a str/bytes, a mapping, None (and, where order matters,
    a set) is refused by the argument's `name` before the ids themselves are checked."""
    lone = _lone(ids)
    if lone or isinstance(ids, (str, bytes, Mapping)) or (ordered and isinstance(ids, Set)):
        got = f"{ids!r:.40} ({type(ids).__name__})" if lone else type(ids).__name__
        raise InputError(f"{name} must be a{'n ordered' if ordered else ''} sequence of token ids (a list, tuple "
                         f"or 1-D integer array), got {got}: wrap a single id in a list")
    return check_token_ids(list(ids) if isinstance(ids, Set) else ids, vocab, what, fix, allow_empty)


def check_prompt(prompt_ids, vocab: int, speculative: bool) -> list[int]:
    prompt = check_id_sequence(prompt_ids, vocab, "prompt token id", "prompt_ids",
                               fix="check the tokenizer (or the ids) belong to this checkpoint")
    if speculative and len(prompt) < 2:
        raise InputError("speculative decoding needs a prompt of >= 2 tokens (the draft warms on "
                         "(token[i+1], hidden[i]) pairs): give a longer prompt, or draft=None")
    return prompt


def check_eos(eos, vocab: int) -> tuple[int, ...]:
    return tuple(check_id_sequence(eos, vocab, "EOS id", "eos", allow_empty=True, ordered=False))


def check_tap_layers(tap_layers, n_layers: int) -> list[int]:
    """Trunk layer indices a drafter taps: integers in 0..n_layers-1 (a str or floats are refused,
    never read digit by digit or truncated)."""
    if _lone(tap_layers) or isinstance(tap_layers, (str, bytes, Mapping, Iterator)):
        raise InputError(f"tap_layers must be a sequence of trunk layer indices (() for none), got "
                         f"{tap_layers!r:.60}")
    layers = []
    for i in tap_layers:
        if not _is_int(i):
            raise InputError(f"tap layer {i!r} must be an integer layer index")
        if not 0 <= i < n_layers:
            raise InputError(f"tap layer {i} is outside the trunk 0..{n_layers - 1}; the drafter was made for "
                             "another model")
        layers.append(int(i))
    return layers


def check_p_min(p_min, pmin0, speculative: bool = True) -> tuple[float, bool]:
    p_min, pmin0 = check_probability(p_min, "p_min"), check_flag(pmin0, "pmin0")
    if not speculative and (p_min > 0 or pmin0):
        raise InputError("p_min / pmin0 gate a draft source's drafts and this call is plain (draft=None): "
                         "drop them, or pass a draft source")
    if pmin0 and p_min == 0:
        raise InputError("pmin0=True widens the p_min gate to the first draft: give p_min > 0 too")
    return p_min, pmin0


def check_model(model) -> None:
    if not (hasattr(model, "cfg") and hasattr(model, "be")):
        raise InputError(f"model must be a model memra.load_model returned, got {type(model).__name__} {model!r:.40}")


def check_session_args(model, prompt_ids, max_ctx, p_min=0.0, pmin0=False, sampling=None):
    """SpecSession's arguments -> (prompt ids, sampling or None for greedy); max_ctx itself is
    new_cache's to judge. For the session's constructor, before it allocates anything."""
    check_model(model)
    prompt = check_prompt(prompt_ids, model.cfg.vocab_size, speculative=True)
    if not _is_int(max_ctx):
        raise InputError(f"max_ctx must be an integer, got {max_ctx!r} ({type(max_ctx).__name__})")
    check_p_min(p_min, pmin0)
    return prompt, check_sampling(sampling)


def check_request(model, prompt_ids, max_new_tokens, draft=None, num_draft_tokens=4, draft_options=None,
                  sampling=None, eos=(), p_min=0.0, pmin0=False, on_tokens=None) -> Request:
    """Every argument of generate(), by name; the draft source's own K bound and the context are
    checked once the source is loaded (generate does both before it allocates)."""
    check_model(model)
    n = check_count(max_new_tokens)
    draft = check_draft(draft)
    speculative = draft is not None
    k = check_k(num_draft_tokens)
    options = check_draft_options(draft_options)
    if not speculative and options:
        raise InputError("draft_options configure a draft source and this call is plain (draft=None): drop "
                         "them, or pass a draft source")
    p_min, pmin0 = check_p_min(p_min, pmin0, speculative)
    vocab = model.cfg.vocab_size
    return Request(check_prompt(prompt_ids, vocab, speculative), n, draft, k, options, check_sampling(sampling),
                   check_eos(eos, vocab), p_min, pmin0, check_callback(on_tokens))


def check_fits_context(req: Request, limit: int, why: str, overhead: int) -> None:
    """The request's cache (prompt + max_new_tokens + `overhead` positions) must fit `limit`
    (what `why` names); refused by max_new_tokens, with the largest value that fits."""
    need = len(req.prompt) + req.max_new_tokens + overhead
    if need <= limit:
        return
    room = limit - len(req.prompt) - overhead
    if room < 1:
        raise InputError(f"the prompt of {len(req.prompt)} tokens (+ {overhead} positions a round keeps free) "
                         f"leaves no room under {why} ({limit}): shorten the prompt")
    spare = f" + {overhead} positions a speculative round keeps free" if overhead else ""
    raise InputError(f"max_new_tokens={req.max_new_tokens} with a {len(req.prompt)}-token prompt{spare} needs "
                     f"{need} positions, past {why} ({limit}): give max_new_tokens <= {room}")
