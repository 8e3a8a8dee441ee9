"""bench_serve: `memra serve` end to end over HTTP, against memra.generate on the same model.

    python benchmarks/bench_serve.py --preset bench --backend cuda [--draft none,native-mtp] \
        [--num-draft-tokens 4] [--prompt-len 128] [--max-tokens 64] [--requests 6] [--concurrency 4] \
        [--burst-tokens 8] [--seed 0] [--git-sha SHA] [--out F]

The model is built in memory (benchmarks.common.build_model: the `bench` preset's ~46 GB of bf16
weights are never written to disk) and served through Engine(..., model=model) by uvicorn in a
thread of this process (memra.serve.inprocess), after Engine.warm_up. For each draft setting:

  direct      memra.generate on each prompt, no HTTP: time to first token (prefill_s) and decode
              tokens/s (tokens after the first / decode_s): the reference the server is held to;
  sequential  --requests streamed /v1/completions requests, one after another: client-side time to
              first token (request sent -> first SSE chunk with a token) and decode tokens/s
              (tokens after the first chunk's / time from the first chunk to the last); medians;
  concurrent  --concurrency streamed requests at once (one session each, interleaved by the
              scheduler every --burst-tokens tokens): generated tokens / wall time, median TTFT;
  acceptance  the mean acceptance length summed over the served requests' usage.speculative (and
              the direct runs'); null for plain decoding.

server_over_direct = sequential decode tokens/s / direct decode tokens/s: what HTTP, SSE and the
scheduler cost. Requests are greedy, send token-id prompts (random, one per request) with
ignore_eos, so each makes exactly --max-tokens tokens (checked), and the tokens must equal the
direct run's for the same prompt (recorded as tokens_match_direct). The client runs in this
process too (one thread per concurrent request), so it shares the interpreter with the server.
Prints a card on stderr and ONE JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/bench_serve.py`: `benchmarks` is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import build_model, emit, random_tokens, record_header  # noqa: E402
from memra import generate  # noqa: E402
from memra.errors import InputError, MemraError  # noqa: E402

CLIENT_TIMEOUT_S = 600.0
ACCEPT_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="config preset (small: the demo's size; bench: the GPU's)")
    ap.add_argument("--backend", default="auto", choices=("numpy", "cuda", "auto"))
    ap.add_argument("--draft", default="none,native-mtp",
                    help="draft settings to measure, comma-separated ('none': plain decoding)")
    ap.add_argument("--num-draft-tokens", "-k", type=int, default=4, help="K of every speculative setting")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (random ids)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each request makes (at least 2)")
    ap.add_argument("--requests", type=int, default=6, help="sequential requests (and direct runs) per setting")
    ap.add_argument("--concurrency", type=int, default=4, help="streamed requests sent at once per setting")
    ap.add_argument("--burst-tokens", type=int, default=8, help="the server's --burst-tokens")
    ap.add_argument("--seed", type=int, default=0, help="weights and prompt tokens")
    ap.add_argument("--git-sha", help="the commit measured (default: git rev-parse --short HEAD)")
    ap.add_argument("--out", help="also write the JSON record here")
    args = ap.parse_args(argv)
    args.drafts = [d.strip() for d in args.draft.split(",") if d.strip()]
    if not args.drafts:
        ap.error("--draft needs at least one setting, e.g. none,native-mtp")
    for name in ("max_tokens", "requests", "concurrency", "prompt_len", "burst_tokens", "num_draft_tokens"):
        floor = 2 if name in ("max_tokens", "prompt_len") else 1  # decode needs 2 tokens; a draft, 2 prompt ids
        if getattr(args, name) < floor:
            ap.error(f"--{name.replace('_', '-')} must be at least {floor}")
    return args


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def start_engine(model, args):
    from memra.serve.engine import Engine, EngineOptions

    spec = [d for d in args.drafts if d.lower() != "none"]
    engine = Engine(EngineOptions(draft=spec[0] if spec else "none", num_draft_tokens=args.num_draft_tokens,
                                  drafts=tuple(spec), served_model_name=f"bench-{args.preset}",
                                  default_max_tokens=args.max_tokens), model=model)
    if engine.unavailable:
        name, why = next(iter(engine.unavailable.items()))
        raise InputError(f"--draft {name} cannot be measured: {why}")
    engine.warm_up()
    return engine


# ---- the two sides: memra.generate, and the server over HTTP ---------------------------------

def direct_run(model, prompt: list[int], args, draft) -> dict:
    result = generate(model, prompt, args.max_tokens, draft=draft, num_draft_tokens=args.num_draft_tokens)
    s = result.stats
    return {"tokens": result.tokens, "ttft_s": s["prefill_s"],
            "decode_tokens_per_s": (len(result.tokens) - 1) / s["decode_s"],
            "speculative": {k: s[k] for k in ACCEPT_KEYS} if draft is not None else None}


def request_body(prompt: list[int], args, draft) -> dict:
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": True,
            "draft": draft}
    if draft is not None:
        body["num_draft_tokens"] = args.num_draft_tokens
    return body


def streamed(client, body: dict) -> dict:
    """One streamed completion, timed on the client: (tokens, TTFT, decode tokens/s, usage)."""
    first = last = None
    tokens, first_chunk, usage = [], 0, None
    sent = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise MemraError(f"the server answered {response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise MemraError(f"the stream ended in an error: {event['error']}")
            ids = [t for choice in event["choices"] for t in choice.get("token_ids") or []]
            if ids:
                last = time.perf_counter()
                if first is None:
                    first, first_chunk = last, len(ids)
                tokens += ids
            usage = event.get("usage") or usage
    if len(tokens) != body["max_tokens"] or usage is None:
        raise MemraError(f"a request for {body['max_tokens']} tokens (ignore_eos) got {len(tokens)}"
                         f"{'' if usage else ' and no usage chunk'}: the server broke its contract")
    decode = len(tokens) - first_chunk
    return {"tokens": tokens, "ttft_s": first - sent, "usage": usage,
            "decode_tokens_per_s": decode / (last - first) if decode and last > first else None}


def concurrent(client, bodies: list[dict]) -> tuple[list[dict], float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        runs = list(pool.map(lambda b: streamed(client, b), bodies))
    return runs, time.perf_counter() - start


# ---- one draft setting ------------------------------------------------------------------------

def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def acceptance(counts: list[dict]) -> dict:
    total = {k: sum(c[k] for c in counts) for k in ACCEPT_KEYS}
    drafts = total["num_drafts"]
    return total | {"mean_acceptance_length": 1.0 + total["num_accepted_tokens"] / drafts if drafts else 1.0}


def measure(model, client, prompts: list[list[int]], args, draft) -> dict:
    # one untimed run each side first: shapes the warm-up did not meet (this prompt length) compile
    # on CUDA, and the client opens its connection
    direct_run(model, prompts[0], args, draft)
    direct = [direct_run(model, p, args, draft) for p in prompts]
    streamed(client, request_body(prompts[0], args, draft))
    seq = [streamed(client, request_body(p, args, draft)) for p in prompts]
    conc, wall = concurrent(client, [request_body(prompts[i % len(prompts)], args, draft)
                                     for i in range(args.concurrency)])
    served = seq + conc
    match = all(r["tokens"] == direct[i % len(prompts)]["tokens"] for runs in (seq, conc) for i, r in enumerate(runs))
    direct_tps = median(r["decode_tokens_per_s"] for r in direct)
    server_tps = median(r["decode_tokens_per_s"] for r in seq)
    out = {
        "draft": draft, "k": args.num_draft_tokens if draft is not None else None,
        "direct": {"runs": len(direct), "ttft_ms_median": 1e3 * median(r["ttft_s"] for r in direct),
                   "decode_tokens_per_s_median": direct_tps,
                   "tokens_per_request": [len(r["tokens"]) for r in direct]},
        "sequential": {"requests": len(seq), "ttft_ms_median": 1e3 * median(r["ttft_s"] for r in seq),
                       "decode_tokens_per_s_median": server_tps,
                       "ttft_ms": [1e3 * r["ttft_s"] for r in seq],
                       "decode_tokens_per_s": [r["decode_tokens_per_s"] for r in seq],
                       "tokens_per_request": [r["usage"]["completion_tokens"] for r in seq]},
        "concurrent": {"requests": len(conc), "wall_s": wall, "tokens": sum(len(r["tokens"]) for r in conc),
                       "tokens_per_s": sum(len(r["tokens"]) for r in conc) / wall,
                       "ttft_ms_median": 1e3 * median(r["ttft_s"] for r in conc),
                       "tokens_per_request": [r["usage"]["completion_tokens"] for r in conc]},
        "server_over_direct": server_tps / direct_tps if server_tps and direct_tps else None,
        "tokens_match_direct": match,
        "acceptance": None,
    }
    if draft is not None:
        out["acceptance"] = acceptance([r["usage"]["speculative"] for r in served]) | {
            "direct_mean_acceptance_length": acceptance([r["speculative"] for r in direct])["mean_acceptance_length"]}
    return out


# ---- the run and the record -------------------------------------------------------------------

def card(record: dict) -> list[str]:
    c = record["config"]
    lines = [f"bench_serve {c['preset']} on {record['device']}  prompt {c['prompt_len']}  max_tokens "
             f"{c['max_tokens']}  burst {c['burst_tokens']}  requests {c['requests']}  concurrency {c['concurrency']}"]
    row = "    {:<11} TTFT {:9.1f} ms  {:9.1f} tok/s {}".format
    for name, r in record["runs"].items():
        d, s, k, a = r["direct"], r["sequential"], r["concurrent"], r["acceptance"]
        ratio = r["server_over_direct"]
        lines.append(f"  {name}" + (f" (K={r['k']})" if r["k"] else "")
                     + (f"  mean acceptance length {a['mean_acceptance_length']:.2f} (direct "
                        f"{a['direct_mean_acceptance_length']:.2f})" if a else "")
                     + ("" if r["tokens_match_direct"] else "  TOKENS DIFFER FROM THE DIRECT RUN"))
        lines.append(row("direct", d["ttft_ms_median"], d["decode_tokens_per_s_median"], "decode"))
        lines.append(row("sequential", s["ttft_ms_median"], s["decode_tokens_per_s_median"] or 0.0,
                         "decode" + (f" ({100 * ratio:.0f}% of direct)" if ratio else "")))
        lines.append(row("concurrent", k["ttft_ms_median"], k["tokens_per_s"],
                         f"aggregate ({k['tokens']} tokens in {k['wall_s']:.2f} s)"))
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import httpx

        from memra.serve.app import ServeSettings, create_app
        from memra.serve.inprocess import InProcessServer
    except ImportError as exc:
        raise SystemExit(f"bench_serve needs the serve extra and httpx ({exc.name} is missing): "
                         "pip install 'memra[serve]' httpx")
    model = build_model(args.preset, args.backend, args.seed)
    engine = start_engine(model, args)
    prompts = [[int(t) for t in random_tokens(model.cfg, args.prompt_len, args.seed + i)] for i in range(args.requests)]
    settings = ServeSettings(burst_tokens=args.burst_tokens,
                             max_sessions=max(ServeSettings.max_sessions, args.concurrency))
    runs = {}
    with InProcessServer(create_app(engine, settings)) as server, \
            httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S,
                         limits=httpx.Limits(max_connections=args.concurrency + 1)) as client:
        for name in args.drafts:
            draft = None if name.lower() == "none" else name
            runs["none" if draft is None else draft] = measure(model, client, prompts, args, draft)
    config = {"preset": args.preset, "backend": model.be.name, "drafts": args.drafts,  # auto: the one it chose
              "num_draft_tokens": args.num_draft_tokens, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "requests": args.requests, "concurrency": args.concurrency,
              "burst_tokens": args.burst_tokens, "max_sessions": settings.max_sessions, "seed": args.seed,
              "sampling": "greedy, ignore_eos", "weights": "bf16, built in memory (benchmarks/common.py)",
              "model": model.cfg.to_dict()}
    record = record_header("bench_serve", args.git_sha or git_sha(), config, model.be) | {"runs": runs}
    emit(record, card(record), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
