"""CLI edges: hostile bytes, closed descriptors, hostile checkpoints. Each is exit 2 and ONE
`memra: ...` line on stderr (no traceback, no "internal error"), and nothing printed before it.

The processes here are started by hand (not cli_helpers.run_cli) where the case needs raw bytes
in argv or stdin, or a descriptor closed before Python starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from cli_helpers import ROOT, run_cli

from memra.cli import main as cli_main
from memra.config import preset
from memra.errors import InputError


@pytest.fixture(scope="module")
def small(fixture_dir):
    return fixture_dir("small")


@pytest.fixture(scope="module")
def ckpt(no_mtp_dir):
    return no_mtp_dir


def raw_cli(*args, stdin: bytes | None = None, close: tuple = ()) -> subprocess.CompletedProcess:
    """The CLI with argv as given (bytes allowed), stdin as bytes, and the descriptors in `close`
    closed before the interpreter starts."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONIOENCODING", None)
    closer = (lambda: [os.close(fd) for fd in close]) if close else None
    return subprocess.run([sys.executable, "-m", "memra.run", *args], cwd=ROOT, env=env, input=stdin,
                          capture_output=not close, stdout=subprocess.PIPE if close else None,
                          stderr=subprocess.PIPE if close else None, preexec_fn=closer, timeout=120, check=False)


