"""The command line: every flag, its checks, and argparse refusals as one `memra: ...` line.

Each value is checked where it is parsed, so a bad one is named by its flag (`--top-p 1.5:
must be in (0, 1]`) before any model is loaded. Flags whose default depends on the checkpoint
(sampling, EOS, the draft source) default to None and are resolved in memra.cli.inputs.
"""

from __future__ import annotations

import argparse
import math

from memra.demo_model import PROMPT
from memra.limits import MAX_K

PROG = "python -m memra.run"


class UsageError(Exception):
    """A refused command line; main prints it as one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own refusals: one line, no usage block
        raise UsageError(f"{message} (see {PROG} --help)")


def number_arg(kind, name: str, lo=None, hi=None, lo_open=False, hi_open=False, why: str = ""):
    """An argparse type: parse with `kind`, then check the bounds, naming the flag."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise UsageError(f"{name} {text!r}: expected {'an integer' if kind is int else 'a number'}") from None
        bad = (isinstance(value, float) and not math.isfinite(value)) \
            or (lo is not None and (value <= lo if lo_open else value < lo)) \
            or (hi is not None and (value >= hi if hi_open else value > hi))
        if bad:
            raise UsageError(f"{name} {text}: {why}")
        return value
    return parse


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise UsageError(f"--draft-option takes KEY=VALUE (for example path=DIR), got {text!r}")
    return key, value


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers like 1,2,3, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty: give at least one token id, like 1,2,3")
    return ids


def add_placement_flags(group) -> None:
    """--gpus / --stage-layers / --ranks: the pipeline placement, the same for `memra.run` and `memra serve`."""
    group.add_argument("--gpus", type=number_arg(int, "--gpus", lo=1, why="must be an integer >= 1"), metavar="N",
                       help="split the trunk into N pipeline stages, stage s on local GPU s, balanced by weight "
                            "bytes (numpy: N stages in this process); same tokens as one stage")
    group.add_argument("--stage-layers", metavar="0-3,4-7",
                       help="the pipeline split by hand: one inclusive layer range per stage, covering every "
                            "trunk layer once, in order")
    group.add_argument("--ranks", action="store_true",
                       help="this process is one rank of a launcher-started group (torchrun, srun: RANK, "
                            "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): rank r runs stage r on GPU "
                            "LOCAL_RANK over NCCL, the last rank does the work")


def check_placement(args) -> None:
    """--ranks places one stage per process: no in-process split beside it."""
    if args.ranks and (args.gpus or args.stage_layers):
        raise UsageError("--ranks runs one stage per process (WORLD_SIZE stages, balanced by weight bytes): "
                         "drop --gpus / --stage-layers")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="Generate from a glm5_next checkpoint (or the built-in demo model), "
                 "plainly or with speculative decoding: same greedy tokens, same sampled distribution.",
                 epilog="Text streams to stdout; the summary goes to stderr. Errors print one line and exit 2.")
    src = ap.add_argument_group("model")
    src.add_argument("--checkpoint", "--model", dest="checkpoint", metavar="DIR",
                     help="checkpoint directory: config.json + safetensors, optional tokenizer.json and "
                          "generation_config.json (default: the demo model memra ships, trained on Python code)")
    src.add_argument("--backend", default="auto", choices=("auto", "numpy", "cuda"),
                     help="compute backend (default auto: cuda when usable, else numpy)")
    add_placement_flags(src)
    src.add_argument("--max-ctx", type=number_arg(int, "--max-ctx", lo=2, why="must be an integer >= 2"),
                     metavar="N", help="context cap, prompt + generated tokens (default: the model's "
                     "max_position_embeddings)")

    prompt = ap.add_argument_group("prompt (one of)").add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", help=f"prompt text; '-' reads stdin (demo default: "
                        f"{PROMPT!r})")
    prompt.add_argument("--prompt-file", metavar="PATH", help="read the prompt text from a UTF-8 file")
    prompt.add_argument("--prompt-ids", type=_prompt_ids, metavar="1,2,3", help="prompt token ids")

    gen = ap.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", "-n", type=number_arg(int, "--max-new-tokens", lo=0,
                     why="must be an integer >= 0"), default=64, metavar="N", help="default 64")
    gen.add_argument("--eos", type=number_arg(int, "--eos", lo=0, why="must be a token id >= 0"), action="append",
                     metavar="ID", help="stop after this token (repeatable; replaces the checkpoint's EOS ids)")
    gen.add_argument("--ignore-eos", action="store_true", help="generate all --max-new-tokens tokens")
    gen.add_argument("--temperature", type=number_arg(float, "--temperature", lo=0,
                     why="must be a finite number >= 0 (0 = greedy)"), metavar="T",
                     help="0 = greedy (default: generation_config.json, else greedy)")
    gen.add_argument("--top-k", type=number_arg(int, "--top-k", lo=0, why="must be an integer >= 0 (0 = off)"),
                     metavar="K", help="keep the K most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=number_arg(float, "--top-p", lo=0, hi=1, lo_open=True,
                     why="must be in (0, 1] (1 = off)"), metavar="P", help="nucleus mass (1 = off)")
    gen.add_argument("--min-p", type=number_arg(float, "--min-p", lo=0, hi=1, hi_open=True,
                     why="must be in [0, 1) (0 = off)"), metavar="P", help="drop tokens below P x the top one")
    gen.add_argument("--seed", type=number_arg(int, "--seed", lo=0, hi=2**64 - 1, why="must be an integer in "
                     "[0, 2^64)"), metavar="S", help="sampling seed (default 0): same seed, same tokens")

    spec = ap.add_argument_group("speculative decoding")
    spec.add_argument("--draft", metavar="NAME", help="draft source (see --list-drafters) or 'none' for plain "
                      "decoding (default: native-mtp when the model has an MTP block, else none)")
    spec.add_argument("--num-draft-tokens", "-k", type=number_arg(int, "--num-draft-tokens", lo=1, hi=MAX_K,
                      why=f"must be in 1..{MAX_K} (a round verifies K + 1 <= {MAX_K + 1} rows)"),
                      metavar="K", help="drafts per round (default 4)")
    spec.add_argument("--draft-option", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                      help="an option for the draft source (repeatable; VALUE read as JSON when it parses)")
    spec.add_argument("--p-min", type=number_arg(float, "--p-min", lo=0, hi=1, why="must be in [0, 1]"),
                      metavar="P", help="confidence gate: drafts stop at the first slot the drafter is "
                      "less sure of than P (default 0 = off)")
    spec.add_argument("--p-min0", action="store_true", help="let the gate drop even the first draft")

    out = ap.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="end stdout with one JSON line of stats and token ids")
    out.add_argument("--list-drafters", action="store_true", help="print each draft source and its origin, exit")
    out.add_argument("--plan", action="store_true", help="print the memory plan (bytes per device: weights by "
                     "dtype, cache at --max-ctx, buffers) against the backend's free memory and exit, reading no "
                     "tensor; exit 2 when it does not fit")
    out.add_argument("--preset", metavar="NAME", help="with --plan: plan a named config instead of a checkpoint "
                     "(full: GLM-5-Next as released; small, bench)")
    out.add_argument("--weights-dtype", choices=("bf16", "fp8"), help="with --plan --preset: the release "
                     "planned (default bf16)")
    out.add_argument("--debug", action="store_true", help="show tracebacks")
    out.add_argument("--version", action="version", version=f"memra {_version()}")
    return ap


