"""The served text: detokenized one id at a time (so it depends on the ids alone), stop strings
cut on the text, streamed deltas that never show a tail a stop string could still claim; and
the chat templates (memra's plain one, a checkpoint's Jinja one)."""

import json
import random

import pytest

from memra.errors import InputError
from memra.serve.chat import ChatTemplate
from memra.serve.text import TextOutput
from memra.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def stream(text_or_ids, stops=(), prompt=(65,)):
    """Push ids one by one, releasing after each; returns (deltas, stopped, ids consumed)."""
    ids = list(text_or_ids.encode()) if isinstance(text_or_ids, str) else list(text_or_ids)
    out, deltas, used = TextOutput(TOK, list(prompt), stops), [], 0
    for t in ids:
        used += 1
        stopped = out.push(t)
        deltas.append(out.release(final=False))
        if stopped:
            break
    out.finish()
    deltas.append(out.release(final=True))
    return deltas, out.stopped, used


def test_without_stops_the_text_is_the_decode_of_all_ids_however_they_arrive():
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(256), 0xE2, 0x82, 0xAC, 0xC3, 0xA9]) for _ in range(rng.randrange(30))]
        deltas, stopped, _ = stream(ids, prompt=[rng.randrange(256)])
        assert "".join(deltas) == TOK.decode(ids) and not stopped


def test_a_stop_string_ends_the_text_before_it_and_names_the_token_that_completed_it():
    deltas, stopped, used = stream("Hello world\n\nBye", stops=("\n\n",))
    assert stopped and "".join(deltas) == "Hello world"
    assert used == len("Hello world\n\n")          # generation ends at the token that completed the stop


def test_the_earliest_of_several_stops_wins_even_across_tokens():
    deltas, stopped, _ = stream("abc STOP def END", stops=("END", "STOP", "zzz"))
    assert stopped and "".join(deltas) == "abc "


def test_a_tail_that_could_become_a_stop_is_held_back_then_released():
    deltas, stopped, _ = stream("ab\nc\n\nd", stops=("\n\n",))
    assert stopped and "".join(deltas) == "ab\nc"
    # "\n" alone was held while it could still start "\n\n", and let go once "c" settled it
    assert deltas[2] == "" and deltas[3] == "\nc"
    assert all("\n\n" not in d for d in deltas)


def test_a_held_tail_goes_out_when_generation_ends_without_the_stop():
    deltas, stopped, _ = stream("the end ST", stops=("STOP",))
    assert not stopped and deltas[-2] == "" and "".join(deltas) == "the end ST"
    assert deltas[-1] == "ST"                      # only finish() releases it


def test_a_multibyte_character_cut_between_tokens_is_never_split():
    deltas, _, _ = stream("é€")
    assert [d for d in deltas if d] == ["é", "€"]


def test_no_tokenizer_means_no_text():
    out = TextOutput(None, [1, 2], ())
    assert out.push(5) is False
    out.finish()
    assert out.release(final=True) == ""


def test_the_plain_chat_template_is_role_colon_content_lines_then_the_assistant_turn():
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate().render(messages) == "system: Be terse.\nuser: Hi\nassistant:"


def test_a_checkpoint_chat_template_is_rendered_with_its_special_tokens(tmp_path):
    pytest.importorskip("jinja2")
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    chat = ChatTemplate.load(str(tmp_path))
    assert chat.render([{"role": "user", "content": "Hi"}]) == "<s><|user|>Hi<|assistant|>"


def test_a_template_that_raises_refuses_the_request_by_its_message():
    pytest.importorskip("jinja2")
    chat = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(InputError, match="only user turns"):
        chat.render([{"role": "user", "content": "x"}])


def test_no_template_file_means_the_plain_template(tmp_path):
    assert ChatTemplate.load(str(tmp_path)).template is None


@pytest.mark.parametrize("source, bound", [
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x", "loops ask for more"),
    ("{{ 'x' * 4000000000 }}", "repeats a sequence past"),   # folded at compile time, were '*' not intercepted
    ("{{ 2 ** 100000000 }}", "raises to a power past"),
    ("{% for a in range(100000) %}{{ 'y' * 200 }}{% endfor %}", "rendered prompt passes"),
])
def test_a_template_past_the_render_bounds_is_refused_quickly(source, bound):
    pytest.importorskip("jinja2")
    import time

    start = time.monotonic()
    with pytest.raises(InputError, match=bound):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert time.monotonic() - start < 5
    assert ChatTemplate("{% for a in range(3) %}{{ a }}{% endfor %}").render([]) == "012"  # loops still run


@pytest.mark.parametrize("kind", ["not-utf8", "directory", "fifo"])
def test_a_template_file_that_cannot_be_read_is_a_config_error(tmp_path, kind):
    import os

    from memra.errors import ConfigError

    path = tmp_path / "chat_template.jinja"
    if kind == "not-utf8":
        path.write_bytes(b"\xff\xfe{{ x }}")
    elif kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    with pytest.raises(ConfigError, match="chat_template.jinja"):
        ChatTemplate.load(str(tmp_path))


def test_named_templates_without_a_default_are_refused(tmp_path):
    from memra.errors import ConfigError

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use",
                                                                                    "template": "{{ 1 }}"}]}))
    with pytest.raises(ConfigError, match="none named 'default'"):
        ChatTemplate.load(str(tmp_path))
