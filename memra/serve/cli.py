"""`memra serve` / `python -m memra.serve`: the OpenAI-compatible server's command line.

    memra serve                                         # the demo model on http://127.0.0.1:8000
    memra serve --checkpoint DIR --backend cuda --port 8080 --draft-option dflash2:path=DRAFTER
    memra serve --max-sessions 16 --max-queue 128 --burst-tokens 16 --request-timeout 120

The model is resolved as `python -m memra.run` resolves it (--checkpoint, else the demo). The
socket is bound here (port 0 picks a free one) and the line `memra serve: listening on URL`
goes to stderr once it is open. SIGTERM or Ctrl-C stops taking connections, lets in-flight
requests finish for up to --shutdown-grace seconds, then cancels what is left and exits 0.
Refusals print `memra serve: <problem and fix>` and exit 2.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import traceback
from types import SimpleNamespace

from memra.cli.args import UsageError, add_placement_flags, check_placement, number_arg
from memra.errors import MemraError
from memra.limits import MAX_K

PROG = "memra serve"
EXIT_REFUSED = 2
EXIT_INTERRUPTED = 130
FORCE_AFTER_S = 5.0    # past the grace period, how long uvicorn waits before it cuts connections


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see {PROG} --help)")


def _draft_option(text: str) -> tuple[str, str, str]:
    source, colon, pair = text.partition(":")
    key, eq, value = pair.partition("=")
    if not (colon and eq and source and key):
        raise UsageError(f"--draft-option takes SOURCE:KEY=VALUE (for example dflash2:path=DIR), got {text!r}")
    return source, key, value


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="Serve a glm5_next checkpoint (or the built-in demo model) over the "
                 "OpenAI HTTP API, with speculative decoding: /v1/completions, /v1/chat/completions (streamed "
                 "with stream: true), /v1/models, /health, /metrics.")
    pos = lambda name: number_arg(int, name, lo=1, why="must be an integer >= 1")  # noqa: E731
    src = ap.add_argument_group("model")
    src.add_argument("--checkpoint", "--model", dest="checkpoint", metavar="DIR",
                     help="checkpoint directory (default: the built-in demo model)")
    src.add_argument("--backend", default="auto", choices=("auto", "numpy", "cuda"), help="default auto")
    add_placement_flags(src)
    src.add_argument("--max-ctx", type=number_arg(int, "--max-ctx", lo=2, why="must be an integer >= 2"), metavar="N",
                     help="context cap per request, prompt + generated (default: max_position_embeddings)")
    src.add_argument("--served-model-name", metavar="NAME", type=_model_name, help="the model id clients send "
                     "(default: the checkpoint directory's name, memra-demo for the demo)")
    src.add_argument("--default-max-tokens", type=pos("--default-max-tokens"), default=256, metavar="N",
                     help="max_tokens when a request leaves it out (default 256, lowered to fit the context)")

    net = ap.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    net.add_argument("--port", type=number_arg(int, "--port", lo=0, hi=65535, why="must be in 0..65535 (0: any "
                     "free port)"), default=8000, help="default 8000")

    spec = ap.add_argument_group("speculative decoding")
    spec.add_argument("--draft", metavar="NAME", help="draft source for requests that name none, or 'none' "
                      "(default: native-mtp when the model has an MTP block, else none)")
    spec.add_argument("--num-draft-tokens", "-k", type=number_arg(int, "--num-draft-tokens", lo=1, hi=MAX_K,
                      why=f"must be in 1..{MAX_K}"), default=4, metavar="K", help="default K (4)")
    spec.add_argument("--draft-option", type=_draft_option, action="append", default=[],
                      metavar="SOURCE:KEY=VALUE", help="an option of a draft source, e.g. dflash2:path=DIR "
                      "(repeatable; VALUE read as JSON when it parses)")
    spec.add_argument("--drafts", metavar="A,B", help="the draft sources requests may name (default: every "
                      "registered source that loads)")

    sched = ap.add_argument_group("scheduling")
    sched.add_argument("--burst-tokens", type=pos("--burst-tokens"), default=8, metavar="N",
                       help="tokens a session makes per turn before the next session's turn (default 8)")
    sched.add_argument("--max-sessions", type=pos("--max-sessions"), default=8, metavar="N",
                       help="live sessions, each with its own cache (default 8)")
    sched.add_argument("--max-queue", type=number_arg(int, "--max-queue", lo=0, why="must be an integer >= 0"),
                       default=64, metavar="N", help="requests waiting for a session; past it: 503 (default 64)")
    sched.add_argument("--request-timeout", type=number_arg(float, "--request-timeout", lo=0, lo_open=True,
                       why="must be a number > 0"), default=600.0, metavar="S", help="seconds (default 600)")
    sched.add_argument("--shutdown-grace", type=number_arg(float, "--shutdown-grace", lo=0, why="must be >= 0"),
                       default=30.0, metavar="S", help="on SIGTERM, seconds in-flight requests get to finish "
                       "(default 30)")

    out = ap.add_argument_group("output")
    out.add_argument("--no-warmup", action="store_true", help="skip the short warm-up run per draft source")
    out.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    out.add_argument("--access-log", action="store_true", help="log every request line")
    out.add_argument("--debug", action="store_true", help="show tracebacks of refusals")
    return ap


def _model_name(text: str) -> str:
    if not text.strip() or not text.isprintable():
        raise UsageError(f"--served-model-name {text!r}: a model id clients can send is printable text, not "
                         "empty or blank")
    return text


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    err = sys.stderr
    try:
        args = build_parser().parse_args(argv)
        return _serve(args, err)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:  # Ctrl-C while the model loads or warms up (uvicorn handles it once serving)
        print("memra serve: interrupted before serving", file=err)
        return EXIT_INTERRUPTED
    except (UsageError, MemraError) as exc:
        if "--debug" in argv:
            traceback.print_exc(file=err)
        print(f"memra serve: {exc}", file=err)
        return EXIT_REFUSED


def _serve(args, err) -> int:
    try:
        import uvicorn  # noqa: F401  the serve extra, checked before any model loads

        import memra.serve.app  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"memra serve needs the serve extra ({exc.name} is missing): "
                         "pip install 'memra[serve]'") from None
    check_placement(args)
    if not args.ranks:
        return _serve_http(args, err)
    from memra import load_ranked
    from memra.cli.inputs import model_source

    checkpoint = model_source(SimpleNamespace(checkpoint=args.checkpoint), err).path
    model = load_ranked(checkpoint, backend=args.backend)  # every rank its stage; the last one serves
    if not model.driver:
        model.serve()
        return 0
    try:
        return _serve_http(args, err, model, checkpoint)
    finally:
        model.close()  # the other ranks stop with the server


def _serve_http(args, err, model=None, checkpoint=None) -> int:
    import uvicorn

    from memra.cli.inputs import draft_options
    from memra.serve.app import ServeSettings, create_app
    from memra.serve.engine import Engine, EngineOptions

    options: dict = {}
    for source, key, value in args.draft_option:
        options.setdefault(source, []).append((key, value))
    drafts = None if args.drafts is None else tuple(n.strip() for n in args.drafts.split(",") if n.strip())
    engine = Engine(EngineOptions(
        checkpoint=checkpoint or args.checkpoint, backend=args.backend, stages=args.gpus or 1,
        stage_layers=args.stage_layers, max_ctx=args.max_ctx,
        draft=args.draft, num_draft_tokens=args.num_draft_tokens,
        draft_options={source: draft_options(pairs) for source, pairs in options.items()}, drafts=drafts,
        served_model_name=args.served_model_name, default_max_tokens=args.default_max_tokens), err, model=model)
    if not args.no_warmup:
        engine.warm_up()
    app = create_app(engine, ServeSettings(args.burst_tokens, args.max_sessions, args.max_queue,
                                           args.request_timeout))
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"memra serve: {engine.describe()}", file=err)
    print(f"memra serve: listening on http://{host}:{port} (OpenAI API under /v1; /health, /metrics)",
          file=err, flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_grace + FORCE_AFTER_S)
    server = _uvicorn_server(uvicorn, config, app.state.scheduler, args.shutdown_grace)
    # uvicorn handles SIGTERM / SIGINT while it serves (stop listening, drain, shut down), then
    # raises the signal again under the handlers it found: these make that a clean exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    print("memra serve: stopped", file=err, flush=True)
    return 0


def _uvicorn_server(uvicorn, config, scheduler, grace_s: float):
    """uvicorn's Server, whose first SIGTERM / SIGINT also starts the scheduler draining: what is
    still running when the grace period ends gets a 503 its client can read, before uvicorn
    would cut the connection."""

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            scheduler.drain(grace_s)
            super().handle_exit(sig, frame)

    return Server(config)


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket for uvicorn (port 0: a free one). Made with getaddrinfo's
    protocol number: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say IPPROTO_TCP,
    and without it every response waits out a 40 ms delayed ACK. It listens before it is
    returned, so a client that connects on the "listening on" line, before uvicorn's loop runs,
    waits in the backlog instead of being refused (uvicorn listens on it again with its own)."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise UsageError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): choose another --host or "
                         "--port (0 picks a free port)") from None
    return sock