def _refuse_dash_dash_values(argv) -> None:
    """`--flag=--` (or `-n--`): argparse drops a '--' value and hands the flag an empty list, past
    its type check, so such a flag would reach the run unchecked."""
    for arg in argv:
        if arg == "--":
            return
        flag, eq, value = arg.partition("=")
        if not eq and arg.startswith("-") and not arg.startswith("--") and len(arg) > 2:
            flag, value = arg[:2], arg[2:]
        if arg.startswith("-") and value == "--":
            raise UsageError(f"{flag}: '--' cannot be given as a flag's value (argparse takes it for the end of "
                             "the flags); a prompt that is '--' goes in --prompt-file or on stdin (--prompt -)")


# The flags each mode reads: any other flag given beside it would be dropped without a word.
MODE_FLAGS = {
    "list_drafters": {"list_drafters", "checkpoint", "backend", "debug"},
    "plan": {"plan", "checkpoint", "backend", "gpus", "stage_layers", "max_ctx", "json", "preset", "weights_dtype",
             "debug"},
}


def _refuse_unused_flags(args, parser) -> None:
    for mode, used in MODE_FLAGS.items():
        if getattr(args, mode):
            unused = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
                      if name not in used and value != parser.get_default(name)]
            if unused:
                raise UsageError(f"--{mode.replace('_', '-')} does not use {', '.join(unused)}: drop "
                                 f"{'it' if len(unused) == 1 else 'them'}")
    if args.preset and args.checkpoint:
        raise UsageError("--preset plans a named config and --checkpoint a checkpoint's files: give one")


def parse_args(argv):
    _refuse_dash_dash_values(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    _refuse_unused_flags(args, parser)
    check_placement(args)
    if args.eos and args.ignore_eos:
        raise UsageError("--eos and --ignore-eos contradict each other: give one")
    if (args.preset or args.weights_dtype) and not args.plan:
        raise UsageError("--preset and --weights-dtype choose what --plan plans: give --plan too")
    if args.weights_dtype and not args.preset:
        raise UsageError("--weights-dtype is the dtype of a --preset's plan (a checkpoint's headers give its own): "
                         "give --preset NAME, or drop --weights-dtype")
    if args.p_min0 and not args.p_min:
        raise UsageError("--p-min0 widens the --p-min gate to the first draft: give --p-min P > 0 too")
    return args


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("memra")
    except PackageNotFoundError:
        return "(not installed)"
