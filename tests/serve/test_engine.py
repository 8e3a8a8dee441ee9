"""Engine(options, model=...) serves a model already in memory: it never loads one or writes the
demo; without a checkpoint there is no tokenizer (token-id prompts only), with one the checkpoint's
tokenizer and name come along. Served over memra.serve.inprocess, its tokens are generate's."""

import os

import pytest

import memra
from memra import generate, load_model

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from memra.serve.app import ServeSettings, create_app  # noqa: E402
from memra.serve.engine import IN_MEMORY_NAME, Engine, EngineOptions  # noqa: E402
from memra.serve.inprocess import InProcessServer  # noqa: E402

PROMPT = [3, 141, 59, 26, 53, 58, 97, 93]


@pytest.fixture(scope="module")
def model(small_dir):
    return load_model(small_dir, backend="numpy")


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("Engine loaded a model although it was given one")

    monkeypatch.setattr(memra, "load_model", refuse)


def test_a_given_model_without_a_checkpoint_is_served_with_token_ids_only(model, tmp_path, no_loading):
    demo = tmp_path / "demo"
    engine = Engine(EngineOptions(demo_dir=str(demo), draft="native-mtp"), model=model)
    assert engine.model is model and engine.tokenizer is None and engine.name == IN_MEMORY_NAME
    assert engine.eos == tuple(model.cfg.eos_token_id) and engine.default_draft == "native-mtp"
    assert not demo.exists()
    assert "a model in memory" in engine.describe()


def test_a_given_model_with_a_checkpoint_takes_its_tokenizer_and_name(model, small_dir, no_loading):
    engine = Engine(EngineOptions(checkpoint=small_dir), model=model)
    assert engine.model is model and engine.tokenizer is not None
    assert engine.name == os.path.basename(os.path.normpath(small_dir))


def test_an_in_memory_engine_served_in_process_streams_generates_tokens(model):
    expected = {d: generate(model, PROMPT, 6, draft=d, num_draft_tokens=3).tokens for d in (None, "native-mtp")}
    engine = Engine(EngineOptions(draft="native-mtp", drafts=("native-mtp",)), model=model)
    with InProcessServer(create_app(engine, ServeSettings(burst_tokens=2))) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        for draft, tokens in expected.items():
            body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True, "draft": draft}
            if draft:
                body["num_draft_tokens"] = 3
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["token_ids"] == tokens
        text = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert text.status_code == 400 and "no tokenizer" in text.json()["error"]["message"]
    assert not server.thread.is_alive()
