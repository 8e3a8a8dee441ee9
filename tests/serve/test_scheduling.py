"""The worker under load: concurrent streamed requests each equal their solo run however they are
interleaved, a short request overtakes a long one, a client that leaves frees its session and
cache, a full queue answers 503, and a request past its timeout answers 408."""

import gc
import json
import threading
import time

import pytest

from memra import SamplingParams
from memra.tokenizer import ByteTokenizer
from tests.serve.helpers import Server, Solo, make_engine, sse_events

TOK = ByteTokenizer()
# (max_tokens, draft, sampling): the first is the long one, started before the others; the second is short
REQUESTS = [
    (24, "native-mtp", None),
    (2, None, None),
    (6, "dflash2", None),
    (8, "native-mtp", {"temperature": 0.7, "seed": 3}),
    (5, None, {"temperature": 1.0, "top_k": 20, "seed": 5}),
    (9, "dflash2", {"temperature": 0.9, "top_p": 0.9, "seed": 9}),
    (4, "native-mtp", None),
    (7, None, None),
]
LONG = {"prompt": "Tell me everything.", "max_tokens": 400, "stream": True, "draft": "native-mtp"}


@pytest.fixture(scope="module")
def engine(small_dir, drafter_dir):
    return make_engine(small_dir, drafter_dir)


@pytest.fixture(scope="module")
def solo(small_dir, drafter_dir, engine):
    return Solo(small_dir, drafter_dir, engine.eos)


@pytest.fixture
def serve(engine):
    servers = []

    def start(**settings):
        servers.append(Server(engine, **settings))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def body(i: int) -> dict:
    max_tokens, draft, sampling = REQUESTS[i]
    return {"prompt": f"Request {i}: " + "abc" * i, "max_tokens": max_tokens, "stream": True, "draft": draft,
            "return_token_ids": True, **(sampling or {"temperature": 0})}


def streamed(server, payload: dict, out: dict, first: threading.Event | None = None) -> None:
    """One streamed request in this thread: its status, events, end time and whether [DONE] came."""
    with server.client() as client, client.stream("POST", "/v1/completions", json=payload) as r:
        out.update(status=r.status_code, events=[], done=False)
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
                break
            if line.startswith("data: "):
                out["events"].append(json.loads(line[len("data: "):]))
                if first is not None:
                    first.set()
        out["end"] = time.monotonic()


def test_eight_concurrent_streams_each_equal_their_solo_run_and_short_overtakes_long(serve, solo):
    server = serve(burst_tokens=4, max_sessions=8)
    results = [{} for _ in REQUESTS]
    first = threading.Event()
    threads = [threading.Thread(target=streamed, args=(server, body(0), results[0], first))]
    threads[0].start()
    assert first.wait(30), "the long request never produced a token"
    threads += [threading.Thread(target=streamed, args=(server, body(i), results[i])) for i in range(1, 8)]
    peak = []
    for t in threads[1:]:
        t.start()
    while any(t.is_alive() for t in threads):
        peak.append(server.scheduler.counts()["running"])
        time.sleep(0.01)
        assert len(peak) < 6000, "the requests did not finish in a minute"
    for i, result in enumerate(results):
        max_tokens, draft, sampling = REQUESTS[i]
        want = solo.tokens(TOK.encode(body(i)["prompt"]), max_tokens, draft=draft,
                           sampling=SamplingParams(**sampling) if sampling else None)
        assert result["status"] == 200 and result["done"]
        got = [t for e in result["events"] for t in e["choices"][0]["token_ids"]]
        assert got == want.tokens, f"request {i} ({draft}, {sampling}) differs from its solo run"
        assert "".join(e["choices"][0]["text"] for e in result["events"]) == \
            TOK.decode([t for t in want.tokens if t not in solo.eos])
    assert results[1]["end"] < results[0]["end"], "the short request waited for the long one"
    assert max(peak) >= 4                           # they really were live together
    assert server.wait_idle() == {"running": 0, "waiting": 0}


def test_a_client_that_disconnects_frees_its_session_and_cache(serve):
    server = serve(burst_tokens=2)
    with server.client() as client:
        with client.stream("POST", "/v1/completions", json=LONG) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert server.scheduler.counts()["running"] == 1 and server.scheduler.open_caches() == 1
        # leaving the block closes the connection mid-stream
        assert server.wait_idle() == {"running": 0, "waiting": 0}
        gc.collect()
        assert server.scheduler.open_caches() == 0
        metrics = client.get("/metrics").text
        assert 'memra:requests_total{endpoint="completions",outcome="cancelled"} 1.0' in metrics
        generated = float(next(line.split()[1] for line in metrics.splitlines()
                               if line.startswith("memra:generation_tokens_total")))
        assert generated < LONG["max_tokens"]
        assert client.get("/health").json()["open_caches"] == 0


def test_a_full_queue_answers_503_with_retry_after(serve):
    server = serve(burst_tokens=2, max_sessions=1, max_queue=1)
    queued = {}
    with server.client() as client, client.stream("POST", "/v1/completions", json=LONG) as r:
        lines = r.iter_lines()   # held: a dropped line iterator would close the connection
        next(line for line in lines if line.startswith("data: "))
        waiter = threading.Thread(target=lambda: queued.update(
            r=server.client().post("/v1/completions", json={"prompt": "hi there", "max_tokens": 2})))
        waiter.start()
        deadline = time.monotonic() + 10
        while server.scheduler.counts()["waiting"] < 1:
            assert time.monotonic() < deadline, "the second request was never queued"
            time.sleep(0.01)
        for path, payload in (("/v1/completions", {"prompt": "x y", "max_tokens": 1}),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            busy = client.post(path, json=payload)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "queue_full" and busy.json()["error"]["type"] == "server_error"
    waiter.join(30)   # the long stream closed: the queued request gets the session
    assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] == 2
    assert server.wait_idle() == {"running": 0, "waiting": 0}


def test_a_request_past_its_timeout_gets_408_live_or_queued(serve):
    # A deadline is checked between bursts, so the queued request expires behind the live one
    # only if the live one is still unfinished at a boundary past both deadlines. One burst of
    # 100 tokens (LONG stops at 121 on this model: about 1.7 s on a 2-core CPU) spans both; with
    # bursts of 2 the queued request expired only when it reached the server within one burst
    # (about 30 ms) of the live one, and CI's loaded runs sometimes missed that.
    server = serve(burst_tokens=100, max_sessions=1, request_timeout_s=0.3)
    with server.client() as client:
        live = {}
        thread = threading.Thread(target=lambda: live.update(r=server.client().post("/v1/completions", json={
            **LONG, "stream": False})))
        thread.start()
        deadline = time.monotonic() + 10
        while server.scheduler.counts()["running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        queued = client.post("/v1/completions", json={"prompt": "queued", "max_tokens": 2})
        thread.join(30)
        for r in (live["r"], queued):
            assert r.status_code == 408
            assert r.json()["error"]["code"] == "request_timeout"
        with client.stream("POST", "/v1/completions", json=LONG) as r:   # streamed: an error event, then [DONE]
            events = sse_events(r)
        assert r.status_code == 200 and events[-1]["error"]["code"] == "request_timeout"
    assert server.wait_idle() == {"running": 0, "waiting": 0}
