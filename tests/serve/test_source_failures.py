"""A draft source that raises what is not an Exception (SystemExit from a plugin calling sys.exit,
a KeyboardInterrupt it raises itself) fails its own request and nothing else: the worker thread
lives on, and the next request, plain or speculative, is answered with plain decoding's tokens."""

import pytest

from memra import generate, hookimpl, load_model
from memra.drafters import registry
from tests.serve.helpers import Server, make_engine


class Raising:
    tap_layers, max_k = (), 14

    def __init__(self, exc):
        self.exc = exc

    def load(self, model, options):
        return self

    def begin(self, start):
        return self

    def propose(self, k, sampling):
        raise self.exc

    def commit(self, outcome):
        pass


class Plugin:
    @hookimpl
    def memra_register_draft_sources(self, register):
        register("exits", Raising(SystemExit(3)))
        register("interrupts", Raising(KeyboardInterrupt()))


@pytest.fixture(scope="module")
def client(small_dir):
    registry.reset_registry()
    registry.plugin_manager().register(Plugin(), name="memra-test-raising")
    server = Server(make_engine(small_dir, max_ctx=128), request_timeout_s=30)
    with server.client(timeout=30) as c:
        yield c
    server.close()
    registry.reset_registry()


@pytest.mark.parametrize("source, status", [("exits", 400), ("interrupts", 500)])
def test_a_source_raising_past_exception_fails_its_request_only(client, small_dir, source, status):
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 6, "return_token_ids": True}
    r = client.post("/v1/completions", json={**body, "draft": source})
    assert r.status_code == status, r.text
    assert ("SystemExit" if source == "exits" else "KeyboardInterrupt") in r.json()["error"]["message"]
    want = generate(load_model(small_dir, backend="numpy"), [1, 2, 3, 4], 6).tokens
    for draft in (None, "native-mtp"):
        again = client.post("/v1/completions", json={**body, "draft": draft})
        assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == want
