"""What the command line resolves before generating: the model directory (a checkpoint, or the
demo model memra ships), its generation_config.json, the prompt ids, the EOS
ids, the sampling parameters and the draft source.

Precedence everywhere: an explicit flag, then the checkpoint's generation_config.json (as
transformers reads it: greedy unless do_sample; top_k 50 when sampling and unset), then greedy.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from memra.cli.args import UsageError
from memra.config import read_optional_json
from memra.errors import CheckpointError, ConfigError, InputError
from memra.jsonfile import parse_json
from memra.model.tokens import check_token_ids

DEMO_DRAFT = "native-mtp"
GENERATION_CONFIG = "generation_config.json"
HF_TOP_K = 50          # transformers' GenerationConfig default when sampling
CONTEXT_SLACK = 22     # rows past the last token a speculative round may touch (K <= 14, plus 8)


@dataclass
class Source:
    path: str
    demo: bool
    generation: dict


def model_source(args, err=sys.stderr) -> Source:
    if args.checkpoint is None:
        path = demo_target()
        return Source(path, True, read_generation_config(path))
    path = os.path.expanduser(args.checkpoint)
    if not os.path.isdir(path):
        raise ConfigError(f"--checkpoint {args.checkpoint}: no such directory; point it at a checkpoint "
                          "(config.json + safetensors), or leave it out to run the demo")
    return Source(path, False, read_generation_config(path))


def demo_target() -> str:
    """The shipped demo model's directory (package data), refused by name when an install lost it."""
    from memra import demo_model

    if not os.path.isfile(os.path.join(demo_model.TARGET, "model.safetensors")):
        raise CheckpointError(f"the demo model is missing from this install ({demo_model.TARGET}): reinstall "
                              "memra (pip install -e .), or pass --checkpoint DIR")
    return demo_model.TARGET


def source_draft_options(name: str | None, options: dict | None, source: Source) -> dict | None:
    """The demo ships its DFlash2 drafter: `--draft dflash2` on the demo needs no path."""
    from memra import demo_model

    if name == "dflash2" and source.demo and "path" not in (options or {}):
        return {**(options or {}), "path": demo_model.DFLASH2}
    return options


def read_generation_config(path: str) -> dict:
    return read_optional_json(os.path.join(path, GENERATION_CONFIG))


def prompt_ids(args, source: Source, tokenizer, stdin=None) -> list[int]:
    if args.prompt_ids is not None:
        return list(args.prompt_ids)
    if args.prompt_file is not None:
        try:
            with open(os.path.expanduser(args.prompt_file), encoding="utf-8") as f:
                text = _bounded(f.read(MAX_PROMPT_CHARS + 1), f"--prompt-file {args.prompt_file}")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise UsageError(f"--prompt-file {args.prompt_file}: cannot read it ({why})") from None
    elif args.prompt == "-":
        text = _read_stdin(stdin or sys.stdin)
    elif args.prompt is not None:
        text = args.prompt
        if not _utf8(text):
            raise UsageError("--prompt holds bytes that are not UTF-8 text: pass UTF-8, or the ids with --prompt-ids")
    elif source.demo:
        from memra.demo_model import PROMPT

        text = PROMPT
    else:
        raise UsageError("no prompt: give --prompt TEXT, --prompt-file PATH, --prompt - (stdin) or --prompt-ids 1,2,3")
    if tokenizer is None:
        raise UsageError(f"{source.path} has no tokenizer.json (and its vocab is not byte-level), so text "
                         "cannot be tokenized: add tokenizer.json or use --prompt-ids")
    ids = tokenizer.encode(text)
    if not ids:
        raise UsageError("the prompt is empty after tokenization: give some text")
    return ids