def refused(proc, needle: str) -> str:
    err = proc.stderr.decode("utf-8", "replace") if isinstance(proc.stderr, bytes) else proc.stderr
    assert proc.returncode == 2, err
    assert err.startswith("memra: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    assert needle in err, err
    return err


@pytest.mark.parametrize("args, needle", [
    ([b"--prompt", b"\xff\xfe hi"], "--prompt holds bytes that are not UTF-8"),
    ([b"--prompt-ids", b"1,2,3", b"--checkpoint", b"/tmp/\xff-no-such-dir"], "no such directory"),  # the last wins
    ([b"--prompt-ids", b"1,2,3", b"--draft", b"\xff"], "unknown draft source"),
    ([b"--prompt-ids", b"1,2,3", b"--draft-option", b"\xff=1"], "unknown options"),
], ids=["prompt", "checkpoint", "draft", "draft-option"])
def test_non_utf8_argv_is_one_line(small, args, needle):
    refused(raw_cli("--checkpoint", small, *args, b"-n", b"2"), needle)


def test_non_utf8_stdin_is_one_line(small):
    refused(raw_cli("--checkpoint", small, "--prompt", "-", "-n", "2", stdin=b"\xff\xfe hello"), "stdin is not UTF-8")


def test_closed_stdin_with_prompt_dash_is_one_line(small):
    refused(raw_cli("--checkpoint", small, "--prompt", "-", "-n", "2", close=(0,)), "stdin is closed")


@pytest.mark.parametrize("args", [["--prompt-ids", "1,2,3", "-n", "2"], ["--list-drafters"]])
def test_closed_stdout_is_one_line(small, args):
    refused(raw_cli("--checkpoint", small, *args, close=(1,)), "stdout is closed")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_full_output_device_is_one_line(small):
    with open("/dev/full", "wb") as full:
        proc = subprocess.run([sys.executable, "-m", "memra.run", "--checkpoint", small, "--prompt-ids", "1,2,3",
                               "-n", "2"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=full,
                              stderr=subprocess.PIPE, timeout=120, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and err.count("\n") == 1 and "cannot write the output (No space left" in err, err


def read_only_stderr():
    """fd 2 holding a file opened for reading, as a launcher's script leaves it (pyenv's shim
    under `2>&-`): Python's sys.stderr is then a stream every write to fails."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 2)


@pytest.mark.parametrize("how", ["closed", "read-only"])
def test_a_broken_stderr_loses_the_summary_not_the_run(small, how):
    argv = ("--checkpoint", small, "--prompt-ids", "1,2,3", "-n", "2", "--json")
    if how == "closed":
        proc = raw_cli(*argv, close=(2,))
    else:
        proc = subprocess.run([sys.executable, "-m", "memra.run", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=read_only_stderr,
                              timeout=120, check=False)
    assert proc.returncode == 0
    assert json.loads(proc.stdout.decode().splitlines()[-1])["new_tokens"] == 2


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_a_nested_json_checkpoint_file_is_one_line(ckpt, tmp_path, file):
    path = shutil.copytree(ckpt, tmp_path / "ckpt")
    (path / file).write_text("[" * 100_000 + "]" * 100_000)
    refused(run_cli("--checkpoint", path, "--prompt-ids", "1,2,3"), f"{file} is not valid JSON for memra")


def test_a_contract_breaking_checkpoint_is_one_line_and_debug_lists_every_offender(ckpt, tmp_path):
    path = shutil.copytree(ckpt, tmp_path / "ckpt")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "moe_intermediate_size": raw["moe_intermediate_size"] + 1}))
    err = refused(run_cli("--checkpoint", path, "--prompt-ids", "1,2,3"), "breaks the tensor contract")
    total = int(err.split("(")[1].split(" wrong shape")[0])
    assert total > 20 and "more wrong shape" in err
    proc = run_cli("--checkpoint", path, "--prompt-ids", "1,2,3", "--debug")
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert proc.stderr.count("  wrong shape: ") == total  # every offender, one per line
    assert proc.stderr.splitlines()[-1].startswith("memra: checkpoint ")


@pytest.mark.parametrize("key, value, needle", [
    ("top_k", 2.5, "top_k must be an integer, got 2.5"), ("top_k", "3", "top_k must be an integer"),
    ("temperature", "0.7", "temperature must be a number"), ("top_p", True, "top_p must be a number"),
    ("do_sample", "false", "do_sample must be true or false"),
])
def test_generation_config_values_are_refused_not_coerced(ckpt, tmp_path, key, value, needle):
    path = shutil.copytree(ckpt, tmp_path / "ckpt")
    gen = {"do_sample": True, "temperature": 0.7, "top_k": 3, key: value}
    (path / "generation_config.json").write_text(json.dumps(gen))
    refused(run_cli("--checkpoint", path, "--prompt-ids", "1,2,3", "-n", "2"), f"generation_config.json {needle}")
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 3}))
    assert run_cli("--checkpoint", path, "--prompt-ids", "1,2,3", "-n", "2").returncode == 0  # the green arm


def test_a_multi_line_refusal_is_printed_on_one_line(monkeypatch, capsys):
    """Whatever raises (a plugin's error may hold newlines), the CLI prints one line."""
    def fail(*args, **kwargs):
        raise InputError("first line\nsecond line\n\nthird")
    monkeypatch.setattr(cli_main, "_run", fail)
    assert cli_main.main(["-n", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "memra: first line | second line | third\n"


def test_max_ctx_past_what_memory_holds_is_refused_with_the_number_that_fits(small, monkeypatch, capsys):
    """The CLI sizes the context by memra.memory.context_limit: memory, when it is the tighter bound."""
    from memra import memory
    from memra.config import ModelConfig

    per_pos, fixed = memory.cache_bytes(ModelConfig.from_dict(preset("small")))
    monkeypatch.setattr(memory, "free_bytes", lambda be: fixed + per_pos * 100)
    assert cli_main.main(["--checkpoint", small, "--max-ctx", "200", "--prompt-ids", "1,2,3", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memra: --max-ctx 200 is past the cache that fits in the") and err.count("\n") == 1
    assert "(100): give at most 100" in err
    assert cli_main.main(["--checkpoint", small, "--prompt-ids", "1,2,3", "-n", "1000", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "--max-new-tokens 1000 lowered to 75" in err and json.loads(out.splitlines()[-1])["new_tokens"] <= 75


def test_an_oserror_that_is_not_the_output_is_an_internal_error_line(monkeypatch, capsys):
    def broken(*args):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(cli_main, "_run", broken)
    assert cli_main.main(["--prompt-ids", "1,2", "-n", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memra: internal error: PermissionError") and err.count("\n") == 1
