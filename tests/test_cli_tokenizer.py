"""Text at the edge: a tokenizer.json built here with `tokenizers` round-trips through the CLI; the
byte-level fallback; streaming that never splits a multi-byte character; generation_config.json
defaults; tokenizer refusals."""

import json
import os
import shutil

import pytest
from cli_helpers import as_printed, ok_json, run_cli, streamed
from hypothesis import given, settings
from hypothesis import strategies as st

from memra.checkpoint import write_fixture
from memra.config import preset
from memra.errors import CheckpointError
from memra.tokenizer import ByteTokenizer, HFTokenizer, TextStream, load_tokenizer

CORPUS = [("Grüße aus Köln! naïve café, 日本語のテキスト, emoji 🙂🚀 and plain ASCII words: "
           "the quick brown fox jumps over the lazy dog; 0123456789 (){}[] <>=+-*/ #$%&@ ~^_|\\ \"'` ?!.,:;\n\t")] * 30
TEXT = "Grüße, naïve 日本 🙂 fox"


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                                        show_progress=False))
    return tok


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(256)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer):
    """The `small` preset (vocab 256) with the tokenizer.json trained above."""
    path = tmp_path_factory.mktemp("tok-ckpt")
    write_fixture(path, preset("small"), seed=13)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def test_the_test_tokenizer_fits_the_vocab_and_splits_characters_into_bytes(tokenizer):
    assert tokenizer.get_vocab_size() <= 256
    assert tokenizer.decode(tokenizer.encode(TEXT).ids) == TEXT
    assert len(tokenizer.encode("🙂").ids) > 1  # a multi-byte character spans tokens


def test_prompt_text_round_trips_through_the_cli(ckpt, tokenizer):
    ids = tokenizer.encode(TEXT).ids
    proc = run_cli("--checkpoint", ckpt, "--prompt", TEXT, "-n", 24, "--json", "--draft", "none", "--ignore-eos")
    rec = ok_json(proc)
    assert rec["prompt_tokens"] == len(ids)
    assert streamed(proc) == as_printed(tokenizer.decode(rec["tokens"]))
    by_ids = ok_json(run_cli("--checkpoint", ckpt, "--prompt-ids", ",".join(map(str, ids)), "-n", 24, "--json",
                             "--ignore-eos"))
    assert by_ids["tokens"] == rec["tokens"] and by_ids["draft"] == "native-mtp"  # default: the model has MTP


def test_generation_config_sets_eos_and_default_sampling_and_flags_override(ckpt, tmp_path):
    path = shutil.copytree(ckpt, tmp_path / "ckpt")
    tape = ok_json(run_cli("--checkpoint", path, "--prompt", TEXT, "-n", 12, "--json", "--ignore-eos"))["tokens"]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tape[2]]}))
    cut = ok_json(run_cli("--checkpoint", path, "--prompt", TEXT, "-n", 12, "--json"))
    assert cut["tokens"] == tape[:tape.index(tape[2]) + 1] and cut["seed"] is None
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.9}))
    proc = run_cli("--checkpoint", path, "--prompt", TEXT, "-n", 12, "--json", "--seed", 3)
    assert ok_json(proc)["seed"] == 3 and "temperature 0.7, top-k 50, top-p 0.9" in proc.stderr
    forced = run_cli("--checkpoint", path, "--prompt", TEXT, "-n", 12, "--json", "--temperature", 0)
    assert ok_json(forced)["tokens"] == tape and "greedy" in forced.stderr


def test_a_tokenizer_for_a_bigger_vocab_is_refused(tmp_path, tokenizer):
    path = write_fixture(tmp_path / "mini", preset("mini"), seed=0)  # vocab 32
    tokenizer.save(str(tmp_path / "mini" / "tokenizer.json"))
    proc = run_cli("--checkpoint", path, "--prompt", "hi")
    assert proc.returncode == 2 and "but the model's vocab is 32" in proc.stderr and "Traceback" not in proc.stderr


def test_a_corrupt_tokenizer_is_refused(tmp_path):
    path = write_fixture(tmp_path / "ckpt", preset("small"), seed=0)
    (tmp_path / "ckpt" / "tokenizer.json").write_text('{"model": 3}')
    proc = run_cli("--checkpoint", path, "--prompt", "hi")
    assert proc.returncode == 2 and "could not be read as a tokenizer" in proc.stderr


def test_no_tokenizer_and_no_byte_vocab_means_ids_only(tmp_path):
    path = write_fixture(tmp_path / "mini", preset("mini"), seed=0)
    assert load_tokenizer(path, 32) is None
    proc = run_cli("--checkpoint", path, "--prompt", "hi")
    assert proc.returncode == 2 and "use --prompt-ids" in proc.stderr
    proc = run_cli("--checkpoint", path, "--prompt-ids", "1,2,3", "-n", 5, "--json", "--ignore-eos")
    rec = ok_json(proc)
    assert streamed(proc) == " ".join(map(str, rec["tokens"])) + " \n"


def test_the_byte_level_fallback_is_for_256_vocabs_only(tmp_path):
    assert isinstance(load_tokenizer(tmp_path, 256), ByteTokenizer)
    assert ByteTokenizer().decode(ByteTokenizer().encode(TEXT)) == TEXT


# ---- streaming -------------------------------------------------------------------------------------------
def _stream(decode, prompt, ids, cuts):
    stream, out, start = TextStream(decode, prompt), [], 0
    for cut in sorted(set(cuts)) + [len(ids)]:
        out.append(stream.push(ids[start:cut]))
        start = max(start, cut)
    return out, "".join(out) + stream.finish()


def test_a_character_cut_between_tokens_is_held_until_complete():
    smile = list("🙂".encode())
    byte = ByteTokenizer()
    pieces, text = _stream(byte.decode, [], list(b"ok ") + smile + list(b"!"), [3, 4, 5, 6, 7])
    assert pieces == ["ok ", "", "", "", "🙂", "!"] and text == "ok 🙂!"
    # a character that never completes is printed as U+FFFD at the end, not lost
    assert _stream(byte.decode, [], list(b"a") + smile[:2], [1])[1] == "a\ufffd"


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40), st.lists(st.integers(0, 40), max_size=8), st.binary(max_size=6))
def test_byte_stream_equals_the_whole_decode(data, cuts, prompt):
    byte = ByteTokenizer()
    assert _stream(byte.decode, list(prompt), list(data), cuts)[1] == data.decode("utf-8", errors="replace")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=40), st.lists(st.integers(0, 40), max_size=8))
def test_bpe_stream_equals_the_whole_decode(tmp_path_factory, ids, cuts):
    path = tmp_path_factory.getbasetemp() / "stream-tokenizer.json"
    if not path.exists():
        build_tokenizer(256).save(str(path))
    tok = HFTokenizer(str(path), 256)
    prompt = tok.encode("fox ")
    assert _stream(tok.decode, prompt, ids, cuts)[1] == tok.decode(ids)


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "not-utf8"])
def test_a_tokenizer_json_that_is_no_readable_file_is_refused_not_waited_on(tmp_path, kind):
    """A FIFO would block the load forever and /dev/zero would fill the memory."""
    path = tmp_path / "tokenizer.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b'{"model": "\xff"}')
    with pytest.raises(CheckpointError, match="not a regular file" if kind != "not-utf8" else "could not be read"):
        load_tokenizer(tmp_path, 256)
