"""bench_sampled on CPU (small preset, numpy): ONE JSON line of positive times for every arm,
and the README table renders it.

No __init__.py in this folder: one would make `benchmarks` name this folder, not the scripts'.
"""

from __future__ import annotations

import json

from benchmarks import bench_sampled, readme_table

ARGS = ["--preset", "small", "--backend", "numpy", "--git-sha", "test", "--context", "16", "--steps", "3",
        "--reps", "2", "--top-k", "20", "--rows", "4"]


def test_bench_sampled_prints_one_json_line_that_the_readme_table_renders(capsys, tmp_path):
    assert bench_sampled.main(ARGS + ["--out", str(tmp_path / "r.json")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["bench"] == "bench_sampled" and record["config"]["sampling"]["top_k"] == 20
    assert set(record["plain_ms_per_token"]) == {"greedy", "sampled", "sampled_host_filter"}
    assert all(v > 0 for v in [*record["plain_ms_per_token"].values(), *record["accept_ms"].values()])
    assert readme_table.main([str(tmp_path / "r.json")]) == 0
    table = capsys.readouterr().out
    assert "| ms |" in table and "accept of 4 rows" in table and "top_k 20" in table
