"""The server's Prometheus metrics, under vLLM's names with the `memra:` prefix.

prometheus_client accepts colons in metric names (Prometheus reserves them for recording
rules, and vLLM uses them the same way), so the speculative counters read exactly like vLLM's
with `memra:` for `vllm:`:

    memra:spec_decode_num_drafts_total                    rounds that verified at least one draft
    memra:spec_decode_num_draft_tokens_total              drafted tokens verified
    memra:spec_decode_num_accepted_tokens_total           drafted tokens accepted
    memra:spec_decode_num_accepted_tokens_per_pos_total{position="0"}   accepted at slot 0, 1, ...

plus memra:requests_total{endpoint, outcome}, memra:num_requests_running / _waiting,
memra:time_to_first_token_seconds, memra:inter_token_latency_seconds,
memra:e2e_request_latency_seconds, memra:prompt_tokens_total and memra:generation_tokens_total.
Each server owns its registry, so several servers in one process (tests) never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "memra:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = PREFIX
        self.requests = Counter(p + "requests", "Requests by endpoint and outcome (stop, length, cancelled, "
                                "timeout, error, rejected, invalid)", ["endpoint", "outcome"], registry=r)
        self.running = Gauge(p + "num_requests_running", "Live sessions (each with its cache)", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for a session slot", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between tokens of a request (a burst's "
                             "gap split evenly over its tokens)", registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token", registry=r,
                             buckets=E2E_BUCKETS)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of started requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Speculative rounds that verified a draft",
                                  registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Drafted tokens verified", registry=r)
        self.num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Drafted tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Drafted tokens accepted, by draft slot", ["position"], registry=r)

    def track(self, counts) -> None:
        """Read the gauges from `counts()` -> {"running": n, "waiting": m} at scrape time."""
        self.running.set_function(lambda: counts()["running"])
        self.waiting.set_function(lambda: counts()["waiting"])

    def spec(self, before: dict, after) -> dict:
        """Add what a session's SpecMetrics gained since `before` (a snapshot); returns the new snapshot."""
        now = snapshot(after)
        self.num_drafts.inc(now["num_drafts"] - before["num_drafts"])
        self.num_draft_tokens.inc(now["num_draft_tokens"] - before["num_draft_tokens"])
        self.num_accepted_tokens.inc(now["num_accepted_tokens"] - before["num_accepted_tokens"])
        old = before["accepted_per_pos"]
        for pos, n in enumerate(now["accepted_per_pos"]):  # every drafted slot shows, even at 0
            self.accepted_per_pos.labels(position=str(pos)).inc(n - (old[pos] if pos < len(old) else 0))
        return now

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def snapshot(spec_metrics) -> dict:
    return {"num_drafts": spec_metrics.num_drafts, "num_draft_tokens": spec_metrics.num_draft_tokens,
            "num_accepted_tokens": spec_metrics.num_accepted_tokens,
            "accepted_per_pos": list(spec_metrics.accepted_per_pos)}


EMPTY = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
