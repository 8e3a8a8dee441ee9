"""`python -m memra.run`: the main job prints one JSON record; refusals exit 2 without a traceback."""

import json
import subprocess
import sys

import numpy as np

from memra import load_model
from memra.generate import greedy
from memra.run import main


def test_demo_generates_greedy_tokens(tmp_path, capsys):
    assert main(["--demo-dir", str(tmp_path), "--max-new-tokens", "6", "--backend", "numpy"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(record["tokens"]) == 6 and record["backend"] == "numpy"
    model = load_model(tmp_path / "small-seed0", backend="numpy")
    assert record["tokens"] == greedy(model, record["prompt_ids"], 6)


def test_greedy_takes_the_argmax_each_step(fixture_dir):
    model = load_model(fixture_dir("mini"), backend="numpy")
    out = greedy(model, [1, 2, 3], 5)
    cache = model.new_cache(8)
    logits = model.prime([1, 2, 3], cache)
    for tok in out:
        assert tok == int(np.argmax(logits))
        logits = model.decode_step(tok, cache)


def test_refusal_prints_message_and_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "memra.run", "--demo-dir", str(tmp_path), "--backend", "numpy",
         "--prompt-ids", "1,999", "--max-new-tokens", "2"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert "outside the vocab" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_model_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--backend", "numpy"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_speculative_cli_prints_the_plain_tokens_and_stats(tmp_path, capsys):
    args = ["--demo-dir", str(tmp_path), "--max-new-tokens", "8", "--backend", "numpy"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args + ["--draft", "native-mtp", "--num-draft-tokens", "3"]) == 0
    spec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert spec["tokens"] == plain["tokens"]
    assert spec["stats"]["num_draft_tokens"] > 0 and "mean_acceptance_length" in spec["stats"]


def test_unknown_draft_source_and_bad_k_are_clear_errors(tmp_path, capsys):
    base = ["--demo-dir", str(tmp_path), "--backend", "numpy", "--max-new-tokens", "4"]
    assert main(base + ["--draft", "nope"]) == 2
    assert "unknown draft source" in capsys.readouterr().err
    assert main(base + ["--draft", "native-mtp", "--num-draft-tokens", "15"]) == 2
    assert "outside 1..=14" in capsys.readouterr().err


def test_sampling_flags_reach_generate_and_are_reproducible(tmp_path, capsys):
    args = ["--demo-dir", str(tmp_path), "--backend", "numpy", "--max-new-tokens", "6",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "5"]
    runs = []
    for _ in range(2):
        assert main(args + ["--draft", "native-mtp", "--num-draft-tokens", "2"]) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"])
    assert runs[0] == runs[1] and len(runs[0]) == 6
    assert main(args + ["--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_draft_option_must_be_key_value(tmp_path, capsys):
    base = ["--demo-dir", str(tmp_path), "--backend", "numpy", "--draft", "native-mtp"]
    assert main(base + ["--draft-option", "novalue"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert main(base + ["--draft-option", "bogus=1"]) == 2
    assert "unknown options" in capsys.readouterr().err
