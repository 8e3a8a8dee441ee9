"""Every refusal leaves in OpenAI's error shape with the right status and the field it is about:
400 for malformed or out-of-range bodies (and memra's own refusals), 404 for an unknown model or
route, 400 context_length_exceeded for a prompt the context cannot hold; never a traceback."""

import pytest

from tests.serve.helpers import Server, make_engine

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
# (path, body, status, param, code): a bytes body is sent as it is
CASES = {
    "malformed-json": ("/v1/completions", b'{"prompt": "xy",', 400, None, None),
    "not-an-object": ("/v1/completions", [1, 2], 400, None, None),
    "no-prompt": ("/v1/completions", {"max_tokens": 3}, 400, "prompt", None),
    "prompt-number": ("/v1/completions", {"prompt": 7}, 400, "prompt", None),
    "prompt-batch": ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None),
    "token-outside-vocab": ("/v1/completions", {"prompt": [1, 2, 999]}, 400, "prompt", None),
    "max-tokens-string": ("/v1/completions", {"prompt": "xy", "max_tokens": "ten"}, 400, "max_tokens", None),
    "max-tokens-zero": ("/v1/completions", {"prompt": "xy", "max_tokens": 0}, 400, "max_tokens", None),
    "temperature-string": ("/v1/completions", {"prompt": "xy", "temperature": "hot"}, 400, "temperature", None),
    "temperature-negative": ("/v1/completions", {"prompt": "xy", "temperature": -1}, 400, "temperature", None),
    "top-p-too-big": ("/v1/completions", {"prompt": "xy", "temperature": 1, "top_p": 1.5}, 400, "top_p", None),
    "min-p-one": ("/v1/completions", {"prompt": "xy", "temperature": 1, "min_p": 1.0}, 400, "min_p", None),
    "seed-negative": ("/v1/completions", {"prompt": "xy", "temperature": 1, "seed": -3}, 400, "seed", None),
    "stream-string": ("/v1/completions", {"prompt": "xy", "stream": "yes"}, 400, "stream", None),
    "stream-options-alone": ("/v1/completions", {"prompt": "xy", "stream_options": {}}, 400, "stream_options", None),
    "stop-empty": ("/v1/completions", {"prompt": "xy", "stop": [""]}, 400, "stop", None),
    "n-two": ("/v1/completions", {"prompt": "xy", "n": 2}, 400, "n", None),
    "penalty": ("/v1/completions", {"prompt": "xy", "presence_penalty": 0.5}, 400, "presence_penalty", None),
    "logit-bias": ("/v1/completions", {"prompt": "xy", "logit_bias": {"1": 5}}, 400, "logit_bias", None),
    "echo": ("/v1/completions", {"prompt": "xy", "echo": True}, 400, "echo", None),
    "logprobs-too-many": ("/v1/completions", {"prompt": "xy", "logprobs": 50}, 400, "logprobs", None),
    "unknown-draft": ("/v1/completions", {"prompt": "xy", "draft": "eagle9"}, 400, "draft", None),
    "unavailable-draft": ("/v1/completions", {"prompt": "xy", "draft": "dflash2"}, 400, "draft", None),
    "k-too-big": ("/v1/completions", {"prompt": "xy", "num_draft_tokens": 15}, 400, "num_draft_tokens", None),
    "k-with-plain": ("/v1/completions", {"prompt": "xy", "draft": None, "num_draft_tokens": 3}, 400,
                     "num_draft_tokens", None),
    "one-token-prompt-spec": ("/v1/completions", {"prompt": "x", "draft": "native-mtp"}, 400, "prompt", None),
    "unknown-model": ("/v1/completions", {"prompt": "xy", "model": "gpt-9"}, 404, "model", "model_not_found"),
    "prompt-too-long": ("/v1/completions", {"prompt": "x" * 300}, 400, "prompt", "context_length_exceeded"),
    "max-tokens-past-context": ("/v1/completions", {"prompt": "xy", "max_tokens": 250}, 400, "max_tokens",
                                "context_length_exceeded"),
    "chat-no-messages": ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    "chat-bad-role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
                      "messages[0]", None),
    "chat-image-part": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content", None),
    "chat-top-logprobs-alone": ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    "chat-tools": ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", None),
    "chat-unknown-model": ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model", "model_not_found"),
    # JSON's \ud800 escape: a lone surrogate, which no UTF-8 text holds
    "prompt-lone-surrogate": ("/v1/completions", b'{"prompt": "a\\ud800"}', 400, "prompt", None),
    "chat-lone-surrogate": ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
                            400, "messages", None),
    "n-zero": ("/v1/completions", {"prompt": "xy", "n": 0}, 400, "n", None),
    "stop-token-ids": ("/v1/completions", {"prompt": "xy", "stop_token_ids": [16]}, 400, "stop_token_ids", None),
    "min-tokens": ("/v1/completions", {"prompt": "xy", "min_tokens": 4}, 400, "min_tokens", None),
    "bad-words": ("/v1/completions", {"prompt": "xy", "bad_words": ["no"]}, 400, "bad_words", None),
    "guided-json": ("/v1/completions", {"prompt": "xy", "guided_json": {"type": "object"}}, 400, "guided_json", None),
    "guided-choice": ("/v1/completions", {"prompt": "xy", "guided_choice": ["a", "b"]}, 400, "guided_choice", None),
    "structured-outputs": ("/v1/completions", {"prompt": "xy", "structured_outputs": {"regex": "a+"}}, 400,
                           "structured_outputs", None),
    "chat-audio": ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, 400, "modalities", None),
    "chat-prediction": ("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": "x"}}, 400,
                        "prediction", None),
    "chat-too-long": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 300}]}, 400,
                      "prompt", "context_length_exceeded"),
}


