"""`python -m memra.run` end to end, in a subprocess, on a small random checkpoint (byte-level vocab
256, so text round-trips and nothing depends on trained weights): the summary, the JSON record,
speculative == plain greedy for every built-in draft source, seeded sampling, --list-drafters,
Ctrl-C. The demo model memra ships has its own tests: tests/test_cli_demo.py."""

import os
import signal
import subprocess
import sys

import pytest
from cli_helpers import ROOT, TEXT_PROMPT, as_printed, ok_json, run_cli, run_on, streamed

from memra.cli.output import JSON_KEYS
from memra.config import preset
from memra.tokenizer import ByteTokenizer

N = 12


@pytest.fixture(scope="module")
def ckpt(fixture_dir):
    """The `small` preset, seed 0: an MTP block, so native-mtp is the default draft."""
    return fixture_dir("small")


def test_a_run_summarises_on_stderr_and_ends_stdout_with_the_documented_json(ckpt):
    proc = run_on(ckpt, "--max-new-tokens", N, "--json", "--ignore-eos")
    rec = ok_json(proc)
    assert proc.stderr.startswith(f"memra: {ckpt}\n") and "demo" not in proc.stderr
    assert "draft native-mtp, K=4 (default: the model has an MTP block)" in proc.stderr
    assert "acceptance: mean length" in proc.stderr
    assert tuple(rec) == JSON_KEYS
    assert rec["new_tokens"] == len(rec["tokens"]) == N
    assert rec["prompt_tokens"] == len(TEXT_PROMPT.encode())
    assert rec["draft"] == "native-mtp" and rec["num_draft_tokens_k"] == 4
    assert rec["backend"] in ("numpy", "cuda") and (rec["device"] == "cpu") == (rec["backend"] == "numpy")
    assert rec["seed"] is None
    assert rec["num_drafts"] > 0 and rec["num_draft_tokens"] == 4 * rec["num_drafts"]
    assert rec["acceptance_rate"] == rec["num_accepted_tokens"] / rec["num_draft_tokens"]
    assert rec["mean_acceptance_length"] == 1 + rec["num_accepted_tokens"] / rec["num_drafts"]
    assert len(rec["accepted_per_pos"]) == 4 and set(rec["phase_s"]) == {"draft", "verify", "accept", "roll", "maint"}
    assert rec["prefill_s"] > 0 and rec["decode_s"] > 0 and rec["tokens_per_s"] > 0
    assert all(isinstance(t, int) and 0 <= t < 256 for t in rec["tokens"])


@pytest.fixture(scope="module")
def plain(ckpt):
    """One plain greedy run (a non-ASCII prompt): the tape every speculative run below must equal."""
    return run_on(ckpt, "-n", 24, "--json", "--draft", "none", "--prompt", "héllo, wörld")


def test_streamed_text_is_the_decoded_tokens(plain):
    rec = ok_json(plain)
    assert streamed(plain) == as_printed(ByteTokenizer().decode(rec["tokens"]))
    assert rec["draft"] is None and rec["num_draft_tokens_k"] is None and rec["mean_acceptance_length"] is None


@pytest.fixture(scope="module")
def builtin_drafts(tmp_path_factory):
    """(name, extra flags) for every built-in source that can run on the `small` checkpoint."""
    drafts = [("native-mtp", ())]
    try:
        from memra.drafters.dflash2 import write_fixture_drafter
    except ImportError:
        return drafts
    path = write_fixture_drafter(tmp_path_factory.mktemp("dflash2"), preset("small"), seed=0)
    return drafts + [("dflash2", ("--draft-option", f"path={path}"))]


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_speculative_tokens_equal_plain_for_every_builtin_source(ckpt, plain, builtin_drafts, k):
    from memra.drafters.builtin import BUILTIN_SOURCES

    plain = ok_json(plain)
    ran = []
    for name, extra in builtin_drafts:
        spec = ok_json(run_on(ckpt, "-n", 24, "--json", "--draft", name, "-k", k, *extra, "--prompt", "héllo, wörld"))
        assert spec["tokens"] == plain["tokens"], name
        assert spec["draft"] == name and spec["num_draft_tokens"] > 0
        ran.append(name)
    missing = {name for name, _ in BUILTIN_SOURCES} - set(ran)
    if missing:
        pytest.skip(f"built-in sources {sorted(missing)} cannot run here (no fixture writer)")


def test_sampled_runs_are_reproducible_by_seed(ckpt):
    args = ("-n", 16, "--json", "--temperature", 0.9, "--top-p", 0.95, "--top-k", 40)
    a, b = (ok_json(run_on(ckpt, *args, "--seed", 7)) for _ in range(2))
    other = ok_json(run_on(ckpt, *args, "--seed", 8))
    assert a["tokens"] == b["tokens"] and a["seed"] == 7 and other["seed"] == 8
    assert a["tokens"] != other["tokens"]
    plain = [ok_json(run_on(ckpt, *args, "--seed", 7, "--draft", "none"))["tokens"] for _ in range(2)]
    assert plain[0] == plain[1]


def test_eos_stops_generation_and_ignore_eos_does_not(ckpt):
    tape = ok_json(run_on(ckpt, "-n", 10, "--json", "--ignore-eos"))["tokens"]
    stop = tape[3]
    cut = ok_json(run_on(ckpt, "-n", 10, "--json", "--eos", stop))
    assert cut["tokens"] == tape[:tape.index(stop) + 1]


def test_prompt_from_stdin_file_and_ids_agree(ckpt, tmp_path):
    text = "Grüße 🙂"
    (tmp_path / "p.txt").write_text(text, encoding="utf-8")
    ids = ",".join(str(b) for b in text.encode())
    runs = [run_on(ckpt, "-n", 6, "--json", *how, stdin=text if how[-1] == "-" else None)
            for how in (("--prompt", text), ("--prompt", "-"), ("--prompt-file", tmp_path / "p.txt"),
                        ("--prompt-ids", ids))]
    records = [ok_json(p) for p in runs]
    assert all(r["tokens"] == records[0]["tokens"] and r["prompt_tokens"] == len(text.encode()) for r in records)


def test_a_long_request_is_lowered_to_fit_the_context(ckpt):
    proc = run_on(ckpt, "-n", 10, "--max-ctx", 48, "--json")
    rec = ok_json(proc)
    assert rec["new_tokens"] == 48 - 19 - 22 and "lowered to 7" in proc.stderr


def test_list_drafters_names_the_builtins():
    proc = run_cli("--list-drafters")
    assert proc.returncode == 0
    table = dict(line.split(None, 1) for line in proc.stdout.splitlines())
    assert table["native-mtp"] == "built-in" and table["dflash2"] == "built-in"


def test_ctrl_c_keeps_the_partial_output_and_exits_130(ckpt):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "memra.run", "--checkpoint", ckpt, "--prompt", TEXT_PROMPT, "-n",
                             "3000", "--ignore-eos"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.read(1)                 # generation is under way
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert first and rest.endswith(b"\n")
    assert b"memra: interrupted after" in err and b"Traceback" not in err
