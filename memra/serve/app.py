"""The HTTP face of the server: FastAPI routes over one Engine and its Scheduler.

    app = create_app(engine, ServeSettings(burst_tokens=8, max_sessions=8, max_queue=64))
    uvicorn.run(app)         # memra.serve.cli does this, on a socket it binds itself

Routes: POST /v1/completions and /v1/chat/completions (JSON, or server-sent events with
`stream: true`), GET /v1/models, /health and /metrics. A handler parses the body (memra.serve.
protocol), submits a Job and waits for the worker's first update before it answers, so a
refusal found when the session opens still gets its own HTTP status, streamed or not. Every
error leaves in OpenAI's shape {"error": {message, type, param, code}}, never as a traceback.
A client that goes away cancels its request (the session ends at the next burst boundary).
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from memra.errors import MemraError
from memra.serve.metrics import CONTENT_TYPE, ServeMetrics
from memra.serve.protocol import ApiError, parse_request
from memra.serve.scheduler import Scheduler
from memra.serve.shapes import Shape

log = logging.getLogger("memra.serve")
POLL_S = 0.5             # how often a waiting handler checks that its client is still there
CLIENT_GONE = 499        # the status logged for a request whose client left (nobody reads it)
MAX_BODY_BYTES = 32 << 20  # far past any context's prompt; a larger body is refused before it is all read


@dataclass
class ServeSettings:
    burst_tokens: int = 8
    max_sessions: int = 8
    max_queue: int = 64
    request_timeout_s: float = 600.0
    retry_after_s: int = 1


def create_app(engine, settings: ServeSettings | None = None) -> FastAPI:
    settings = settings or ServeSettings()
    metrics = ServeMetrics()
    scheduler = Scheduler(engine, metrics, settings.burst_tokens, settings.max_sessions, settings.max_queue,
                          settings.request_timeout_s)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="memra", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.scheduler, app.state.metrics = engine, scheduler, metrics

    def error(exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(settings.retry_after_s)} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                              type="invalid_request_error", code=str(exc.status_code)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error(ApiError(500, f"internal error ({type(exc).__name__}); see the server log"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.name, **scheduler.counts(), "open_caches": scheduler.open_caches()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": engine.name, "object": "model", "created": 0, "owned_by": "memra",
            "max_model_len": engine.max_ctx, "default_draft": engine.default_draft,
            "draft_sources": sorted(engine.drafters), "unavailable_draft_sources": engine.unavailable}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    async def serve(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            # parsed and tokenized off the event loop: a long prompt does not stall other clients' streams
            req = await asyncio.to_thread(_parse, engine, await _body(request), chat)
            ticket = scheduler.submit(req.job, endpoint, asyncio.get_running_loop())
        except (ApiError, MemraError) as exc:
            exc = exc if isinstance(exc, ApiError) else ApiError(400, str(exc))
            metrics.requests.labels(endpoint=endpoint, outcome="rejected" if exc.status == 503 else "invalid").inc()
            return error(exc)
        except Exception as exc:  # a bug: answered here, so it is counted and the connection stays usable
            log.exception("unhandled error parsing a %s request", endpoint)
            metrics.requests.labels(endpoint=endpoint, outcome="error").inc()
            return error(ApiError(500, f"internal error ({type(exc).__name__}); see the server log"))
        try:
            first = await _next(scheduler, ticket, request)
        except asyncio.CancelledError:
            scheduler.cancel(ticket)
            raise
        if first is None:
            return Response(status_code=CLIENT_GONE)
        if first.error is not None:
            return error(first.error)
        shape = Shape(req, engine)
        if req.stream:
            return StreamingResponse(_events(scheduler, ticket, request, first, shape, req.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, tokens, logprobs, update = [], [], [] if req.job.logprobs is not None else None, first
        try:
            while True:
                if update.error is not None:
                    return error(update.error)
                text.append(update.text)
                tokens.extend(update.tokens)
                if logprobs is not None:
                    logprobs.extend(update.logprobs)
                if update.finish_reason is not None:
                    return shape.whole("".join(text), tokens, logprobs, update.finish_reason, update.usage)
                update = await _next(scheduler, ticket, request)
                if update is None:
                    return Response(status_code=CLIENT_GONE)
        except asyncio.CancelledError:
            scheduler.cancel(ticket)
            raise

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


async def _body(request: Request) -> bytes:
    """The request body, refused (413) once it passes MAX_BODY_BYTES, before the rest is read."""
    size = request.headers.get("content-length", "")
    chunks, read = [], int(size) if size.isdigit() else 0
    if read <= MAX_BODY_BYTES:
        read = 0
        async for chunk in request.stream():
            read += len(chunk)
            if read > MAX_BODY_BYTES:
                break
            chunks.append(chunk)
    if read > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB, far past any prompt "
                            "this server's context holds: send a shorter one")
    return b"".join(chunks)


def _parse(engine, raw: bytes, chat: bool):
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    return parse_request(engine, body, chat)


async def _next(scheduler: Scheduler, ticket, request: Request):
    """The ticket's next update, or None (and the ticket cancelled) once the client has gone."""
    getter = asyncio.ensure_future(ticket.updates.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=POLL_S)
            if done:
                return getter.result()
            if await request.is_disconnected():
                scheduler.cancel(ticket)
                return None
    finally:
        if not getter.done():
            getter.cancel()


async def _events(scheduler: Scheduler, ticket, request: Request, update, shape: Shape, include_usage: bool):
    """The SSE stream: a chunk per update, the usage chunk if asked, then [DONE]. Leaving early
    (the client disconnected, the server is stopping) cancels the request."""
    finished, first = False, True
    try:
        while update is not None:
            if update.error is not None:
                yield _sse(update.error.body())
                finished = True
                break
            chunk = shape.chunk(update, first)
            first = False
            if chunk is not None:
                yield _sse(chunk)
            if update.finish_reason is not None:
                if include_usage:
                    yield _sse(shape.usage_chunk(update.usage))
                finished = True
                break
            update = await _next(scheduler, ticket, request)
        if finished:
            yield "data: [DONE]\n\n"
    finally:
        if not finished:
            scheduler.cancel(ticket)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
