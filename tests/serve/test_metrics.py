"""/metrics: Prometheus text whose speculative counters (vLLM's names, memra's prefix) move by
exactly the drafts and acceptances the request reports in its usage, which are `generate`'s;
request counts, tokens and latencies move with each request."""

import threading

import pytest

from memra.tokenizer import ByteTokenizer
from tests.serve.helpers import Server, Solo, make_engine, sse_events

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

TOK = ByteTokenizer()
SPEC = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@pytest.fixture(scope="module")
def served(small_dir, oracle_tapes):
    server = Server(make_engine(small_dir), burst_tokens=3)
    with server.client() as client:
        yield server, client
    server.close()


@pytest.fixture(scope="module")
def solo(small_dir, served):
    return Solo(small_dir, eos=served[0].app.state.engine.eos)


def scrape(client) -> dict:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def delta(after, before, name, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def oracle_request(solo, oracle_tapes, prompt: str, n: int):
    """A prompt the oracle drafts for, with the solo speculative run the server must equal."""
    ids = TOK.encode(prompt)
    oracle_tapes[tuple(ids)] = solo.tokens(ids, n).tokens
    want = solo.tokens(ids, n, draft="oracle")
    assert want.tokens == oracle_tapes[tuple(ids)]
    assert 0 < want.stats["num_accepted_tokens"] < want.stats["num_draft_tokens"]   # some, not all
    body = {"prompt": prompt, "max_tokens": n, "draft": "oracle", "num_draft_tokens": 4, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    return body, want


def usage_of(client, body) -> dict:
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        *_, last = sse_events(r)
    assert last["choices"] == []
    return last["usage"]


def test_spec_counters_move_by_exactly_the_requests_drafts_and_acceptances(served, solo, oracle_tapes):
    server, client = served
    body, want = oracle_request(solo, oracle_tapes, "Count with me: one two", 18)
    before = scrape(client)
    usage = usage_of(client, body)
    after = scrape(client)
    spec = usage["speculative"]
    for key in (*SPEC, "accepted_per_pos"):
        assert spec[key] == want.stats[key]
    for key in SPEC:
        assert delta(after, before, f"memra:spec_decode_{key}_total") == spec[key]
    assert any(spec["accepted_per_pos"]) and len(spec["accepted_per_pos"]) == 4
    for pos, n in enumerate(spec["accepted_per_pos"]):
        assert delta(after, before, "memra:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == n
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    # and the request itself
    assert delta(after, before, "memra:requests_total", endpoint="completions", outcome="length") == 1
    assert delta(after, before, "memra:generation_tokens_total") == usage["completion_tokens"] == 18
    assert delta(after, before, "memra:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta(after, before, "memra:time_to_first_token_seconds_count") == 1
    assert delta(after, before, "memra:inter_token_latency_seconds_count") == 17
    assert delta(after, before, "memra:e2e_request_latency_seconds_count") == 1


def test_concurrent_requests_add_up_and_plain_ones_add_no_drafts(served, solo, oracle_tapes):
    server, client = served
    first, want_a = oracle_request(solo, oracle_tapes, "Alpha beta gamma", 10)
    second, want_b = oracle_request(solo, oracle_tapes, "Delta epsilon", 7)
    plain = {**first, "draft": None, "num_draft_tokens": None}
    before = scrape(client)
    usages = {}
    threads = [threading.Thread(target=lambda k=k, b=b: usages.update({k: usage_of(server.client(), b)}))
               for k, b in (("a", first), ("b", second), ("plain", plain))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = scrape(client)
    assert usages["plain"]["speculative"] is None
    for key in SPEC:
        assert delta(after, before, f"memra:spec_decode_{key}_total") == want_a.stats[key] + want_b.stats[key]
    assert delta(after, before, "memra:requests_total", endpoint="completions", outcome="length") == 3


def test_the_exposition_names_memras_metrics_and_the_live_gauges(served):
    server, client = served
    assert server.wait_idle() == {"running": 0, "waiting": 0}
    names = {name for name, _ in scrape(client)}
    for name in ("memra:num_requests_running", "memra:num_requests_waiting", "memra:spec_decode_num_drafts_total",
                 "memra:spec_decode_num_draft_tokens_total", "memra:spec_decode_num_accepted_tokens_total",
                 "memra:time_to_first_token_seconds_bucket", "memra:inter_token_latency_seconds_bucket",
                 "memra:e2e_request_latency_seconds_sum"):
        assert name in names
    metrics = scrape(client)
    assert metrics[("memra:num_requests_running", ())] == metrics[("memra:num_requests_waiting", ())] == 0
    assert client.get("/health").json() == {"status": "ok", "model": "small", "running": 0, "waiting": 0,
                                            "open_caches": 0}
