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
from memra.jsonfile import read_small_file


class SecurityError(Exception):
    """A chat template past one of the render bounds below."""

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
PLAIN_NAME = "plain (memra)"
TEMPLATE_FIX = "fix it, or remove it to use memra's plain chat template"
MAX_TEMPLATE_BYTES = 1 << 20      # real templates are a few KiB
MAX_TEMPLATE_WORK = 1_000_000     # loop items (range) a render may make
MAX_RENDERED_CHARS = 16 << 20     # a rendered prompt, far past any context
MAX_EXPONENT = 4096


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
        raw = read_small_file(file, MAX_TEMPLATE_BYTES, "a chat template", ConfigError, TEMPLATE_FIX)
        if raw is not None:
            try:
                return cls(raw.decode("utf-8"), special, TEMPLATE_FILE)
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{file} is not UTF-8 (byte {exc.start}); {TEMPLATE_FIX}") from None
        raw = config.get("chat_template")
        if isinstance(raw, list):  # named templates: the default one
            named = [t for t in raw if isinstance(t, dict) and t.get("name") == "default"]
            if not named:
                raise ConfigError(f"{TOKENIZER_CONFIG} chat_template lists templates but none named 'default' (the "
                                  f"one chat requests use); {TEMPLATE_FIX}")
            raw = named[0].get("template")
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
        budget = [MAX_TEMPLATE_WORK]

        def bounded_range(*args):  # shadows the sandbox's range (at most 100000 items a call) for this render
            items = range(*args)
            budget[0] -= len(items)
            if budget[0] < 0:
                raise SecurityError(f"the template's loops ask for more than {MAX_TEMPLATE_WORK} items")
            return items

        out, length = [], 0
        try:
            for piece in self.template.generate(messages=messages, add_generation_prompt=True, range=bounded_range,
                                                **self.special):
                out.append(piece)
                length += len(piece)
                if length > MAX_RENDERED_CHARS:
                    raise SecurityError(f"the rendered prompt passes {MAX_RENDERED_CHARS} characters")
        except Exception as exc:  # the template's own raise_exception(), a template bug, or a bound above
            raise InputError(f"the chat template refused these messages: {_one_line(exc)}") from None
        return "".join(out)


def _compile(source: str, name: str):
    try:
        import jinja2.sandbox
    except ImportError:
        raise ConfigError("the checkpoint has a chat template, and rendering it needs jinja2: "
                          "pip install 'memra[serve]'") from None

    class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
        """Jinja's sandbox with its repetition operators bounded: `'x' * 4000000000` (folded at
        compile time, were '*' not intercepted) or `2 ** 10 ** 9` would take memory or time without end."""

        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            sizes = [len(v) for v in (left, right) if isinstance(v, (str, list, tuple))]
            counts = [v for v in (left, right) if isinstance(v, int)]
            if operator == "*" and sizes and counts and sizes[0] * max(counts[0], 0) > MAX_RENDERED_CHARS:
                raise SecurityError(f"the template repeats a sequence past {MAX_RENDERED_CHARS} items")
            if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
                raise SecurityError(f"the template raises to a power past {MAX_EXPONENT}")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise ValueError(message)

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
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
