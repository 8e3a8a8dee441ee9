"""What the command line prints: streamed text (stdout), a progress line and the summary
(stderr), and the one JSON record that ends stdout under --json.

    printer = TextPrinter(sys.stdout, tokenizer, prompt_ids)
    printer.push(new_ids); ...; printer.finish()
    print(summary(report), file=sys.stderr); print(json.dumps(record(report)))
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from memra.cli.plan import plan_line
from memra.speculative.metrics import PHASES
from memra.tokenizer import TextStream

JSON_KEYS = ("prompt_tokens", "new_tokens", "prefill_s", "decode_s", "tokens_per_s", "draft", "num_draft_tokens_k",
             "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_acceptance_length",
             "accepted_per_pos", "phase_s", "backend", "device", "seed", "memory_plan", "tokens")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # all but \t and \n


def _visible(text: str) -> str:
    """Control characters as \\xNN, so a random model cannot drive the terminal."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class TextPrinter:
    """Streams committed ids to `out` as text (as ids when there is no tokenizer)."""

    def __init__(self, out, tokenizer, prompt_ids):
        self.out = out
        self.tokens: list[int] = []
        self.stream = TextStream(tokenizer.decode, prompt_ids) if tokenizer is not None else None
        self.terminal = _isatty(out)
        self.at_line_start = True

    def push(self, new_ids) -> None:
        self.tokens.extend(int(t) for t in new_ids)
        if self.stream is None:
            self._write("".join(f"{t} " for t in new_ids))
        else:
            self._write(self.stream.push(new_ids))

    def finish(self) -> None:
        """Write what was held back, then end the line."""
        if self.stream is not None:
            self._write(self.stream.finish())
        if not self.at_line_start:
            self._write("\n")

    def _write(self, text: str) -> None:
        if not text:
            return
        # first: a Ctrl-C landing in the write or flush must still leave finish() ending the line
        self.at_line_start = text.endswith("\n")
        self.out.write(_visible(text) if self.terminal else text)
        self.out.flush()


class Progress:
    """One self-overwriting stderr line for long runs: tokens, tokens/s, acceptance.

    Shown only when stderr is a terminal and stdout is not (when both are the terminal, the
    streamed text is the progress, and a status line would tear it)."""

    DELAY_S, EVERY_S = 1.0, 0.25

    def __init__(self, err, out, total: int):
        self.err, self.total = err, total
        self.enabled = _isatty(err) and not _isatty(out)
        self.start = self.last = time.perf_counter()
        self.shown = False

    def update(self, n_tokens: int, metrics) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.start < self.DELAY_S or now - self.last < self.EVERY_S:
            return
        self.last = now
        line = f"memra: {n_tokens}/{self.total} tokens, {n_tokens / (now - self.start):.1f} tokens/s"
        if metrics.num_drafts:
            line += f", mean acceptance length {metrics.mean_acceptance_length:.2f}"
        self.err.write("\r\x1b[K" + line)
        self.err.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.err.write("\r\x1b[K")
            self.err.flush()
            self.shown = False


@dataclass
class Report:
    """Everything the summary and the JSON record are made from."""

    prompt_tokens: int
    tokens: list
    stats: dict
    draft: str | None
    draft_why: str
    k: int | None
    sampling: object          # SamplingParams or None (greedy)
    backend: str
    device: str
    model: str
    demo: bool
    stop: str
    load_s: float
    warmup_s: float = 0.0     # the untimed first generation that compiles CUDA kernels
    memory_plan: dict | None = None  # memra.memory_plan.MemoryPlan.to_dict() of the loaded model at this run's context


def record(rep: Report) -> dict:
    """The --json document: exactly JSON_KEYS."""
    s = rep.stats
    spec = rep.draft is not None
    rec = {
        "prompt_tokens": rep.prompt_tokens,
        "new_tokens": len(rep.tokens),
        "prefill_s": round(s["prefill_s"], 6),
        "decode_s": round(s["decode_s"], 6),
        "tokens_per_s": _rate(rep),
        "draft": rep.draft,
        "num_draft_tokens_k": rep.k if spec else None,
        "num_drafts": s["num_drafts"],
        "num_draft_tokens": s["num_draft_tokens"],
        "num_accepted_tokens": s["num_accepted_tokens"],
        "acceptance_rate": s["num_accepted_tokens"] / s["num_draft_tokens"] if s["num_draft_tokens"] else None,
        "mean_acceptance_length": s["mean_acceptance_length"] if spec else None,
        "accepted_per_pos": list(s["accepted_per_pos"]),
        "phase_s": {name: round(s["seconds"][name], 6) for name in PHASES},
        "backend": rep.backend,
        "device": rep.device,
        "seed": rep.sampling.seed if rep.sampling is not None else None,
        "memory_plan": rep.memory_plan,
        "tokens": list(rep.tokens),
    }
    assert tuple(rec) == JSON_KEYS
    return rec


def _rate(rep: Report) -> float | None:
    """Decode throughput: the tokens after the first (which the prefill makes) over decode_s."""
    n, seconds = len(rep.tokens) - 1, rep.stats["decode_s"]
    return round(n / seconds, 3) if n > 0 and seconds > 0 else None


def summary(rep: Report) -> str:
    s = rep.stats
    model = f"the demo model ({rep.model}; trained on CPython's standard library)" if rep.demo else rep.model
    mode = "greedy" if rep.sampling is None else _sampling_text(rep.sampling)
    draft = f"draft {rep.draft}, K={rep.k}" if rep.draft else "plain decoding"
    rate = _rate(rep)
    lines = [
        f"memra: {model}",
        (f"  {rep.prompt_tokens} prompt tokens -> {len(rep.tokens)} new tokens ({rep.stop}); "
         f"{rep.backend} on {rep.device}; {mode}; {draft} ({rep.draft_why})"),
        f"  load {rep.load_s:.2f} s, "
        + (f"kernel warm-up {rep.warmup_s:.2f} s (not counted), " if rep.warmup_s else "")
        + f"prefill {s['prefill_s']:.3f} s, decode {s['decode_s']:.3f} s"
        + (f", {rate:.1f} tokens/s" if rate is not None else ""),
    ]
    if plan_line(rep.memory_plan):
        lines.append(plan_line(rep.memory_plan))
    if rep.draft is not None:
        drafted, accepted = s["num_draft_tokens"], s["num_accepted_tokens"]
        share = f" ({100 * accepted / drafted:.1f}%)" if drafted else ""
        per_pos = " ".join(str(n) for n in s["accepted_per_pos"]) or "-"
        lines.append(f"  acceptance: mean length {s['mean_acceptance_length']:.2f} over {s['num_drafts']} rounds, "
                     f"{accepted} of {drafted} drafted tokens accepted{share}, per position {per_pos}")
        total = sum(s["seconds"].values())
        if total > 0:
            split = ", ".join(f"{name} {100 * s['seconds'][name] / total:.0f}%" for name in PHASES)
            lines.append(f"  round time by phase: {split}")
    return "\n".join(lines)


def _sampling_text(sp) -> str:
    parts = [f"temperature {sp.temperature:g}"]
    if sp.top_k:
        parts.append(f"top-k {sp.top_k}")
    if sp.top_p < 1:
        parts.append(f"top-p {sp.top_p:g}")
    if sp.min_p > 0:
        parts.append(f"min-p {sp.min_p:g}")
    return "sampled (" + ", ".join(parts) + f", seed {sp.seed})"


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
