"""`python -m memra.run` / `memra`: the generation command.

Order of work: parse and check every flag, resolve the model (checkpoint or demo), load it and
its tokenizer, build the prompt, generate while streaming text to stdout, then the summary on
stderr and (with --json) one JSON line on stdout. Refusals print `memra: <problem and fix>`
and exit 2; Ctrl-C keeps what was printed and exits 130; --debug shows tracebacks.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np

from memra.cli import inputs
from memra.cli.args import UsageError, parse_args
from memra.cli.plan import plan_command, run_plan
from memra.cli.output import Progress, Report, TextPrinter, record, summary
from memra.errors import MemraError
from memra.memory import context_limit, free_bytes
from memra.model.tokens import check_token_ids

EXIT_REFUSED = 2
EXIT_INTERRUPTED = 130
OUTPUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)  # a full or failing output device
DEFAULT_K = 4
WARMUP_PROMPT = 64   # long enough to reach the sparse (kpool) attention path


def main(argv=None) -> int:
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    out, err = sys.stdout, _writable(sys.stderr)
    _tolerant(out, "replace")
    _tolerant(err, "backslashreplace")   # a refusal quoting non-UTF-8 argv bytes still prints
    held = {}                            # the text printer, once there is one (for Ctrl-C)
    try:
        if out is None:                  # started with stdout closed (`>&-`)
            raise UsageError("stdout is closed, and memra writes the generated text there: redirect it "
                             "instead (> FILE, or > /dev/null)")
        args = parse_args(argv)
        if args.list_drafters:
            return _list_drafters(out)
        if args.plan:
            return plan_command(args, out, err)
        with np.errstate(all="ignore"):  # float overflow is judged by memra's own checks, not as warnings
            return _run(args, out, err, held)
    except SystemExit as exc:           # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        printer = held.get("printer")
        if printer is not None:
            printer.finish()
        n = len(printer.tokens) if printer is not None else 0
        print(f"memra: interrupted after {n} new tokens", file=err)
        return EXIT_INTERRUPTED
    except BrokenPipeError:              # the reader left (`| head`): nothing more to say
        _silence(out)
        return 0
    except OSError as exc:
        if exc.errno not in OUTPUT_ERRNOS:
            return _internal_error(exc, err, debug)
        print(f"memra: cannot write the output ({exc.strerror}): free some space, or redirect stdout elsewhere",
              file=err)
        return 1
    except (UsageError, MemraError) as exc:
        if debug:
            traceback.print_exc(file=err)
            for line in getattr(exc, "details", None) or ():  # e.g. every contract offender
                print(f"  {line}", file=err)
        print(f"memra: {one_line(exc)}", file=err)
        return EXIT_REFUSED
    except Exception as exc:
        return _internal_error(exc, err, debug)


def _internal_error(exc: Exception, err, debug: bool) -> int:
    """A bug, not a refusal: say so, and how to see it."""
    if debug:
        traceback.print_exception(exc, file=err)
    print(f"memra: internal error: {type(exc).__name__}: {one_line(exc)} (run with --debug for the "
          "traceback, and please report it)", file=err)
    return 1


@dataclass
class Job:
    """A checked request: everything generate() and the report need."""

    source: inputs.Source
    model: object
    load_s: float
    tokenizer: object
    prompt: list
    max_new: int
    draft: str | None
    draft_why: str
    k: int
    options: dict | None
    sampling: object
    eos: tuple
    p_min: float
    pmin0: bool
    free_before: int | None = None   # the backend's free bytes before the model loaded (the memory plan's budget)


def _prepare(args, err) -> Job | None:
    """The checked request; None on a rank that only follows (it has served the driver)."""
    from memra import load_model, load_ranked
    from memra.backend import get_backend

    source = inputs.model_source(args, err)
    free_before = free_bytes(get_backend(args.backend))
    t0 = time.perf_counter()
    if args.ranks:
        model = load_ranked(source.path, backend=args.backend)
        if not model.driver:
            model.serve()
            return None
    else:
        model = load_model(source.path, backend=args.backend, stages=args.gpus or 1, stage_layers=args.stage_layers)
    load_s = time.perf_counter() - t0
    try:
        return _request(args, err, source, model, load_s, free_before)
    except BaseException:
        _release(model)  # a refusal on the driving rank releases the others too
        raise


def _release(model) -> None:
    """The last call on a model that drives ranks (memra.model.ranks): the other ranks stop."""
    if getattr(model, "driver", False):
        model.close()


def _request(args, err, source, model, load_s: float, free_before) -> Job:
    from memra.tokenizer import load_tokenizer

    cfg = model.cfg
    tokenizer = load_tokenizer(source.path, cfg.vocab_size)
    prompt = inputs.prompt_ids(args, source, tokenizer)
    prompt = check_token_ids(prompt, cfg.vocab_size, "prompt token id")
    draft, draft_why = inputs.draft_choice(args, source, cfg)
    inputs.check_plain_flags(args, draft)
    if draft is not None and len(prompt) < 2:
        raise UsageError("speculative decoding needs a prompt of at least 2 tokens: give a longer prompt, "
                         "or --draft none")
    sampling = inputs.sampling_params(args, source)
    inputs.check_greedy_flags(args, sampling)
    room = inputs.check_context(args, cfg, len(prompt), err, *context_limit(cfg, model.be))
    for note in inputs.unapplied_generation(source):
        print(f"memra: {note}", file=err)
    return Job(source, model, load_s, tokenizer, prompt, room,
               draft, draft_why, args.num_draft_tokens or DEFAULT_K,
               inputs.source_draft_options(draft, inputs.draft_options(args.draft_option), source),
               sampling, inputs.eos_ids(args, source, cfg), args.p_min or 0.0, args.p_min0, free_before)


def _run(args, out, err, held: dict) -> int:
    job = _prepare(args, err)
    if job is None:
        return 0
    try:
        return _generate(args, out, err, held, job)
    finally:
        _release(job.model)


def _generate(args, out, err, held: dict, job: Job) -> int:
    from memra.generate import generate

    spec = {"draft": job.draft, "num_draft_tokens": job.k, "draft_options": job.options, "sampling": job.sampling}
    warmup_s = 0.0
    if job.model.be.compiles_on_first_use:  # build the kernels outside the timed run
        t0 = time.perf_counter()
        generate(job.model, job.prompt[:WARMUP_PROMPT], 2, **spec)
        warmup_s = time.perf_counter() - t0

    printer = held["printer"] = TextPrinter(out, job.tokenizer, job.prompt)
    progress = Progress(err, out, job.max_new)

    def on_tokens(new_ids, metrics):
        printer.push(new_ids)
        progress.update(len(printer.tokens), metrics)

    try:
        result = generate(job.model, job.prompt, job.max_new, eos=job.eos, p_min=job.p_min, pmin0=job.pmin0,
                          on_tokens=on_tokens, **spec)
    finally:
        progress.clear()
    printer.finish()
    tokens = result.tokens
    stop = ("EOS" if tokens and tokens[-1] in job.eos else
            "--max-new-tokens" if len(tokens) >= job.max_new else "context full")
    rep = Report(prompt_tokens=len(job.prompt), tokens=tokens, stats=result.stats, draft=job.draft,
                 draft_why=job.draft_why, k=job.k, sampling=job.sampling, backend=job.model.be.name,
                 device=job.model.be.device_name(), model=job.source.path, demo=job.source.demo, stop=stop,
                 load_s=job.load_s, warmup_s=warmup_s,
                 memory_plan=run_plan(job.source.path, job.model, len(job.prompt), job.max_new, job.draft, job.k,
                                      job.free_before))
    print(summary(rep), file=err, flush=True)
    if args.json:
        print(json.dumps(record(rep)), file=out, flush=True)
    return 0


def _list_drafters(out) -> int:
    from memra.drafters.registry import draft_source_origins

    origins = draft_source_origins()
    width = max(map(len, origins), default=0)
    for name, origin in origins.items():
        print(f"{name:<{width}}  {origin}", file=out)
    return 0


def one_line(exc: BaseException) -> str:
    """A message as one line, whatever raised it (a plugin's error may span several)."""
    return " | ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def _tolerant(stream, errors: str) -> None:
    """Never die on a character the stream's encoding lacks: print a replacement instead."""
    try:
        stream.reconfigure(errors=errors)
    except (AttributeError, ValueError):
        pass


def _writable(stream):
    """stderr, or /dev/null where it was closed (`2>&-`; its descriptor may since hold a file opened
    for reading, a launcher's script): the summary is lost, the run is not."""
    if stream is None:
        return open(os.devnull, "w")
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # no descriptor under it (a capture, a notebook): keep it
        return stream
    try:
        readable_only = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    except OSError:
        readable_only = True  # closed
    return open(os.devnull, "w") if readable_only else stream


def _silence(stream) -> None:
    """Point a closed pipe's descriptor at /dev/null so the interpreter's final flush stays quiet."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (AttributeError, OSError, ValueError):
        pass