def _utf8(text: str) -> bool:
    """False for text holding undecodable argv bytes (Python keeps them as lone surrogates)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


MAX_PROMPT_CHARS = 64 << 20  # far past any context (a token is a few characters); /dev/zero stops here


def _bounded(text, where: str):
    if len(text) > MAX_PROMPT_CHARS:
        raise UsageError(f"{where}: the prompt is longer than {MAX_PROMPT_CHARS >> 20} Mi characters, past any "
                         "model's context: give a shorter one")
    return text


def _read_stdin(stdin) -> str:
    if stdin is None or getattr(stdin, "closed", False):
        raise UsageError("--prompt -: stdin is closed: pipe the prompt in, or give --prompt TEXT or --prompt-file")
    try:
        raw = _bounded((stdin.buffer if hasattr(stdin, "buffer") else stdin).read(MAX_PROMPT_CHARS + 1), "--prompt -")
    except OSError as exc:
        raise UsageError(f"--prompt -: cannot read stdin ({exc.strerror or exc})") from None
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--prompt -: stdin is not UTF-8 text (byte {exc.start}): pass UTF-8, or the ids "
                         "with --prompt-ids") from None


def check_context(args, cfg, n_prompt: int, err=sys.stderr, limit: int | None = None,
                  why: str = "the model's max_position_embeddings") -> int:
    """The max_new_tokens that fits the context; refuses a prompt that does not fit at all.
    `limit` (what `why` names) is the largest context allowed: memra.memory.context_limit."""
    limit = cfg.max_position_embeddings if limit is None else limit
    if args.max_ctx is not None and args.max_ctx > limit:
        raise UsageError(f"--max-ctx {args.max_ctx} is past {why} ({limit}): give at most {limit}")
    ctx = args.max_ctx or limit
    where = "--max-ctx" if args.max_ctx else why
    room = ctx - n_prompt - CONTEXT_SLACK
    if room < 1:
        fixes = [f"shorten the prompt to at most {ctx - CONTEXT_SLACK - 1} tokens"] if ctx > CONTEXT_SLACK + 1 else []
        if args.max_ctx and n_prompt + CONTEXT_SLACK + 1 <= limit:
            fixes.append(f"raise --max-ctx to at least {n_prompt + CONTEXT_SLACK + 1}")
        fix = " or ".join(fixes) or "this model's context is too short for speculative decoding"
        raise UsageError(f"the prompt is {n_prompt} tokens and the context is {ctx} ({where}), which leaves no "
                         f"room to generate ({CONTEXT_SLACK} positions stay free for a speculative round): {fix}")
    if args.max_new_tokens > room:
        print(f"memra: --max-new-tokens {args.max_new_tokens} lowered to {room} to fit the context "
              f"({ctx}, {where})", file=err)
        return room
    return args.max_new_tokens


def eos_ids(args, source: Source, cfg) -> tuple[int, ...]:
    if args.ignore_eos:
        return ()
    if args.eos:
        ids = tuple(args.eos)
    elif "eos_token_id" in source.generation:
        raw = source.generation["eos_token_id"]
        ids = tuple(raw if isinstance(raw, list) else [raw] if raw is not None else [])
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConfigError(f"{GENERATION_CONFIG} eos_token_id must be an integer or a list of them, "
                              f"got {raw!r}; fix it or pass --eos ID")
    else:
        ids = tuple(cfg.eos_token_id)
    return tuple(check_token_ids(ids, cfg.vocab_size, "EOS id", allow_empty=True,
                                 fix="pass --eos with an id of this model, or --ignore-eos"))


def sampling_params(args, source: Source):
    """SamplingParams, or None for greedy."""
    from memra.speculative.sampling import SamplingParams

    gen = source.generation
    sampling = gen.get("do_sample", False)
    if not isinstance(sampling, bool):
        raise ConfigError(f"{GENERATION_CONFIG} do_sample must be true or false, got {sampling!r}: fix it")
    defaults = {"temperature": 1.0, "top_k": HF_TOP_K, "top_p": 1.0, "min_p": 0.0} if sampling else \
        {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    values = {}
    for key, default in defaults.items():
        flag = getattr(args, key)
        from_file = flag is None and sampling and gen.get(key) is not None
        if from_file:
            _check_generation_value(key, gen[key])
        values[key] = flag if flag is not None else gen[key] if from_file else default
    if values["temperature"] == 0:
        return None
    try:
        return SamplingParams(temperature=values["temperature"], top_k=values["top_k"], top_p=values["top_p"],
                              min_p=values["min_p"], seed=args.seed if args.seed is not None else 0)
    except InputError as exc:  # name the flag (or the file) the value came from
        message = str(exc)
        for key in values:
            origin = "--" + key.replace("_", "-") if getattr(args, key) is not None else f"{GENERATION_CONFIG} {key}"
            message = message.replace(f"SamplingParams.{key}", origin)
        raise InputError(message) from None


def _check_generation_value(key: str, value) -> None:
    """A sampling value from generation_config.json is taken as written or refused: never
    truncated (top_k 2.5 -> 2) or coerced from a string."""
    integer = key == "top_k"
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise ConfigError(f"{GENERATION_CONFIG} {key} must be {'an integer' if integer else 'a number'}, got "
                          f"{value!r}: fix it, or pass --{key.replace('_', '-')}")


def draft_choice(args, source: Source, cfg) -> tuple[str | None, str]:
    """(draft source or None for plain, why it was chosen)."""
    if args.draft is not None:
        name = args.draft.strip()
        if name.lower() == "none":
            return None, "--draft none"
        if not name:
            raise UsageError("--draft needs a name: see --list-drafters, or 'none' for plain decoding")
        return name, "--draft"
    if cfg.has_mtp:
        return DEMO_DRAFT, "default: the model has an MTP block"
    return None, "default: the model has no MTP block"


def draft_options(pairs) -> dict | None:
    options = {}
    for key, value in pairs:
        if key in options:
            raise UsageError(f"--draft-option {key} is given twice: give each option once")
        try:  # the guarded parser: a value nested past its bound stays a string, never a RecursionError
            options[key] = parse_json(value, f"--draft-option {key}", ValueError)
        except ValueError:
            options[key] = value
    return options or None


def check_plain_flags(args, draft) -> None:
    """Speculative-only flags with plain decoding would be ignored silently: refuse them."""
    if draft is not None:
        return
    given = [flag for flag, value in (("--num-draft-tokens", args.num_draft_tokens),
                                      ("--draft-option", args.draft_option), ("--p-min", args.p_min)) if value]
    _refuse_given(given, "speculative", "plain", "choose a draft source with --draft NAME")


def check_greedy_flags(args, sampling) -> None:
    """Sampling-only flags on a greedy run would be ignored silently: refuse them."""
    if sampling is not None:
        return
    given = [f"--{name.replace('_', '-')}" for name in ("top_k", "top_p", "min_p", "seed")
             if getattr(args, name) is not None]
    _refuse_given(given, "sampled", "greedy", "give --temperature T > 0")


def _refuse_given(flags: list[str], needs: str, run: str, fix: str) -> None:
    if flags:
        one = len(flags) == 1
        raise UsageError(f"{' and '.join(flags)} {'is' if one else 'are'} for {needs} decoding, and this run is "
                         f"{run}: drop {'it' if one else 'them'} or {fix}")


# generation_config.json keys that change transformers' tokens and that memra does not apply, each
# with its value that changes nothing
UNAPPLIED_GENERATION = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "num_beams": 1, "min_new_tokens": 0,
                        "min_length": 0, "bad_words_ids": None, "suppress_tokens": None,
                        "begin_suppress_tokens": None}


def unapplied_generation(source: Source) -> list[str]:
    """What the checkpoint's generation_config.json asks for that memra does not do (a note, not a
    refusal: the file is the checkpoint's default, and no flag could take it back)."""
    gen = source.generation
    asked = [f"{key} {gen[key]!r}" for key, neutral in UNAPPLIED_GENERATION.items()
             if gen.get(key) not in (neutral, None, [])]
    if not asked:
        return []
    return [f"{GENERATION_CONFIG} asks for {', '.join(asked)}, which memra does not apply (no penalty or "
            "constraint arm): the tokens can differ from transformers' generate"]
