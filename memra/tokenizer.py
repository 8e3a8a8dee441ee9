"""Text <-> token ids at the edge of memra: the engine itself only ever sees ids.

    tok = load_tokenizer("path/to/checkpoint", vocab_size=cfg.vocab_size)
    ids = tok.encode("Hello")            # list[int]
    text = tok.decode(ids)               # str; special tokens dropped, broken UTF-8 as U+FFFD

A checkpoint's `tokenizer.json` is loaded with Hugging Face `tokenizers`. Without one, a model
whose vocab is exactly 256 (the demo, the `small` preset) gets the byte-level tokenizer: one
token per UTF-8 byte. Any other model without a tokenizer.json gets None: ids only.
`TextStream` turns ids committed a few at a time into text that is safe to print as it comes.
"""

from __future__ import annotations

import os

from memra.errors import CheckpointError
from memra.jsonfile import read_small_file

TOKENIZER_FILE = "tokenizer.json"
MAX_TOKENIZER_BYTES = 256 << 20  # the largest public tokenizer.json files are tens of MiB
BYTE_VOCAB = 256
REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """One token per UTF-8 byte (vocab 256)."""

    name = "byte-level"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([int(token)])


class HFTokenizer:
    """A `tokenizers.Tokenizer` read from tokenizer.json."""

    def __init__(self, path: str, vocab_size: int):
        try:
            from tokenizers import Tokenizer
        except ImportError:  # a core dependency; only a broken install lands here
            raise CheckpointError(f"{path} needs the `tokenizers` package: pip install tokenizers") from None
        fix = "re-export tokenizer.json, or use --prompt-ids"
        raw = read_small_file(path, MAX_TOKENIZER_BYTES, "a tokenizer.json", CheckpointError, fix)
        try:
            self.tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # tokenizers raises plain Exception on a bad file
            raise CheckpointError(f"{path} could not be read as a tokenizer ({_one_line(exc)}): {fix}") from None
        size = self.tok.get_vocab_size(with_added_tokens=True)
        if size > vocab_size:
            raise CheckpointError(f"{path} has {size} tokens but the model's vocab is {vocab_size}: the "
                                  "tokenizer belongs to another checkpoint; copy the matching tokenizer.json")
        self.name = f"tokenizers ({os.path.basename(path)})"

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text).ids)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes, which may be part of a character (decode shows that as U+FFFD):
        a byte-level BPE piece through the byte alphabet, a `<0xNN>` byte-fallback piece as its byte."""
        from tokenizers import decoders

        piece = self.tok.id_to_token(int(token)) or ""
        if isinstance(self.tok.decoder, decoders.ByteLevel) and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.decode([token]).encode("utf-8")


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): a printable byte stands for itself, every other byte
    for chr(256 + n), n counting those bytes in order. Returns char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTE_OF = _byte_alphabet()


def load_tokenizer(checkpoint_dir, vocab_size: int):
    """The checkpoint's tokenizer: tokenizer.json, else byte-level for a 256 vocab, else None."""
    path = os.path.join(os.fspath(checkpoint_dir), TOKENIZER_FILE)
    if os.path.exists(path):
        return HFTokenizer(path, vocab_size)
    if vocab_size == BYTE_VOCAB:
        return ByteTokenizer()
    return None


class TextStream:
    """Incremental detokenization: push committed ids, get back the text that is now stable.

    Each push decodes a short window of the accumulated ids twice (up to the last printed
    boundary, and to the end) and returns only the new suffix; a suffix that ends in U+FFFD may
    be a multi-byte character cut between tokens, so it is held until more ids arrive or
    `finish()`. Seed it with the prompt so the first token's leading space survives decoders
    that strip one at the start of a decode (unless the prompt ends inside a character).
    """

    CONTEXT = 5  # prompt ids kept as left context

    def __init__(self, decode, prompt_ids=()):
        self.decode = decode
        self.ids = [int(t) for t in list(prompt_ids)[-self.CONTEXT:]]
        if decode(self.ids).endswith(REPLACEMENT):
            self.ids = []  # a prompt cut inside a character: its tail must not merge into the output
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, new_ids) -> str:
        self.ids.extend(int(t) for t in new_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """Whatever is still held back (a trailing U+FFFD is real once no more ids come)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
