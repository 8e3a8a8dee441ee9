"""The server through the real `openai` client: completions and chat, streamed and not; the text
and token ids equal `generate`'s for the same request, whatever the draft source; usage carries
the request's acceptance; stop strings and logprobs behave as OpenAI documents them."""

import pytest

from memra import SamplingParams
from memra.serve.chat import ChatTemplate
from memra.tokenizer import ByteTokenizer
from tests.serve.helpers import Server, Solo, make_engine

openai = pytest.importorskip("openai")

TOK = ByteTokenizer()
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def served(small_dir, drafter_dir):
    engine = make_engine(small_dir, drafter_dir)
    server = Server(engine, burst_tokens=4)
    yield server
    server.close()


@pytest.fixture(scope="module")
def solo(small_dir, drafter_dir, served):
    return Solo(small_dir, drafter_dir, served.app.state.engine.eos)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def text_of(tokens, eos) -> str:
    return TOK.decode([t for t in tokens if t not in eos])


@pytest.mark.parametrize("draft", [None, "native-mtp", "dflash2"])
def test_a_completion_is_generates_text_and_tokens(client, solo, draft):
    r = client.completions.create(model="small", prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"draft": draft, "return_token_ids": True})
    want = solo.tokens(TOK.encode(PROMPT), 6, draft=draft)
    choice = r.choices[0]
    assert choice.token_ids == want.tokens and choice.text == text_of(want.tokens, solo.eos)
    assert choice.finish_reason == ("stop" if want.tokens[-1] in solo.eos else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT), len(want.tokens))
    spec = r.usage.model_extra["speculative"]
    if draft is None:
        assert spec is None
    else:
        assert spec["draft"] == draft and spec["k"] == 4
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"):
            assert spec[key] == want.stats[key]
        assert spec["mean_acceptance_length"] == pytest.approx(want.stats["mean_acceptance_length"])


def test_a_streamed_sampled_completion_is_generates_and_ends_with_usage(client, solo):
    sampling = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 11}
    chunks = list(client.completions.create(model="small", prompt=PROMPT, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True}, temperature=0.8, top_p=0.9,
                                            seed=11, extra_body={"top_k": 40, "draft": "native-mtp",
                                                                 "return_token_ids": True}))
    want = solo.tokens(TOK.encode(PROMPT), 9, draft="native-mtp", sampling=SamplingParams(**sampling))
    body, last = chunks[:-1], chunks[-1]
    assert [t for c in body for t in c.choices[0].token_ids] == want.tokens
    assert "".join(c.choices[0].text for c in body) == text_of(want.tokens, solo.eos)
    assert body[-1].choices[0].finish_reason in ("stop", "length") and len(body) > 2
    assert last.choices == [] and last.usage.completion_tokens == len(want.tokens)
    assert all(c.usage is None for c in body)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_uses_the_plain_template_and_is_generates_text(client, solo, stream):
    prompt = TOK.encode(ChatTemplate().render(MESSAGES))
    want = solo.tokens(prompt, 7, draft="native-mtp")
    r = client.chat.completions.create(model="small", messages=MESSAGES, max_tokens=7, stream=stream,
                                       extra_body={"draft": "native-mtp"})
    if stream:
        chunks = list(r)
        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(prompt)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert content == text_of(want.tokens, solo.eos) and finish in ("stop", "length")


def test_logprobs_are_the_targets_whatever_the_draft_source(client):
    def ask(draft):
        r = client.chat.completions.create(model="small", messages=MESSAGES, max_tokens=6, logprobs=True,
                                           top_logprobs=3, extra_body={"draft": draft})
        return r.choices[0].logprobs.content

    plain, spec = ask(None), ask("native-mtp")
    assert len(plain) == 6 and all(len(e.top_logprobs) == 3 for e in plain)
    assert [(e.token, e.logprob) for e in plain] == [(e.token, e.logprob) for e in spec]
    for e in plain:   # greedy: each token is the most likely one
        assert e.logprob == e.top_logprobs[0].logprob <= 0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_the_text_and_ends_generation_at_its_token(client, solo, stream):
    tape = solo.tokens(TOK.encode(PROMPT), 40).tokens
    text = TOK.decode(tape)
    at = next(i for i in range(3, len(text) - 1) if text[i].isascii() and text[i + 1].isascii())
    stop = text[at:at + 2]
    n = next(n for n in range(1, len(tape) + 1) if stop in TOK.decode(tape[:n]))
    assert n < len(tape)
    r = client.completions.create(model="small", prompt=PROMPT, max_tokens=40, stop=[stop, "never-there"],
                                  stream=stream, extra_body={"draft": "native-mtp", "return_token_ids": True})
    chunks = list(r) if stream else [r]
    assert "".join(c.choices[0].text for c in chunks) == text[:text.find(stop)]
    assert [t for c in chunks for t in c.choices[0].token_ids] == tape[:n]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_lists_the_served_model_and_its_draft_sources(client, served):
    (model,) = client.models.list().data
    assert model.id == served.app.state.engine.name
    assert {"native-mtp", "dflash2"} <= set(model.model_extra["draft_sources"])


def byte_of(spelling: str) -> int:
    """The byte-level token a logprobs entry names: its character, or a lone byte as "bytes:\\xNN"."""
    return int(spelling[len("bytes:\\x"):], 16) if spelling.startswith("bytes:") else ord(spelling)


def test_logprobs_name_each_byte_piece_apart(client):
    """Byte tokens 128..255 are no whole character alone: each decodes to U+FFFD, so named by
    their text, a top-20 list would keep one of them. Named by their bytes, all 20 stay, and chat
    gives each entry its own byte."""
    r = client.completions.create(model="small", prompt=PROMPT, max_tokens=4, logprobs=20,
                                  extra_body={"draft": None})
    tops = r.choices[0].logprobs.top_logprobs
    assert len(tops) == 4 and all(len(top) == 20 for top in tops)
    lists = [[byte_of(s) for s in top] for top in tops]
    assert all(len(set(ids)) == 20 and all(0 <= i < 256 for i in ids) for ids in lists)
    # named by their text (all U+FFFD), two such pieces would have shared one key
    assert any(sum(i >= 128 for i in ids) >= 2 for ids in lists), "no list to bite on: pick another prompt"
    c = client.chat.completions.create(model="small", messages=MESSAGES, max_tokens=4, logprobs=True,
                                       top_logprobs=20, extra_body={"draft": None})
    for entry in c.choices[0].logprobs.content:
        for e in (entry, *entry.top_logprobs):
            assert e.bytes == [byte_of(e.token)]
