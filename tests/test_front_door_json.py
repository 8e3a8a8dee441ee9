"""Hostile JSON at every file memra opens: one guarded reader, one refusal naming the file.

Each JSON site (config.json through load_config and load_model, the shard index, the drafter
config, generation_config.json, tokenizer_config.json, the safetensors header) is fed each hostile
file (nested past the bound, oversized, not UTF-8, not an object, a repeated key, an integer
past Python's digit limit, a FIFO, a directory). Every one must be refused with the site's
MemraError subclass, in one line that names the file, well inside a deadline (a FIFO or a
recursion would otherwise hang or crash).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
from deadline import within

import memra
from memra.checkpoint import INDEX_FILE, SINGLE_FILE
from memra.cli.inputs import read_generation_config
from memra.config import read_optional_json
from memra.drafters.dflash2.config import load_dflash_config
from memra.errors import CheckpointError, ConfigError
from memra.jsonfile import MAX_JSON_BYTES, MAX_JSON_DEPTH, parse_json, read_json_object
from memra.safetensors_io import read_header

ROOT = Path(__file__).resolve().parent.parent
DEEP = 100_000

HOSTILE = {
    "nested arrays": b"[" * DEEP + b"]" * DEEP,
    "nested objects": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "unclosed nesting": b"[" * DEEP,
    "not UTF-8": b'{"model_type": "\xff\xfe"}',
    "not an object": b"[1, 2, 3]",
    "a repeated key": b'{"model_type": "glm5_next_text", "model_type": "other"}',
    "an integer past the digit limit": b'{"vocab_size": 1' + b"0" * 5000 + b"}",
    "oversized": None,   # a sparse file one byte past MAX_JSON_BYTES
    "a FIFO": None,      # opening one for reading blocks until a writer comes
    "a directory": None,
}
WHY = {  # a piece of each refusal: the bound or the reason, not just "bad"
    "nested arrays": f"past the bound of {MAX_JSON_DEPTH}", "nested objects": f"past the bound of {MAX_JSON_DEPTH}",
    "unclosed nesting": f"past the bound of {MAX_JSON_DEPTH}", "not UTF-8": "not UTF-8",
    "not an object": "must hold a JSON object", "a repeated key": "duplicate key 'model_type'",
    "an integer past the digit limit": "not valid JSON", "oversized": f"{MAX_JSON_BYTES}-byte bound",
    "a FIFO": "not a regular file", "a directory": "not a regular file",
}


def plant(file: Path, kind: str) -> None:
    """Put the hostile `kind` at `file` (replacing whatever was there)."""
    if file.is_dir():
        shutil.rmtree(file)
    elif file.exists():
        file.unlink()
    if kind == "oversized":
        with open(file, "wb") as f:
            f.truncate(MAX_JSON_BYTES + 1)
    elif kind == "a FIFO":
        os.mkfifo(file)
    elif kind == "a directory":
        file.mkdir()
    else:
        file.write_bytes(HOSTILE[kind])


def _checkpoint_copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _sharded(src: str, dst: Path) -> Path:
    """A checkpoint whose weights sit in a shard named by the index (the index is the target)."""
    d = _checkpoint_copy(src, dst)
    (d / SINGLE_FILE).rename(d / "model-00001-of-00001.safetensors")
    return d


SITES = {
    # site: (make the directory, the file memra reads, the call, the error class)
    "config.json (load_config)": (_checkpoint_copy, "config.json", memra.load_config, ConfigError),
    "config.json (load_model)": (_checkpoint_copy, "config.json",
                                 lambda d: memra.load_model(d, backend="numpy"), ConfigError),
    "shard index (load_model)": (_sharded, INDEX_FILE, lambda d: memra.load_model(d, backend="numpy"),
                                 CheckpointError),
    "generation_config.json": (_checkpoint_copy, "generation_config.json", read_generation_config, ConfigError),
    "tokenizer_config.json": (_checkpoint_copy, "tokenizer_config.json",
                              lambda d: read_optional_json(os.path.join(d, "tokenizer_config.json")), ConfigError),
    "dflash2 drafter config.json": (_checkpoint_copy, "config.json", load_dflash_config, ConfigError),
}
# A file that cannot be read as a file at all (a FIFO, a directory) is the caller's "unreadable"
# error: a drafter directory without a readable config.json is a drafter-checkpoint problem.
UNREADABLE = {"dflash2 drafter config.json": CheckpointError}


@pytest.mark.parametrize("kind", list(HOSTILE))
@pytest.mark.parametrize("site", list(SITES))
def test_every_json_site_refuses_every_hostile_file_in_one_line(fixture_dir, tmp_path, site, kind):
    make, name, call, error = SITES[site]
    if kind in ("a FIFO", "a directory"):
        error = UNREADABLE.get(site, error)
    d = make(fixture_dir("small"), tmp_path / "ckpt")
    file = d / name
    plant(file, kind)
    with within(10), pytest.raises(error) as info:
        call(str(d))
    message = str(info.value)
    assert str(file) in message and "\n" not in message
    assert WHY[kind] in message, message


@pytest.mark.parametrize("kind", [k for k in HOSTILE if HOSTILE[k] is not None])
def test_a_safetensors_header_is_read_by_the_same_guarded_parser(tmp_path, kind):
    raw = HOSTILE[kind]
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with within(10), pytest.raises(CheckpointError) as info:
        read_header(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert ("must be a JSON object" if kind == "not an object" else WHY[kind]) in message, message


def test_the_depth_bound_is_exact_and_ignores_brackets_inside_strings():
    at_bound = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(at_bound, "x") == parse_json(at_bound, "x")  # parses, no refusal
    with pytest.raises(ConfigError, match=f"nested {MAX_JSON_DEPTH + 1} levels"):
        parse_json("[" + at_bound + "]", "x")
    text = json.dumps({"chat_template": "{{" * 500 + "[" * 500 + '\\"['})
    assert parse_json(text, "x")["chat_template"].startswith("{{")


def test_real_files_still_read(fixture_dir, tmp_path):
    """The green arm: the guard refuses nothing a real checkpoint holds."""
    d = Path(fixture_dir("small"))
    assert memra.load_config(d).vocab_size == json.loads((d / "config.json").read_text())["vocab_size"]
    gen = {"do_sample": True, "temperature": 0.7, "eos_token_id": [1, 2]}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    assert read_generation_config(str(tmp_path)) == gen
    assert read_json_object(tmp_path / "absent.json", absent={}) == {}


def test_every_json_read_in_memra_goes_through_the_reader():
    """json.load/json.loads appear only in the reader (and the server's HTTP body parsing), so a
    new JSON site cannot skip the guard unnoticed."""
    allowed = {"memra/jsonfile.py"}
    offenders = []
    for path in sorted((ROOT / "memra").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in allowed or rel.startswith("memra/serve/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bjson\.loads?\(", line):
                offenders.append(f"{rel}:{n}")
    assert offenders == []
