"""generate()'s streaming and timing (what the CLI is built on), the CLI's printers, and main() in-process.
The CLI as a user runs it is tested in a subprocess in tests/test_cli_*.py."""

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
import tomllib

from memra import SamplingParams, load_model
from memra.cli.output import Progress, TextPrinter
from memra.generate import generate
from memra.run import main
from memra.speculative.metrics import SpecMetrics
from memra.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [1, 2, 3, 4, 5, 6]


@pytest.fixture(scope="module")
def mini(fixture_dir):
    return load_model(fixture_dir("mini"), backend="numpy")


def test_plain_greedy_generate_takes_the_argmax_each_step(mini):
    out = generate(mini, [1, 2, 3], 5).tokens
    cache = mini.new_cache(8)
    logits = mini.prime([1, 2, 3], cache)
    for tok in out:
        assert tok == int(np.argmax(logits))
        logits = mini.decode_step(tok, cache)


@pytest.mark.parametrize("draft", [None, "native-mtp"])
@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.9, top_p=0.9, seed=4)],
                         ids=["greedy", "sampled"])
def test_on_tokens_streams_exactly_the_tokens_and_changes_none(mini, draft, sampling):
    calls = []
    kw = {"draft": draft, "num_draft_tokens": 3, "sampling": sampling}
    streamed = generate(mini, PROMPT, 21, on_tokens=lambda ids, m: calls.append((ids, m)), **kw)
    silent = generate(mini, PROMPT, 21, **kw)
    assert streamed.tokens == silent.tokens and len(streamed.tokens) == 21
    assert [t for ids, _ in calls for t in ids] == streamed.tokens
    assert len(calls) > 1 and all(ids and isinstance(m, SpecMetrics) for ids, m in calls)


@pytest.mark.parametrize("draft", [None, "native-mtp"])
def test_streaming_stops_at_the_first_eos(mini, draft):
    tape = generate(mini, PROMPT, 20).tokens
    eos = (tape[5],)
    got = []
    result = generate(mini, PROMPT, 20, draft=draft, eos=eos, on_tokens=lambda ids, m: got.extend(ids))
    assert got == result.tokens == tape[:tape.index(tape[5]) + 1]


@pytest.mark.parametrize("draft", [None, "native-mtp"])
def test_stats_split_prefill_from_decode_and_leave_the_callback_out(mini, draft):
    naps = []
    result = generate(mini, PROMPT, 4, draft=draft, on_tokens=lambda ids, m: naps.append(time.sleep(0.1)))
    stats = result.stats
    assert len(naps) >= 3 and 0 < stats["prefill_s"] and 0 < stats["decode_s"] < 0.25  # the naps are left out
    assert {"num_drafts", "accepted_per_pos", "seconds"} <= set(stats)


def test_main_in_process_prints_text_then_one_json_line(fixture_dir, capsys):
    small = fixture_dir("small")
    assert main(["--checkpoint", small, "--prompt", "The quick brown fox", "-n", "6", "--backend", "numpy",
                 "--json"]) == 0
    out = capsys.readouterr()
    record = json.loads(out.out.split("\n")[-2])
    model = load_model(small, backend="numpy")
    assert record["tokens"] == generate(model, list(b"The quick brown fox"), 6).tokens
    assert out.err.startswith(f"memra: {small}\n") and "draft native-mtp" in out.err


def test_help_and_version_exit_0(capsys):
    assert main(["--help"]) == 0 and "--checkpoint DIR, --model DIR" in capsys.readouterr().out
    assert main(["--version"]) == 0


def test_the_console_script_is_this_main():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["memra"] == "memra.run:main"
    assert any(dep.startswith("tokenizers") for dep in project["dependencies"])


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_sees_control_bytes_escaped_and_a_pipe_gets_them_raw():
    for out, expect in ((_Terminal(), "a\\x1b[2Jb\\x07\n\tc\n"), (io.StringIO(), "a\x1b[2Jb\x07\n\tc\n")):
        printer = TextPrinter(out, ByteTokenizer(), [])
        printer.push(list(b"a\x1b[2Jb\x07\n\tc"))
        printer.finish()
        assert out.getvalue() == expect


class _InterruptedAtFlush(io.StringIO):
    """Ctrl-C arriving just after the text reached the pipe (inside flush)."""

    def __init__(self):
        super().__init__()
        self.interrupt = True

    def flush(self):
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt


def test_ctrl_c_inside_a_write_still_ends_the_line():
    out = _InterruptedAtFlush()
    printer = TextPrinter(out, ByteTokenizer(), [])
    with pytest.raises(KeyboardInterrupt):
        printer.push(list(b"ab"))
    printer.finish()
    assert out.getvalue() == "ab\n"


def test_the_progress_line_needs_stderr_on_a_terminal_and_stdout_elsewhere(monkeypatch):
    monkeypatch.setattr(Progress, "DELAY_S", 0.0)
    monkeypatch.setattr(Progress, "EVERY_S", 0.0)
    metrics = SpecMetrics()
    metrics.record(4, 2)
    err = _Terminal()
    progress = Progress(err, io.StringIO(), 10)
    progress.update(3, metrics)
    progress.clear()
    assert "3/10 tokens" in err.getvalue() and "mean acceptance length 3.00" in err.getvalue()
    assert err.getvalue().endswith("\r\x1b[K")
    for err, out in ((io.StringIO(), io.StringIO()), (_Terminal(), _Terminal())):
        Progress(err, out, 10).update(3, metrics)
        assert err.getvalue() == ""
