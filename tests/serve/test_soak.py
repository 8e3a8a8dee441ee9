"""A bounded soak: a few hundred short requests from four clients at once, valid and invalid bodies
and abandoned streams mixed at random. No 5xx, every error OpenAI-shaped, every stream ends in
[DONE], and afterwards no live session, no open cache and no growth in memory worth the name."""

import gc
import json
import os
import random
import threading
import time

import pytest

from tests.serve.helpers import Server, make_engine

REQUESTS = 200
CLIENTS = 4
RSS_GROWTH_MB = 48
WORDS = ["alpha", "beta", "gamma", "delta", "fox", "dog", "the", "an", "quick", "lazy"]  # >= 2 tokens each
BAD = [  # (field, value) pairs that must be refused with a 4xx
    ("max_tokens", "two"), ("max_tokens", -1), ("temperature", "x"), ("top_p", 0), ("top_k", -5), ("n", 3),
    ("model", "other"), ("stop", 5), ("logprobs", 99), ("draft", 12), ("draft", "nope"), ("min_p", 2),
    ("prompt", ""), ("prompt", {"a": 1}), ("prompt", "z" * 200), ("seed", 1.5), ("stream", 1),
    ("frequency_penalty", 1), ("num_draft_tokens", 0), ("p_min", 3)]


@pytest.fixture(scope="module")
def server(small_dir):
    server = Server(make_engine(small_dir, max_ctx=96, default_max_tokens=2), burst_tokens=2, max_sessions=6,
                    max_queue=64)
    yield server
    server.close()


def rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return None


def make_request(rng: random.Random):
    """(kind, path, body) with kind one of valid / invalid / garbage / abandon."""
    chat = rng.random() < 0.25
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 2)))   # short: the prefill is most of a request
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    body["max_tokens"] = rng.randint(1, 2)
    body["draft"] = rng.choice([None, None, "native-mtp", "ngram"])
    if rng.random() < 0.4:
        body.update(temperature=rng.choice([0.5, 1.0]), top_p=rng.choice([0.8, 1.0]), seed=rng.randint(0, 99))
    if rng.random() < 0.3:
        body["stream"] = True
        body["stream_options"] = {"include_usage": rng.random() < 0.5}
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.2:
        body["logprobs"] = True if chat else 2
    if rng.random() < 0.1:
        body["user"] = "someone"            # an OpenAI field memra ignores
    path = "/v1/chat/completions" if chat else "/v1/completions"
    roll = rng.random()
    if roll < 0.3:
        field, value = rng.choice(BAD)
        if field == "prompt" and chat:  # the chat twins: no messages, an over-long one, not an array
            body["messages"] = [] if value == "" else [{"role": "user", "content": value}] if value else value
        else:
            body[field] = value
        return "invalid", path, body
    if roll < 0.38:
        return "garbage", path, rng.choice([b"{", b"[]", b"null", b'"text"', b"\xff\xfe", b'{"prompt": [1, 2,]}'])
    if roll < 0.45:
        return "abandon", path, {**body, "stream": True, "max_tokens": 40, "draft": "native-mtp"}
    return "valid", path, body


def client_loop(server, seed: int, count: int, results: list) -> None:
    rng = random.Random(seed)
    with server.client(timeout=60) as client:
        for _ in range(count):
            kind, path, body = make_request(rng)
            if kind == "abandon":
                with client.stream("POST", path, json=body) as r:
                    lines = r.iter_lines()
                    first = next((line for line in lines if line.startswith("data: ")), None)
                results.append((kind, r.status_code, first))
                continue
            if isinstance(body, bytes):
                r = client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = client.post(path, json=body)
            results.append((kind, r.status_code, f"{r.text} <- {body!r}"))


def check(kind: str, status: int, text: str) -> None:
    assert status < 500, (kind, status, text)
    if kind == "abandon":
        assert status == 200 and text.startswith("data: {")
    elif kind == "valid":
        assert status == 200, text
        text = text.rsplit(" <- ", 1)[0]
        if text.startswith("data: "):
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        else:
            assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        assert status in (400, 404), (kind, status, text)
        error = json.loads(text.rsplit(" <- ", 1)[0])["error"]
        assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]


def run_batch(server, seed: int, count: int) -> list:
    results: list = []
    threads = [threading.Thread(target=client_loop, args=(server, seed * 100 + i, count // CLIENTS, results))
               for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a soak client hung"
    return results


def test_a_bounded_soak_of_random_requests_leaves_no_5xx_and_nothing_behind(server):
    t0 = time.monotonic()
    warm = run_batch(server, 1, 40)
    server.wait_idle()
    gc.collect()
    rss_before = rss_mb()
    results = run_batch(server, 2, REQUESTS - 40)
    for kind, status, text in warm + results:
        check(kind, status, text)
    kinds = {kind for kind, _, _ in results}
    assert kinds == {"valid", "invalid", "garbage", "abandon"} and len(warm) + len(results) == REQUESTS
    assert server.wait_idle() == {"running": 0, "waiting": 0}
    gc.collect()
    assert server.scheduler.open_caches() == 0
    rss_after = rss_mb()
    if rss_before is not None:
        assert rss_after - rss_before < RSS_GROWTH_MB, (rss_before, rss_after)
    assert time.monotonic() - t0 < 120
