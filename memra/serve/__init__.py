"""`memra serve`: an OpenAI-compatible HTTP server with speculative decoding (extra `[serve]`).

    pip install -e ".[serve]"
    memra serve --checkpoint DIR            # or: python -m memra.serve; no --checkpoint: the demo model

Modules, in the order a request meets them: cli (flags, socket, uvicorn), app (routes, SSE),
protocol (request bodies -> Job), engine (the model, tokenizer, drafters), scheduler (the worker
thread, the queue, cancellation), runs (plain and speculative sessions in bursts), text
(detokenization and stop strings), chat (chat templates), shapes (response bodies), metrics
(Prometheus), inprocess (the server in a thread, for benchmarks and tests; an `Engine` may
wrap a model already in memory). Only this package imports fastapi, uvicorn or prometheus_client; `import memra`
does not import it. docs/serve.md shows it from the outside.
"""
