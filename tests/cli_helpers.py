"""Running `python -m memra.run` in a subprocess, as a user would, for the tests/test_cli_*.py files."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, cache=None, stdin=None, timeout=120, env=None) -> subprocess.CompletedProcess:
    """The CLI with `args`; the demo lives under `cache` (XDG_CACHE_HOME), never the user's own.

    stdout/stderr come back as str decoded from UTF-8 with no newline translation (a generated
    '\\r' stays a '\\r')."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "utf-8", **(env or {})}
    if cache is not None:
        environ["XDG_CACHE_HOME"] = str(cache)
    proc = subprocess.run([sys.executable, "-m", "memra.run", *map(str, args)], cwd=ROOT, env=environ,
                          input=None if stdin is None else stdin.encode(), capture_output=True, timeout=timeout,
                          check=False)
    proc.stdout = proc.stdout.decode("utf-8")
    proc.stderr = proc.stderr.decode("utf-8", errors="replace")
    return proc


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
