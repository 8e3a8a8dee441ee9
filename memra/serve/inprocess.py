"""The server in a thread of the calling process, on a free port: for code that drives it over
real HTTP without a subprocess (benchmarks/bench_serve.py; tests).

    with InProcessServer(create_app(engine, ServeSettings(burst_tokens=8))) as server:
        httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8})

uvicorn serves the app in a daemon thread, on a socket bound by memra.serve.cli.bind_socket (so
TCP_NODELAY is on: see there); the app's lifespan starts and stops its scheduler. The
constructor returns once uvicorn is accepting connections; close() asks it to exit and waits.
"""

from __future__ import annotations

import threading
import time

from memra.errors import MemraError
from memra.serve.cli import bind_socket

START_S = 20.0   # how long uvicorn gets to start accepting
STOP_S = 15.0    # how long it gets to drain and exit


class InProcessServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.app = app
        sock = bind_socket(host, port)
        self.port = sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="memra-uvicorn")
        self.thread.start()
        deadline = time.monotonic() + START_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.close()
                raise MemraError(f"the in-process server did not start within {START_S:g} s (see the log "
                                 "above for uvicorn's reason)")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(STOP_S)
        if self.thread.is_alive():
            raise MemraError(f"the in-process server did not stop within {STOP_S:g} s: a request is still "
                             "running; cancel it or give it fewer tokens")

    def __enter__(self) -> "InProcessServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