@pytest.fixture(scope="module")
def client(small_dir):
    server = Server(make_engine(small_dir, max_ctx=128))
    with server.client() as c:
        yield c
    server.close()


def assert_openai_error(r, status):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    message = body["error"]["message"]
    assert message and "\n" not in message and "Traceback" not in message
    return body["error"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_request_gets_its_openai_shaped_error(client, case):
    path, body, status, param, code = CASES[case]
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    error = assert_openai_error(r, status)
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error"


def test_a_streamed_request_is_refused_before_the_stream_starts(client):
    r = client.post("/v1/completions", json={"prompt": "x" * 300, "stream": True})
    assert r.headers["content-type"].startswith("application/json")
    assert assert_openai_error(r, 400)["code"] == "context_length_exceeded"


def test_the_context_error_names_the_numbers_and_the_fix(client):
    message = client.post("/v1/completions", json={"prompt": "x" * 300}).json()["error"]["message"]
    assert "300 tokens" in message and "128" in message and "shorten the prompt" in message


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                                ("DELETE", "/v1/models", 405)])
def test_unknown_routes_and_methods_get_openai_shaped_errors(client, method, path, status):
    assert_openai_error(client.request(method, path), status)


def test_refusals_are_counted_by_endpoint(client):
    before = client.get("/metrics").text
    client.post("/v1/chat/completions", json={"messages": "hi"})
    after = client.get("/metrics").text
    line = 'memra:requests_total{endpoint="chat",outcome="invalid"} '
    count = lambda text: float(next((l[len(line):] for l in text.splitlines() if l.startswith(line)), 0))  # noqa
    assert count(after) == count(before) + 1


def count_of(client, endpoint: str, outcome: str) -> float:
    line = f'memra:requests_total{{endpoint="{endpoint}",outcome="{outcome}"}} '
    return float(next((l[len(line):] for l in client.get("/metrics").text.splitlines() if l.startswith(line)), 0))


def test_a_body_past_the_cap_is_refused_before_it_is_read(client, monkeypatch):
    from memra.serve import app

    monkeypatch.setattr(app, "MAX_BODY_BYTES", 1000)
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "x" * 2000}), 413)
    assert "larger than" in error["message"]
    assert client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 2}).status_code == 200


def test_a_bug_while_parsing_is_a_counted_500_and_the_connection_stays_usable(client, monkeypatch):
    from memra.serve import app

    def broken(engine, body, chat):
        raise TypeError("a bug")
    before = count_of(client, "completions", "error")
    monkeypatch.setattr(app, "parse_request", broken)
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "xy"}), 500)
    assert error["type"] == "server_error" and "TypeError" in error["message"]
    assert count_of(client, "completions", "error") == before + 1
    monkeypatch.undo()
    assert client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 2}).status_code == 200


def test_a_null_max_completion_tokens_leaves_max_tokens_in_force(client):
    body = {**CHAT, "max_completion_tokens": None, "max_tokens": 3, "draft": None}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
