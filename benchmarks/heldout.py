"""Held-out code for measuring the demo model: the files training/corpus.py held out (by path
hash), read from this interpreter's standard library and used only where their sha256 matches
the manifest, so every number is taken on exactly the recorded held-out text.

    files = heldout_files()                                  # [(path, text)], manifest order
    prompts = heldout_prompts(tokenizer, 16, 128, 128)       # [(path, prompt ids)]
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(REPO, "training", "manifest", "corpus.json")


def heldout_files(manifest: str = MANIFEST) -> list[tuple[str, str]]:
    """(path, text) of every held-out file present here with the recorded sha256."""
    with open(manifest, encoding="utf-8") as f:
        entries = [e for e in json.load(f)["files"] if e["split"] == "heldout"]
    lib, out = sysconfig.get_paths()["stdlib"], []
    for e in entries:
        path = os.path.join(lib, e["path"])
        try:
            raw = open(path, "rb").read()
        except OSError:
            continue
        if hashlib.sha256(raw).hexdigest() == e["sha256"]:
            out.append((e["path"], raw.decode("utf-8")))
    return out


def heldout_prompts(tokenizer, n: int, prompt_tokens: int, new_tokens: int,
                    manifest: str = MANIFEST) -> list[tuple[str, list[int]]]:
    """Up to `n` prompts of `prompt_tokens` ids, one per held-out file long enough to hold the
    prompt and `new_tokens` more, cut at an offset fixed by the path (not the file's head, whose
    license and docstring boilerplate would flatter acceptance)."""
    out = []
    for path, text in heldout_files(manifest):
        ids = tokenizer.encode(text)
        room = len(ids) - prompt_tokens - new_tokens
        if room < 0:
            continue
        start = zlib.crc32(path.encode()) % (room + 1)
        out.append((path, ids[start:start + prompt_tokens]))
        if len(out) == n:
            break
    return out


def is_looping(tape: list[int], max_period: int = 64) -> bool:
    """True when the tape's second half repeats itself with some period <= max_period: a
    degenerate loop that any drafter predicts, so it would flatter acceptance (research
    training.md: discard looping outputs)."""
    half = tape[len(tape) // 2:]
    for p in range(1, min(max_period, len(half) // 2) + 1):
        if all(half[i] == half[i - p] for i in range(p, len(half))):
            return True
    return False


def excerpt_ids(tokenizer, paths: list[str], per_file: int, eos: int,
                manifest: str = MANIFEST) -> list[int] | None:
    """The first `per_file` ids of each named held-out file, each followed by `eos`, or None when
    any of them is not here with its recorded sha256 (the demo model card's held-out excerpt)."""
    found = dict(heldout_files(manifest))
    if not all(p in found for p in paths):
        return None
    ids: list[int] = []
    for p in paths:
        ids += tokenizer.encode(found[p])[:per_file] + [eos]
    return ids
