"""Engine(options, model=...) serves a model already in memory: it never loads one or falls back to
the demo; without a checkpoint there is no tokenizer (token-id prompts only), with one the
checkpoint's tokenizer and name come along. Served over memra.serve.inprocess, its tokens are
generate's. Engine(options) without a checkpoint serves the demo model memra ships, with its
DFlash2 drafter, or is refused in one line when the install lost it."""

import os

import pytest

import memra
from memra import demo_model, generate, load_model
from memra.errors import CheckpointError

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from memra.serve.app import ServeSettings, create_app  # noqa: E402
from memra.serve.cli import main as serve_main  # noqa: E402
from memra.serve.engine import DEMO_NAME, IN_MEMORY_NAME, Engine, EngineOptions  # noqa: E402
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


def test_a_given_model_without_a_checkpoint_is_served_with_token_ids_only(model, no_loading):
    engine = Engine(EngineOptions(draft="native-mtp"), model=model)
    assert engine.model is model and engine.tokenizer is None and engine.name == IN_MEMORY_NAME
    assert engine.eos == tuple(model.cfg.eos_token_id) and engine.default_draft == "native-mtp"
    assert not engine.source.demo and "a model in memory" in engine.describe()


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


def test_without_a_checkpoint_the_shipped_demo_is_served_with_its_drafter():
    engine = Engine(EngineOptions(backend="numpy"))
    assert engine.source.demo and engine.source.path == demo_model.TARGET and engine.name == DEMO_NAME
    assert engine.vocab_size == 8192 and engine.tokenizer.encode(demo_model.PROMPT)
    assert engine.default_draft == "native-mtp" and {"native-mtp", "dflash2"} <= set(engine.drafters)
    assert "the demo model at" in engine.describe()
    # the same directory as --checkpoint is not the demo: its drafter is not filled in
    other = Engine(EngineOptions(checkpoint=demo_model.TARGET, backend="numpy"), model=engine.model)
    assert "dflash2" in other.unavailable and "dflash2" not in other.drafters


def test_a_demo_missing_from_the_install_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo_model, "TARGET", str(tmp_path))
    with pytest.raises(CheckpointError, match="the demo model is missing from this install"):
        Engine(EngineOptions(backend="numpy"))
    assert serve_main(["--port", "0", "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memra serve: the demo model is missing") and err.count("\n") == 1


@pytest.mark.parametrize("stages, stage_layers", [(2, None), (1, "0-1,2-3,4-5")])
def test_a_staged_engine_serves_the_unsplit_models_tokens(model, small_dir, stages, stage_layers):
    """`memra serve --gpus N` / `--stage-layers`: the engine loads the trunk as stages (numpy: in
    this process) and a request's tokens are the one-stage model's."""
    expected = generate(model, PROMPT, 6, draft="native-mtp", num_draft_tokens=3).tokens
    engine = Engine(EngineOptions(checkpoint=small_dir, backend="numpy", stages=stages, stage_layers=stage_layers,
                                  draft="native-mtp", drafts=("native-mtp",)))
    assert engine.model.placement.count == (stages if stage_layers is None else 3)
    with InProcessServer(create_app(engine, ServeSettings(burst_tokens=2))) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True,
                "draft": "native-mtp", "num_draft_tokens": 3}
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected


def test_a_context_too_short_for_the_default_draft_source_is_refused_at_start(small_dir):
    from tests.serve.helpers import make_engine
    from memra.errors import InputError

    with pytest.raises(InputError, match="--max-ctx 10 cannot hold a speculative round .* give --max-ctx 15 or more"):
        make_engine(small_dir, max_ctx=10)


def test_a_prompt_past_the_room_gets_fixes_that_can_be_made(small_dir):
    from tests.serve.helpers import Server, make_engine

    server = Server(make_engine(small_dir, max_ctx=16))
    with server.client() as c:
        message = c.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5]}).json()["error"]["message"]
    server.close()
    assert "shorten the prompt to at most 3 tokens or send draft: null" in message
