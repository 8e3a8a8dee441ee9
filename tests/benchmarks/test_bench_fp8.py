"""bench_fp8: on the GPU host, ONE JSON line with every op timed in both dtypes (the tests' small
sizes); anywhere, the README table renders such a record.

No __init__.py in this folder: one would make `benchmarks` name this folder, not the scripts'.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import readme_table


def _record(ops: dict) -> dict:
    return {"bench": "bench_fp8", "git_sha": "test", "date": "2026-12-02", "device": "cpu", "config": {}, "ops": ops}


def test_the_readme_table_renders_a_bench_fp8_record(capsys, tmp_path):
    entry = {"ms": 0.05, "bytes": 16 << 20, "roof_ms": 0.004, "of_roof": 12.5}
    ops = {"proj_4096x4096_t1_fp8": entry | {"fp8_over_bf16": 0.8}, "proj_4096x4096_t1_bf16": entry}
    (tmp_path / "r.json").write_text(json.dumps(_record(ops)))
    assert readme_table.main([str(tmp_path / "r.json")]) == 0
    table = capsys.readouterr().out
    assert "| proj_4096x4096 | 1 | 50 us | 12.50x | 50 us | 0.80x |" in table


@pytest.mark.gpu
def test_bench_fp8_prints_one_json_line_with_both_dtypes(capsys, tmp_path):
    from tests.gpu import cupy_or_skip

    cupy_or_skip()
    from benchmarks import bench_fp8

    assert bench_fp8.main(["--git-sha", "test", "--sizes", "small", "--out", str(tmp_path / "r.json")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    ops = json.loads(lines[0])["ops"]
    assert {n.rsplit("_", 1)[1] for n in ops} == {"fp8", "bf16"} and len(ops) == 8
    assert all(v["ms"] > 0 and v["of_roof"] > 0 for v in ops.values())
    assert all(0 < v["fp8_over_bf16"] for n, v in ops.items() if n.endswith("_fp8"))
    assert readme_table.main([str(tmp_path / "r.json")]) == 0
