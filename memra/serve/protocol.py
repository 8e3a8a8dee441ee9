"""OpenAI request bodies -> a checked `Job`, or an `ApiError` naming the field and the fix.

    request = parse_request(engine, body, chat=False)    # body: the decoded JSON object
    request.job.prompt, request.job.max_tokens, request.stream

Fields read: model, prompt (text, token ids, or a batch of one) / messages, max_tokens
(max_completion_tokens), temperature, top_p, top_k, min_p, seed, stop, n (= 1), stream,
stream_options.include_usage, logprobs (completions: how many top ids; chat: a bool plus
top_logprobs), and memra's own: draft (a source name, or null / "none" for plain decoding),
num_draft_tokens (K), p_min, p_min0, ignore_eos, return_token_ids. Fields that would change
the output and that memra does not do (penalties, logit_bias, echo, suffix, tools, best_of,
n > 1, structured output, vLLM's stop_token_ids, min_tokens, bad_words and guided_*, predicted
outputs, audio) are refused; other unknown fields are ignored, as OpenAI's are.
Sampling defaults follow the CLI: the checkpoint's generation_config.json, else greedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from memra.cli import inputs
from memra.errors import MemraError
from memra.limits import MAX_K, spec_context
from memra.speculative.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_STOPS = 16
ROLES = ("system", "developer", "user", "assistant", "tool")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed")


class ApiError(Exception):
    """A refusal with its HTTP status, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Job:
    """What the worker needs to run one request."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams | None = None
    draft: str | None = None
    num_draft_tokens: int = 4
    p_min: float = 0.0
    pmin0: bool = False
    eos: tuple[int, ...] = ()
    stops: tuple[str, ...] = ()
    logprobs: int | None = None        # None: off; else how many top ids per token


@dataclass
class Request:
    chat: bool
    job: Job
    stream: bool
    include_usage: bool
    return_token_ids: bool


def parse_request(engine, body, chat: bool) -> Request:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    f = _Fields(body)
    model = f.get("model", str)
    if model is not None and model != engine.name:
        raise ApiError(404, f"the model {model!r} does not exist: this server serves {engine.name!r} "
                            "(see /v1/models)", "model", "model_not_found")
    _refuse_unsupported(f)
    prompt = _chat_prompt(engine, f) if chat else _completion_prompt(engine, f)
    stream = bool(f.get("stream", bool, default=False))
    options = f.get("stream_options", dict)
    if options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    include_usage = bool(_Fields(options or {}, "stream_options.").get("include_usage", bool, default=False))
    job = Job(prompt=prompt, max_tokens=0, sampling=_sampling(engine, f), eos=engine.eos,
              stops=_stops(engine, f), logprobs=_logprobs(f, chat))
    if f.get("ignore_eos", bool, default=False):
        job.eos = ()
    _draft(engine, f, job)
    job.max_tokens = _max_tokens(engine, f, job)
    return Request(chat, job, stream, include_usage, bool(f.get("return_token_ids", bool, default=False)))


class _Fields:
    """Typed reads of a JSON object; a wrong type is a 400 naming the field."""

    NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
             list: "an array"}

    def __init__(self, body: dict, prefix: str = ""):
        self.body, self.prefix = body, prefix

    def get(self, name: str, kind, default=None):
        value = self.body.get(name)
        if value is None:
            return default
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            raise ApiError(400, f"{self.prefix}{name} must be {self.NAMES[kind]}, got {value!r}", self.prefix + name)
        return float(value) if kind is float else value

    def bounded(self, name: str, kind, lo, hi, default=None, why: str = ""):
        value = self.get(name, kind, default)
        if value is not None and not lo <= value <= hi:
            raise ApiError(400, f"{name}={value!r} is out of range: {why or f'must be in {lo}..{hi}'}", name)
        return value


def _refuse_unsupported(f: _Fields) -> None:
    n = f.get("n", int, default=1)
    if n != 1:
        fix = f"send {n} requests instead" if n > 1 else "drop it"
        raise ApiError(400, f"n={n}: memra returns one choice per request (n = 1); {fix}", "n")
    if f.get("best_of", int, default=1) != 1:
        raise ApiError(400, "best_of other than 1 is not supported: drop it", "best_of")
    for name, off in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        if f.get(name, float, default=off) != off:
            raise ApiError(400, f"{name} is not supported: memra has no penalty arm (greedy or sampled), and a "
                                "request is never run without what it asked for; drop it", name)
    checks = (("logit_bias", lambda v: not v), ("echo", lambda v: v is False), ("suffix", lambda v: v == ""),
              ("tools", lambda v: not v), ("functions", lambda v: not v),
              ("tool_choice", lambda v: v in ("none", "auto")),
              ("response_format", lambda v: isinstance(v, dict) and v.get("type") == "text"),
              # vLLM's and OpenAI's other fields that change the tokens
              ("stop_token_ids", lambda v: not v), ("min_tokens", lambda v: v == 0), ("bad_words", lambda v: not v),
              ("guided_json", lambda v: False), ("guided_regex", lambda v: False), ("guided_choice", lambda v: False),
              ("guided_grammar", lambda v: False), ("structured_outputs", lambda v: False),
              ("prediction", lambda v: False), ("audio", lambda v: False), ("modalities", lambda v: v == ["text"]))
    for name, fine in checks:
        value = f.body.get(name)
        if value is not None and not fine(value):
            raise ApiError(400, f"{name} is not supported by memra: drop it", name)


def _completion_prompt(engine, f: _Fields) -> list[int]:
    prompt = f.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _encode(engine, prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < engine.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is outside the vocab 0..{engine.vocab_size - 1}", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, f"prompt holds a batch of {len(prompt)} prompts: send one prompt per request", "prompt")
    raise ApiError(400, "prompt must be a non-empty string or a non-empty array of token ids", "prompt")


def _chat_prompt(engine, f: _Fields) -> list[int]:
    messages = f.get("messages", list)
    if not messages:
        raise ApiError(400, "messages must be a non-empty array of {role, content} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"{where} must be an object whose role is one of {list(ROLES)}", where)
        clean.append({"role": m["role"], "content": _content(m.get("content"), where)})
    if engine.tokenizer is None:
        raise ApiError(400, "this checkpoint has no tokenizer, so chat messages cannot be encoded: use "
                            "/v1/completions with a prompt of token ids", "messages")
    try:
        text = engine.chat.render(clean)
    except MemraError as exc:
        raise ApiError(400, str(exc), "messages") from None
    return _encode(engine, text, "messages")


def _content(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}.content must be a string or an array of text parts "
                        "({\"type\": \"text\", \"text\": ...}); memra serves text only", f"{where}.content")


def _encode(engine, text: str, param: str) -> list[int]:
    if engine.tokenizer is None:
        raise ApiError(400, "this checkpoint has no tokenizer: send the prompt as an array of token ids", param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON's \ud800 escapes: a lone surrogate is no text
        raise ApiError(400, f"the {param} is not valid Unicode (a lone surrogate at character {exc.start}): "
                            "send UTF-8 text", param) from None
    ids = engine.tokenizer.encode(text)
    if not ids:
        raise ApiError(400, f"the {param} is empty after tokenization: give some text", param)
    return ids


def _sampling(engine, f: _Fields):
    values = {name: f.get(name, int if name in ("top_k", "seed") else float) for name in SAMPLING_FIELDS}
    if values["top_k"] == -1:      # vLLM's spelling of "off"
        values["top_k"] = 0
    try:
        sampling = inputs.sampling_params(SimpleNamespace(**values), engine.source)
        if sampling is None:  # greedy: the filter values are unused, yet a bad one is still a bad request
            SamplingParams(**{k: v for k, v in values.items() if v is not None and k != "temperature"})
        return sampling
    except MemraError as exc:      # the CLI's message names its flags: name the request's fields
        message, param = str(exc), None
        for name in SAMPLING_FIELDS:
            for spelling in ("--" + name.replace("_", "-"), f"SamplingParams.{name}"):
                if spelling in message:
                    message, param = message.replace(spelling, name), name
        raise ApiError(400, message, param) from None


def _stops(engine, f: _Fields) -> tuple[str, ...]:
    stop = f.body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop must be a non-empty string or an array of at most {MAX_STOPS} of them", "stop")
    if engine.tokenizer is None:
        raise ApiError(400, "stop strings need text, and this checkpoint has no tokenizer: drop stop", "stop")
    return tuple(stops)


def _logprobs(f: _Fields, chat: bool) -> int | None:
    if not chat:
        return f.bounded("logprobs", int, 0, MAX_TOP_LOGPROBS)
    top = f.bounded("top_logprobs", int, 0, MAX_TOP_LOGPROBS)
    if not f.get("logprobs", bool, default=False):
        if top:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def _draft(engine, f: _Fields, job: Job) -> None:
    name = f.body["draft"] if "draft" in f.body else engine.default_draft
    if isinstance(name, str) and name.strip().lower() == "none":
        name = None
    if name is not None and not isinstance(name, str):
        raise ApiError(400, f"draft must be a draft-source name or null (plain decoding), got {name!r}", "draft")
    k = f.get("num_draft_tokens", int)
    p_min = f.bounded("p_min", float, 0.0, 1.0)
    pmin0 = f.get("p_min0", bool, default=False)
    job.draft = name
    if name is None:
        given = [n for n, v in (("num_draft_tokens", k), ("p_min", p_min), ("p_min0", pmin0 or None)) if v is not None]
        if given:
            one = len(given) == 1
            raise ApiError(400, f"{' and '.join(given)} {'is' if one else 'are'} for speculative decoding, and this "
                                f"request is plain (draft null): drop {'it' if one else 'them'} or name a draft "
                                "source", given[0])
        return
    drafter = engine.drafter(name)
    bound = min(MAX_K, getattr(drafter, "max_k", MAX_K))
    if k is not None and not 1 <= k <= bound:
        raise ApiError(400, f"num_draft_tokens={k} is outside 1..{bound} (a round verifies K + 1 <= {MAX_K + 1} "
                            f"rows, and {name} drafts at most {bound})", "num_draft_tokens")
    if pmin0 and not p_min:
        raise ApiError(400, "p_min0 widens the p_min gate to the first draft: give p_min > 0 too", "p_min0")
    if len(job.prompt) < 2:
        raise ApiError(400, "speculative decoding needs a prompt of at least 2 tokens: give a longer prompt, "
                            "or draft: null for plain decoding", "prompt")
    job.num_draft_tokens = k if k is not None else min(engine.default_k, bound)
    job.p_min, job.pmin0 = p_min or 0.0, pmin0


def _max_tokens(engine, f: _Fields, job: Job) -> int:
    name = "max_completion_tokens" if f.body.get("max_completion_tokens") is not None else "max_tokens"
    asked = f.get(name, int)
    if asked is not None and asked < 1:
        raise ApiError(400, f"{name}={asked} is out of range: ask for at least 1 token", name)
    n, ctx = len(job.prompt), engine.max_ctx
    reserve = spec_context(0, 0, job.num_draft_tokens) if job.draft is not None else 0
    room = ctx - n - reserve
    why = f" ({reserve} positions stay free for a speculative round)" if reserve else ""
    if room < 1:
        fixes = [f"shorten the prompt to at most {ctx - reserve - 1} tokens"] if ctx - reserve > 1 else []
        if reserve:
            fixes.append("send draft: null (plain decoding keeps no positions free)")
        raise ApiError(400, f"the prompt is {n} tokens and the context is {ctx}{why}, which leaves no room to "
                            f"generate: {' or '.join(fixes)}", "prompt", "context_length_exceeded")
    if asked is not None and asked > room:
        raise ApiError(400, f"{name}={asked} does not fit: the context is {ctx} tokens and the prompt takes {n}"
                            f"{why}, leaving {room}; lower {name} or shorten the prompt", name,
                       "context_length_exceeded")
    return asked if asked is not None else min(engine.default_max_tokens, room)

