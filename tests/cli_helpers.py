"""Running `python -m memra.run` in a subprocess, as a user would, for the tests/test_cli_*.py files."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT_PROMPT = "The quick brown fox"     # 19 tokens on a byte-level (vocab 256) checkpoint
PROMPT_FLAGS = ("--prompt", "--prompt-file", "--prompt-ids")


def run_cli(*args, stdin=None, timeout=120, env=None) -> subprocess.CompletedProcess:
    """The CLI with `args`. stdout/stderr come back as str decoded from UTF-8 with no newline
    translation (a generated '\\r' stays a '\\r')."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "utf-8", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "memra.run", *map(str, args)], cwd=ROOT, env=environ,
                          input=None if stdin is None else stdin.encode(), capture_output=True, timeout=timeout,
                          check=False)
    proc.stdout = proc.stdout.decode("utf-8")
    proc.stderr = proc.stderr.decode("utf-8", errors="replace")
    return proc


def run_on(checkpoint, *args, **kw) -> subprocess.CompletedProcess:
    """run_cli on `checkpoint` (the CLI mechanics tests use a small random one, not the demo, so
    they are fast and do not depend on the demo's weights), prompted with TEXT_PROMPT unless
    `args` name a prompt."""
    prompt = () if set(PROMPT_FLAGS) & set(map(str, args)) else ("--prompt", TEXT_PROMPT)
    return run_cli("--checkpoint", checkpoint, *prompt, *args, **kw)


def ok_json(proc: subprocess.CompletedProcess) -> dict:
    """The JSON record that ends stdout of a successful --json run."""
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout.split("\n")[-2])


def streamed(proc: subprocess.CompletedProcess) -> str:
    """What a --json run printed before its JSON line."""
    body = proc.stdout[:-1]                 # the JSON line's own newline
    return body[:body.rfind("\n") + 1]


def as_printed(text: str) -> str:
    """`text` as the CLI prints it: a line that does not end in a newline gets one."""
    return text if text == "" or text.endswith("\n") else text + "\n"
