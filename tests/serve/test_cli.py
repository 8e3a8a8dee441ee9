"""`memra serve` as an operator runs it, in a subprocess: it reaches the server through the `memra`
command, refuses bad flags in one line, keeps the web stack out of `import memra`, and on SIGTERM
lets an in-flight stream finish (or ends it with an error event once the grace period is over) and
exits 0."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.cli_helpers import ROOT, run_cli

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "utf-8"}
WEB = ("fastapi", "starlette", "uvicorn", "prometheus_client", "httpx")


class ServeProcess:
    """`python -m memra.serve ...` with stderr read line by line in a thread."""

    def __init__(self, *args):
        self.proc = subprocess.Popen([sys.executable, "-m", "memra.serve", "--port", "0", "--backend", "numpy",
                                      *map(str, args)], cwd=ROOT, env=ENV, stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = None
        deadline = time.monotonic() + 60
        while self.url is None:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if "listening on http://" in line:
                self.url = line.split("listening on ")[1].split()[0]

    def _read(self):
        for line in self.proc.stderr:
            self.err.append(line)
            self.lines.put(line)

    def stop(self, timeout_s: float) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def serve_process():
    started = []

    def start(*args):
        started.append(ServeProcess(*args))
        return started[-1]

    yield start
    for p in started:
        p.kill()


def stream_in_thread(url: str, body: dict, first: threading.Event, out: dict) -> threading.Thread:
    def go():
        events = []
        try:
            with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                        break
                    if line.startswith("data: "):
                        events.append(json.loads(line[len("data: "):]))
                        first.set()
        except httpx.HTTPError as exc:   # the server cut the stream
            out["cut"] = type(exc).__name__
        out["events"] = events
        first.set()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def test_memra_serve_reaches_the_server_and_refuses_a_bad_flag_in_one_line():
    proc = run_cli("serve", "--port", "99999")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("memra serve: --port 99999: must be in 0..65535")
    help_ = run_cli("serve", "--help")
    assert help_.returncode == 0 and "--max-sessions" in help_.stdout and "--burst-tokens" in help_.stdout


def _connect_to_a_bound_socket() -> None:
    """Connect to bind_socket's socket before any server runs on it (raises if refused)."""
    import socket

    from memra.serve.cli import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass
    finally:
        sock.close()


def test_the_bound_socket_takes_a_connection_before_the_server_runs():
    """serve prints its "listening on" line between binding and uvicorn's start: a client that
    connects on the line is queued, not refused (a refused connect failed a SIGTERM test once)."""
    _connect_to_a_bound_socket()


def test_red_arm_a_bound_socket_that_does_not_listen_refuses_the_connection(monkeypatch):
    import socket

    monkeypatch.setattr(socket.socket, "listen", lambda self, *backlog: None)
    with pytest.raises(ConnectionRefusedError):
        _connect_to_a_bound_socket()


def test_a_missing_checkpoint_is_refused_before_anything_listens(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "memra.serve", "--checkpoint", str(tmp_path / "nope")], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no such directory" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags, message", [(["--ranks", "--gpus", "2"], "--ranks runs one stage per process"),
                                             (["--ranks", "--backend", "numpy"], "with torchrun")])
def test_ranks_without_a_launcher_or_beside_an_in_process_split_are_refused_in_one_line(flags, message):
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "memra.serve", *flags], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_import_memra_keeps_the_web_stack_out():
    code = ("import sys, memra, memra.run, memra.generate; "
            f"print([m for m in sys.modules if m.split('.')[0] in {WEB!r} or m.startswith('memra.serve')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_sigterm_lets_the_in_flight_stream_finish_then_exits_0(serve_process, small_dir):
    server = serve_process("--checkpoint", small_dir, "--no-warmup", "--drafts", "native-mtp", "--burst-tokens", 2,
                           "--shutdown-grace", 30)
    first, out = threading.Event(), {}
    thread = stream_in_thread(server.url, {"prompt": "Tell me", "max_tokens": 24, "stream": True,
                                           "return_token_ids": True}, first, out)
    assert first.wait(60)
    assert server.stop(60) == 0
    thread.join(30)
    assert out.get("done") and sum(len(e["choices"][0]["token_ids"]) for e in out["events"]) == 24
    assert out["events"][-1]["choices"][0]["finish_reason"] == "length"
    assert any("memra serve: stopped" in line for line in server.err)
    assert not any("Traceback" in line for line in server.err)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)


def test_sigterm_past_the_grace_period_ends_the_stream_with_a_503_event_and_exits_0(serve_process, small_dir):
    server = serve_process("--checkpoint", small_dir, "--no-warmup", "--drafts", "native-mtp", "--shutdown-grace",
                           0.5)
    first, out = threading.Event(), {}
    thread = stream_in_thread(server.url, {"prompt": "Tell me", "max_tokens": 1000, "stream": True,
                                           "return_token_ids": True}, first, out)
    assert first.wait(60)
    t0 = time.monotonic()
    assert server.stop(30) == 0
    thread.join(30)
    assert time.monotonic() - t0 < 15
    tokens = sum(len(e["choices"][0]["token_ids"]) for e in out["events"] if "choices" in e)
    assert out.get("done") and out["events"][-1]["error"]["code"] == "shutting_down" and tokens < 1000
    assert not any("Traceback" in line for line in server.err), "".join(server.err)


@pytest.mark.parametrize("name", ["", "   ", "a\nb"])
def test_a_served_model_name_clients_cannot_send_is_refused(name):
    proc = subprocess.run([sys.executable, "-m", "memra.serve", "--served-model-name", name], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--served-model-name" in proc.stderr and proc.stderr.count("\n") == 1


def test_ctrl_c_before_serving_is_one_line(monkeypatch, capsys):
    from memra.serve import cli

    def interrupted(args, err):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_serve", interrupted)
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "memra serve: interrupted before serving\n"
