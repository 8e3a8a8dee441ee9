"""bench_serve on CPU (small preset, numpy, a server in this process): ONE JSON line whose every
request made exactly the tokens asked for, the same tokens as memra.generate, with positive
times, and acceptance counters for the speculative setting only.

No __init__.py in this folder: one would make `benchmarks` name this folder, not the scripts'.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from benchmarks import bench_serve  # noqa: E402

MAX_TOKENS, REQUESTS, CONCURRENCY = 6, 2, 2
ARGS = ["--preset", "small", "--backend", "numpy", "--git-sha", "test", "--prompt-len", "8",
        "--max-tokens", str(MAX_TOKENS), "--requests", str(REQUESTS), "--concurrency", str(CONCURRENCY)]


def test_bench_serve_prints_one_json_line_with_both_settings_measured(capsys, tmp_path):
    out = tmp_path / "serve.json"
    assert bench_serve.main(ARGS + ["--out", str(out)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1 and out.read_text().strip() == lines[0]
    assert "bench_serve small" in captured.err
    record = json.loads(lines[0])
    assert record["bench"] == "bench_serve" and record["git_sha"] == "test" and record["device"]
    assert set(record["runs"]) == {"none", "native-mtp"}
    for name, run in record["runs"].items():
        direct, seq, conc = run["direct"], run["sequential"], run["concurrent"]
        assert run["tokens_match_direct"] is True, name
        assert direct["tokens_per_request"] == seq["tokens_per_request"] == [MAX_TOKENS] * REQUESTS
        assert conc["tokens_per_request"] == [MAX_TOKENS] * CONCURRENCY and conc["tokens"] == MAX_TOKENS * CONCURRENCY
        for value in (direct["ttft_ms_median"], direct["decode_tokens_per_s_median"], seq["ttft_ms_median"],
                      seq["decode_tokens_per_s_median"], conc["wall_s"], conc["tokens_per_s"],
                      conc["ttft_ms_median"], run["server_over_direct"]):
            assert value > 0, name
        assert len(seq["ttft_ms"]) == REQUESTS and all(v > 0 for v in seq["decode_tokens_per_s"])
    assert record["runs"]["none"]["acceptance"] is None and record["runs"]["none"]["k"] is None
    accept = record["runs"]["native-mtp"]["acceptance"]
    assert record["runs"]["native-mtp"]["k"] == 4
    assert accept["num_drafts"] > 0 and accept["num_draft_tokens"] >= accept["num_drafts"]
    assert 1.0 <= accept["mean_acceptance_length"] <= 5.0
    assert accept["direct_mean_acceptance_length"] == accept["mean_acceptance_length"]  # same tokens, same rounds


def test_an_unknown_draft_setting_is_refused_before_anything_is_served():
    from memra.errors import InputError

    with pytest.raises(InputError, match="unknown draft source 'no-such-source'"):
        bench_serve.main(ARGS + ["--draft", "none,no-such-source"])
