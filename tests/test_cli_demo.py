"""The demo model memra ships (memra/demo_model): what `python -m memra.run` runs without
--checkpoint, on its own prompt, with its own DFlash2 drafter. Structure only: the shipped weights
may be retrained (same config, same tokenizer format), so nothing here depends on their values
(no acceptance bound, no exact text). The CLI's mechanics are tested on a small random checkpoint
in tests/test_cli_run.py; the demo's held-out loss and acceptance in tests/demo/."""

import json

import pytest
from cli_helpers import as_printed, ok_json, run_cli, streamed

from memra import demo_model
from memra.cli import main as cli_main
from memra.tokenizer import load_tokenizer

VOCAB = 8192   # the demo's config.json and tokenizer.json
EOS = 0        # its generation_config.json
N = 6


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(demo_model.TARGET, VOCAB)


def in_process(capsys, *flags) -> tuple[int, str, str]:
    """memra.cli.main.main on the demo (numpy, greedy): (exit status, stdout, stderr)."""
    status = cli_main.main(["-n", str(N), "--backend", "numpy", *map(str, flags)])
    out, err = capsys.readouterr()
    return status, out, err


def test_no_model_or_prompt_flag_runs_the_shipped_demo_on_its_prompt(tokenizer):
    proc = run_cli("-n", N, "--json")
    rec = ok_json(proc)
    assert proc.stderr.splitlines()[0] == (f"memra: the demo model ({demo_model.TARGET}; trained on CPython's "
                                           "standard library)")
    assert rec["prompt_tokens"] == len(tokenizer.encode(demo_model.PROMPT))
    assert rec["new_tokens"] == len(rec["tokens"]) and (rec["new_tokens"] == N or rec["tokens"][-1] == EOS)
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in rec["tokens"])
    assert rec["draft"] == "native-mtp" and "(default: the model has an MTP block)" in proc.stderr
    assert streamed(proc) == as_printed(tokenizer.decode(rec["tokens"]))


def test_greedy_speculative_on_the_demo_equals_plain_and_dflash2_needs_no_path(capsys):
    tapes = {}
    for draft in ("none", "native-mtp", "dflash2"):
        status, out, err = in_process(capsys, "--json", "--ignore-eos", "--draft", draft)
        assert status == 0, err
        rec = json.loads(out.splitlines()[-1])
        assert rec["new_tokens"] == N and (rec["draft"] is None) == (draft == "none")
        assert draft == "none" or rec["num_drafts"] > 0
        tapes[draft] = rec["tokens"]
    assert tapes["native-mtp"] == tapes["none"] and tapes["dflash2"] == tapes["none"]


def test_the_shipped_drafter_is_the_demos_only(capsys):
    """The same directory given with --checkpoint is not the demo: dflash2 needs its path there;
    and on the demo a path the user gives wins over the shipped one."""
    status, _, err = in_process(capsys, "--checkpoint", demo_model.TARGET, "--prompt", "x = 1", "--draft", "dflash2")
    assert status == 2 and err.startswith("memra: dflash2 needs the drafter checkpoint") and err.count("\n") == 1
    status, _, err = in_process(capsys, "--draft", "dflash2", "--draft-option", "path=/no/such/drafter")
    assert status == 2 and "path '/no/such/drafter' is not a directory" in err


def test_a_demo_missing_from_the_install_is_one_line_naming_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo_model, "TARGET", str(tmp_path))   # an install that lost the package data
    status, out, err = in_process(capsys)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"memra: the demo model is missing from this install ({tmp_path}): reinstall memra")
    assert "or pass --checkpoint DIR" in err
