"""The one guarded JSON reader: every JSON memra reads (config.json, the shard index,
generation_config.json, tokenizer_config.json, drafter configs, safetensors headers, option values)
goes through here.

`json.load` trusts its input: a file nested 100k levels deep raises RecursionError, a huge one is
read whole, a FIFO blocks forever, a repeated key silently keeps the last value. Here each of those
is refused with ONE error (the caller picks the class) naming the file, the bound and the fix.

    raw = read_json_object(path, error=ConfigError, fix="re-export the config")   # -> dict
    raw = read_json_object(path, fix="fix or delete it", absent={})               # optional file
    value = parse_json(text, where="--draft-option x", error=UsageError, fix="...")
"""

from __future__ import annotations

import json
import os
import re
import stat

import numpy as np

from memra.errors import ConfigError

MAX_JSON_BYTES = 64 * 2**20  # a shard index of a 1T-parameter release is ~10 MiB; configs are KiB
MAX_JSON_DEPTH = 64          # real configs nest 3-4 levels; json's C parser recurses per level
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: linear, no backtracking
_DEPTH_CHUNK = 1 << 20


def nesting_depth(text: str) -> int:
    """How deeply `text` nests arrays and objects, counted without recursing (brackets inside
    strings do not count; an unterminated string's do, which only matters for invalid JSON)."""
    codes = np.frombuffer(_STRING.sub('""', text).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    opens = (codes == ord("[")) | (codes == ord("{"))
    brackets = opens | (codes == ord("]")) | (codes == ord("}"))
    steps = opens[brackets].astype(np.int8) * np.int8(2) - np.int8(1)  # +1 open, -1 close
    depth = peak = 0
    for start in range(0, steps.size, _DEPTH_CHUNK):  # chunks keep the running sum's memory small
        run = np.cumsum(steps[start:start + _DEPTH_CHUNK], dtype=np.int64) + depth
        peak, depth = max(peak, int(run.max())), int(run[-1])
    return peak


def _unique_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_json(raw: bytes | str, where: str, error=ConfigError, fix: str = "fix it", limit: int = MAX_JSON_BYTES):
    """Any JSON value from UTF-8 bytes or text (at most `limit` bytes), or `error` naming `where`,
    the bound and `fix`."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{where} is not UTF-8 (byte {exc.start}); {fix}") from None
    if len(raw) > limit:
        raise error(f"{where} is {len(raw)} characters, past the {limit}-byte bound for JSON; {fix}")
    depth = nesting_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise error(f"{where} is not valid JSON for memra (nested {depth} levels deep, past the bound of "
                    f"{MAX_JSON_DEPTH}); {fix}")
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys)
    except RecursionError:  # the depth bound keeps this out; kept so no caller ever sees one
        raise error(f"{where} is not valid JSON for memra (nested too deeply); {fix}") from None
    except ValueError as exc:  # JSONDecodeError, a duplicate key, an integer past 4300 digits
        raise error(f"{where} is not valid JSON ({str(exc)[:160]}); {fix}") from None


def read_small_file(path, limit: int, what: str, error=ConfigError, fix: str = "fix or re-export it",
                    io_error=None) -> bytes | None:
    """The bytes of file `path` (None when it does not exist), or `error` (`io_error` for what the
    file system says) naming it: not a regular file (a FIFO or a device would block or never end),
    unreadable, or past `limit` bytes (`what` names the kind of file in that message)."""
    path = os.fspath(path)
    io_error = io_error or error
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise io_error(f"cannot read {path} ({exc.strerror or exc}); {fix}") from None
    if not stat.S_ISREG(info.st_mode):
        raise io_error(f"{path} is not a regular file; {fix}")
    if info.st_size > limit:
        raise error(f"{path} is {info.st_size} bytes, past the {limit}-byte bound for {what}; {fix}")
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)  # the file may have grown since the stat
    except OSError as exc:
        raise io_error(f"cannot read {path} ({exc.strerror or exc}); {fix}") from None
    if len(raw) > limit:
        raise error(f"{path} is past the {limit}-byte bound for {what}; {fix}")
    return raw


def read_json_object(path, error=ConfigError, fix: str = "fix or re-export it", absent=None,
                     io_error=None) -> dict:
    """The JSON object in file `path`. `absent` (e.g. {}) is returned when the file does not
    exist; otherwise a missing, unreadable (`io_error`, default `error`), oversized, non-regular,
    non-UTF-8, too deeply nested, malformed or non-object file raises `error` naming it."""
    raw = read_small_file(path, MAX_JSON_BYTES, "a JSON file", error, fix, io_error)
    if raw is None:
        if absent is not None:
            return absent
        raise (io_error or error)(f"{os.fspath(path)} does not exist; {fix}")
    value = parse_json(raw, os.fspath(path), error, fix)
    if not isinstance(value, dict):
        raise error(f"{path} must hold a JSON object, got {type(value).__name__}; {fix}")
    return value
