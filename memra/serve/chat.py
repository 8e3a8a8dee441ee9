"""Chat messages -> prompt text: the checkpoint's own chat template, or memra's plain one.

A checkpoint's template is the Jinja `chat_template` of its tokenizer_config.json (a string, or
the entry named "default" of a list), or a chat_template.jinja file beside it; it is rendered
in a sandbox with `messages`, `add_generation_prompt=True`, `bos_token` and `eos_token`.

Without one, the plain template writes each message as `<role>: <content>` on its own line and
ends with `assistant:`, which the model continues:

    system: You are terse.
    user: Hi
    assistant:
"""

from __future__ import annotations

import os

from memra.config import read_optional_json
from memra.errors import ConfigError, InputError

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
PLAIN_NAME = "plain (memra)"


class ChatTemplate:
    def __init__(self, source: str | None = None, special: dict | None = None, name: str = PLAIN_NAME):
        self.name = name
        self.special = special or {}
        self.template = None if source is None else _compile(source, name)

    @classmethod
    def load(cls, checkpoint_dir: str) -> "ChatTemplate":
        config = read_optional_json(os.path.join(checkpoint_dir, TOKENIZER_CONFIG))
        special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}
        file = os.path.join(checkpoint_dir, TEMPLATE_FILE)
        if os.path.exists(file):
            with open(file, encoding="utf-8") as f:
                return cls(f.read(), special, TEMPLATE_FILE)
        raw = config.get("chat_template")
        if isinstance(raw, list):  # named templates: the default one
            raw = next((t.get("template") for t in raw if isinstance(t, dict) and t.get("name") == "default"), None)
        if raw is None:
            return cls()
        if not isinstance(raw, str):
            raise ConfigError(f"{TOKENIZER_CONFIG} chat_template must be a Jinja string; fix it or remove it "
                              "to use memra's plain chat template")
        return cls(raw, special, f"{TOKENIZER_CONFIG} chat_template")

    def render(self, messages: list[dict]) -> str:
        """messages: [{"role": str, "content": str}], already checked by the request parser."""
        if self.template is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except Exception as exc:  # the template's own raise_exception(), or a template bug
            raise InputError(f"the chat template refused these messages: {_one_line(exc)}") from None


def _compile(source: str, name: str):
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("the checkpoint has a chat template, and rendering it needs jinja2: "
                          "pip install 'memra[serve]'") from None

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except Exception as exc:
        raise ConfigError(f"the chat template ({name}) does not compile: {_one_line(exc)}; fix it or remove "
                          "it to use memra's plain chat template") from None


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} (an AddedToken)
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
