"""bench_accept on CPU (the shipped demo model, numpy): ONE JSON line, greedy tapes identical to
plain, per-position tallies that add up; the loop detector; and bench_spec's measured profiles."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import bench_accept, bench_spec
from benchmarks.heldout import heldout_files, is_looping

ARGS = ["--backend", "numpy", "--git-sha", "test", "--prompts", "2", "--prompt-tokens", "32",
        "--new-tokens", "12", "--ks", "1,3", "--modes", "greedy,sampled"]


def test_bench_accept_prints_one_record_with_consistent_tallies(capsys):
    if not heldout_files():
        pytest.skip("no held-out file of the manifest is in this interpreter's stdlib")
    assert bench_accept.main(ARGS) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["bench"] == "bench_accept" and rec["greedy_identical_to_plain"] and rec["mismatches"] == []
    got = {(r["source"], r["mode"], r["k"]) for r in rec["results"]}
    assert got == {(s, m, k) for s in ("native-mtp", "dflash2") for m in ("greedy", "sampled") for k in (1, 3)}
    for r in rec["results"]:
        assert len(r["per_position"]) == r["k"]
        if r["rounds_with_drafts"]:
            # accepted drafts = the sum over positions; the mean length is 1 + accepted / rounds
            assert r["accepted"] == round(sum(r["per_position"]) * r["rounds_with_drafts"])
            assert r["mean_acceptance_length"] == pytest.approx(1 + r["accepted"] / r["rounds_with_drafts"])
            assert all(a >= b for a, b in zip(r["per_position"], r["per_position"][1:]))


def test_a_periodic_second_half_is_a_loop_and_code_is_not():
    assert is_looping([5, 6, 7, 8] + [1, 2, 3] * 6)
    assert is_looping(list(range(10)) + [9] * 10)
    assert not is_looping(list(range(40)))


def test_a_profile_gives_the_expected_tokens_of_its_conditional_rates():
    assert bench_spec.expected_tokens(1.0, 3) == 4.0
    assert bench_spec.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert bench_spec.expected_tokens([0.8, 0.5, 0.0], 3) == pytest.approx(1 + 0.8 + 0.4)


def test_a_profiled_tape_source_accepts_at_the_profiled_rates():
    tape = list(range(200))
    source = bench_spec.TapeSource(tape, [1.0, 0.0], vocab=256, seed=0)
    state = source.begin(type("Start", (), {"anchor": 0})())
    drafts = state.propose(2).tokens
    assert drafts[0] == tape[1] and drafts[1] != tape[2]  # position 1 always survives, position 2 never


def test_profile_points_take_the_greedy_results_of_sources_it_can_cost(tmp_path):
    record = {"results": [
        {"source": "native-mtp", "mode": "greedy", "k": 3, "conditional": [0.6, 0.5, None]},
        {"source": "native-mtp", "mode": "sampled", "k": 3, "conditional": [0.6, 0.5, 0.4]},
        {"source": "ngram", "mode": "greedy", "k": 3, "conditional": [0.9, 0.9, 0.9]},
        {"source": "dflash2", "mode": "greedy", "k": 5, "conditional": [0.5] * 5},
    ]}
    path = tmp_path / "accept.json"
    path.write_text(json.dumps(record) + "\n")
    assert bench_spec.profile_points(str(path), [1, 3]) == [("native-mtp", 3, [0.6, 0.5, 0.0])]
    assert np.isclose(bench_spec.expected_tokens([0.6, 0.5, 0.0], 3), 1.9)
