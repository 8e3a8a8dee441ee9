"""Every refusal of `python -m memra.run` is ONE stderr line `memra: <problem and fix>`, exit status 2, and
no traceback (unless --debug asks for one). The flag refusals run on a small random checkpoint
(byte-level vocab 256, context 4096, prompt TEXT_PROMPT of 19 tokens unless a case gives its own)."""

import json
import shutil

import pytest
from cli_helpers import run_cli, run_on

from memra.checkpoint import write_fixture
from memra.config import preset


@pytest.fixture(scope="module")
def ckpt(fixture_dir):
    return fixture_dir("small")


@pytest.fixture(scope="module")
def no_mtp(no_mtp_dir):
    return no_mtp_dir


CASES = [
    # (flags, a piece of the message)
    (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature -1: must be a finite number >= 0"),
    (["--temperature", "1e-9"], "--temperature=1e-09: must be 0 (greedy) or"),  # SamplingParams' own bound
    (["--top-k", "x"], "--top-k 'x': expected an integer"),
    (["--min-p", "1"], "--min-p 1: must be in [0, 1)"),
    (["--seed", "-3"], "--seed -3: must be an integer in [0, 2^64)"),
    (["--max-new-tokens", "-1"], "--max-new-tokens -1: must be an integer >= 0"),
    (["--num-draft-tokens", "15"], "--num-draft-tokens 15: must be in 1..14"),
    (["--p-min", "2"], "--p-min 2: must be in [0, 1]"),
    (["--backend", "tpu"], "argument --backend: invalid choice"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--prompt", "a", "--prompt-ids", "1,2"], "not allowed with argument"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--draft-option", "novalue"], "--draft-option takes KEY=VALUE"),
    (["--eos", "3", "--ignore-eos"], "--eos and --ignore-eos contradict"),
    (["--p-min0"], "give --p-min P > 0 too"),
    (["--draft", "none", "--num-draft-tokens", "3"], "--num-draft-tokens is for speculative decoding"),
    (["--draft", "nope"], "unknown draft source 'nope'"),
    (["--draft-option", "bogus=1"], "native-mtp: unknown options ['bogus']"),
    (["--draft-option", "d2t=[0,999]"], "the trim was made for another vocabulary"),  # draft/target mismatch
    (["--eos", "300"], "EOS id 300 is outside the vocab 0..255"),
    (["--prompt-ids", "1,999"], "prompt token id 999 is outside the vocab 0..255"),
    (["--prompt-ids", "7"], "speculative decoding needs a prompt of at least 2 tokens"),
    (["--prompt", "x" * 4090], "the prompt is 4090 tokens and the context is 4096"),
    (["--max-ctx", "30"], "raise --max-ctx to at least 42"),
    (["--max-ctx", "5000"], "--max-ctx 5000 is past the model's max_position_embeddings (4096)"),
    (["--prompt-file", "/no/such/file"], "--prompt-file /no/such/file: cannot read it"),
    (["--ranks", "--gpus", "2"], "--ranks runs one stage per process"),
    (["--ranks", "--backend", "numpy"], "start one process per GPU with torchrun"),  # no launcher here
    (["--backend", "cuda"], None),  # refused on a machine without a GPU (skipped where one is usable)
    (["--draft", "none", "--top-p", "0.5"], "--top-p is for sampled decoding, and this run is greedy"),
    (["--seed", "5", "--min-p", "0.1"], "--min-p and --seed are for sampled decoding"),
    (["--draft-option", "d2t=null", "--draft-option", "d2t=null"], "--draft-option d2t is given twice"),
]


@pytest.mark.parametrize("flags, message", CASES, ids=lambda v: " ".join(v)[:40] if isinstance(v, list) else None)
def test_each_refusal_is_one_line_and_exit_2(ckpt, flags, message):
    if flags == ["--backend", "cuda"]:
        from memra.backend import cuda_available

        if cuda_available():
            pytest.skip("a CUDA GPU is usable here")
        message = "backend='cuda' needs CuPy, cuda-bindings and a CUDA GPU"
    proc = run_on(ckpt, *flags, "-n", 2)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.startswith("memra: ") and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_debug_shows_the_traceback(ckpt):
    proc = run_on(ckpt, "--draft", "nope", "--debug")
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "unknown draft source" in proc.stderr


def test_missing_checkpoint(tmp_path):
    proc = run_cli("--checkpoint", tmp_path / "nope")
    assert proc.returncode == 2 and "no such directory" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("--checkpoint", empty, "--prompt-ids", "1,2")
    assert proc.returncode == 2 and "no config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_corrupt_checkpoint(tmp_path):
    path = write_fixture(tmp_path / "ckpt", preset("small"), seed=2)
    weights = tmp_path / "ckpt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    proc = run_cli("--checkpoint", path, "--prompt-ids", "1,2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.startswith("memra: ")
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    proc = run_cli("--checkpoint", path, "--prompt-ids", "1,2")
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr


def test_checkpoint_needs_a_prompt_and_native_mtp_needs_an_mtp_block(no_mtp):
    proc = run_cli("--checkpoint", no_mtp)
    assert proc.returncode == 2 and "no prompt: give --prompt TEXT" in proc.stderr
    proc = run_cli("--checkpoint", no_mtp, "--prompt", "hi", "--draft", "native-mtp")
    assert proc.returncode == 2 and "native-mtp needs the checkpoint's NextN/MTP block" in proc.stderr


def test_bad_generation_config(no_mtp, tmp_path):
    path = shutil.copytree(no_mtp, tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    proc = run_cli("--checkpoint", path, "--prompt", "hi")
    assert proc.returncode == 2 and "eos_token_id must be an integer" in proc.stderr
    (path / "generation_config.json").write_text("[1,")
    proc = run_cli("--checkpoint", path, "--prompt", "hi")
    assert proc.returncode == 2 and "generation_config.json is not valid JSON" in proc.stderr


# refused as the command line is parsed (in process: no model is loaded)
PARSE_CASES = [
    (["--prompt=--"], ["--prompt: '--' cannot be given as a flag's value"]),  # argparse would hand it []
    (["-n--"], ["-n: '--' cannot be given"]),
    (["--gpus=--", "--prompt", "x"], ["--gpus: '--' cannot be given"]),
    (["--plan", "--draft", "native-mtp"], ["--plan does not use --draft: drop it"]),
    (["--plan", "--prompt", "x", "-n", "3"], ["--plan does not use", "--prompt", "--max-new-tokens", "drop them"]),
    (["--list-drafters", "--json"], ["--list-drafters does not use --json"]),
    (["--plan", "--preset", "small", "--checkpoint", "x"], ["--preset plans a named config", "give one"]),
]


@pytest.mark.parametrize("argv, needles", PARSE_CASES, ids=lambda v: " ".join(v)[:40] if isinstance(v, list)
                         and v and v[0].startswith("-") else None)
def test_a_flag_the_run_would_drop_or_misread_is_refused(argv, needles, capsys):
    from memra.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("memra: ") and err.count("\n") == 1 and all(n in err for n in needles), err


def test_generation_config_asking_for_a_penalty_gets_a_note(ckpt, tmp_path):
    path = shutil.copytree(ckpt, tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False, "repetition_penalty": 1.3}))
    proc = run_on(path, "--draft", "none", "-n", "2")
    assert proc.returncode == 0, proc.stderr
    assert "generation_config.json asks for repetition_penalty 1.3, which memra does not apply" in proc.stderr
