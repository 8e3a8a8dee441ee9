"""step_blocks on CPU: the block bytes add up to the walk's weight bytes, a profiled timeline is
cut where each site's combine ends, and on numpy the script prints ONE JSON line saying why it
holds no blocks; the README's table renders the records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import readme_table, step_blocks
from benchmarks.common import build_model
from benchmarks.walk_bytes import block_bytes, moe_layer_count, weight_bytes
from memra.limits import PRIME_CHUNK


def test_block_bytes_add_up_to_the_walk_and_follow_its_layers():
    model = build_model("small", "numpy")
    k = model.cfg.num_experts_per_tok
    blocks = block_bytes(model, k)
    walk = weight_bytes(model, [k] * moe_layer_count(model), rows=1)
    assert sum(nbytes for _, nbytes in blocks) + walk["embedding_rows"] == walk["total"]
    assert len(blocks) == 2 * len(model.layers) + 1 and blocks[-1][0] == "head"
    kinds = {"linear_attention": "kda attention", "indexed_attention": "mla attention"}
    assert [kind for kind, _ in blocks[:-1:2]] == [kinds[kind] for kind in model.cfg.layer_types]
    assert [kind for kind, _ in blocks[1::2]] == [
        "dense ffn" if kind == "dense" else "moe ffn" for kind in model.cfg.mlp_layer_types]
    fewer = block_bytes(model, k - 1)  # one routed expert less: only the MoE blocks shrink
    assert [a - b for (_, a), (_, b) in zip(blocks, fewer)] == [
        walk["routed_experts"] // (k * moe_layer_count(model)) if kind == "moe ffn" else 0 for kind, _ in blocks]


def test_a_timeline_is_cut_at_each_site_combine_per_replay():
    one = [("embed_f32", 0, 3), ("hc_partials_r1", 3, 5), ("hc_weights", 4, 20), ("linear_group", 5, 30),
           ("hc_combine", 29, 32), ("moe_gate_up", 31, 60), ("hc_combine", 60, 61), ("head_linear", 61, 90)]
    two = [(name, start + 100, end + 100) for name, start, end in one]
    assert step_blocks.block_us(one + two, 2) == [[32, 29, 29], [32, 29, 29]]
    with pytest.raises(AssertionError, match="do not split"):
        step_blocks.block_us(one + two[:-1], 2)


def test_a_blocks_busy_time_is_what_its_kernels_cover():
    """Kernels clipped to each block and their overlaps counted once: block 0 [0, 32) is covered
    but for the gap 20..25; block 1 [32, 61) wholly, by the rest of a kernel that started in
    block 0 and those after it; the head by its one kernel."""
    kernels = [("embed_f32", 0, 3), ("linear_group", 3, 10), ("hc_weights", 4, 20), ("x", 25, 40),
               ("hc_combine", 29, 32), ("moe_gate_up", 40, 60), ("hc_combine", 60, 61), ("head_linear", 61, 90)]
    edges = step_blocks.block_edges(kernels)
    assert edges == [0, 32, 61, 90]
    assert step_blocks.block_busy_us(kernels, edges) == [27, 29, 29]


def test_kinds_hold_each_block_against_its_copy_time():
    blocks = [("kda attention", 2000), ("moe ffn", 6000), ("kda attention", 2000), ("head", 1000)]
    kinds = step_blocks.by_kind(blocks, [4.0, 6.0, 2.0, 1.0], roof_gbs=1.0)  # 1 GB/s: 1000 bytes a us
    assert kinds["kda attention"] == {"count": 2, "us_each": 3.0, "bytes_each": 2000, "copy_us_each": 2.0,
                                      "of_copy_bw": pytest.approx(2 / 3), "us_past_copy": 2.0}
    assert kinds["moe ffn"]["of_copy_bw"] == 1.0 and kinds["head"]["us_past_copy"] == 0.0


def test_on_numpy_it_prints_one_json_line_without_blocks(capsys):
    assert step_blocks.main(["--preset", "small", "--backend", "numpy", "--git-sha", "test", "--context", "8"]) == 0
    out = capsys.readouterr()
    record = json.loads(out.out)
    assert out.out.count("\n") == 1 and record["bench"] == "step_blocks"
    assert record["blocks"] is None and "CUDA graphs" in record["why"] and "no blocks" in out.err


def test_the_readme_table_renders_the_committed_records_and_a_blockless_one(capsys, tmp_path):
    paths = sorted(Path(__file__).resolve().parents[2].glob("benchmarks/results/step_blocks-*.json"))
    assert paths
    step_blocks.main(["--preset", "small", "--backend", "numpy", "--git-sha", "test", "--context", "8",
                      "--out", str(tmp_path / "r.json")])
    capsys.readouterr()
    assert readme_table.main([*map(str, paths), str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("| moe ffn |") == len(paths) and "No blocks: no captured decode step" in out


def test_a_prompt_on_numpy_holds_no_blocks_and_says_why(capsys):
    assert step_blocks.main(["--preset", "small", "--backend", "numpy", "--git-sha", "test", "--prompt", "20"]) == 0
    out = capsys.readouterr()
    record = json.loads(out.out)
    assert out.out.count("\n") == 1 and record["config"]["prompt"] == 20
    assert record["blocks"] is None and "no GPU kernels recorded" in record["why"]


def test_the_readme_table_renders_a_primes_blocks(capsys, tmp_path):
    record = {"bench": "step_blocks", "git_sha": "abc1234", "date": "2026-12-04", "device": "GPU",
              "config": {"preset": "bench", "prompt": 4096}, "prompt": 4096, "prime_ms": 305.0,
              "profiled_span_us": 300000.0, "busy_us": 280000.0,
              "kinds": {"moe ffn": {"count": 11, "us_each": 12000.0, "busy_us_each": 11000.0, "share": 0.44}},
              "blocks": [{"kind": "moe ffn", "us": 12000.0, "busy_us": 11000.0}] * 11}
    (tmp_path / "p.json").write_text(json.dumps(record))
    assert readme_table.main([str(tmp_path / "p.json")]) == 0
    assert "| moe ffn | 11 | 12.00 | 11.00 | 44.0% |" in capsys.readouterr().out


@pytest.mark.parametrize("prompt", ["0", str(PRIME_CHUNK + 1)])
def test_a_prompt_outside_one_walk_is_refused(capsys, prompt):
    with pytest.raises(SystemExit) as exit_:
        step_blocks.main(["--preset", "small", "--backend", "numpy", "--git-sha", "test", "--prompt", prompt])
    assert exit_.value.code == 2 and f"a prime of 1 to {PRIME_CHUNK} tokens" in capsys.readouterr().err


@pytest.mark.parametrize("staged", [["--gpus", "2"], ["--stage-layers", "0-2,3-5"]])
def test_a_pipeline_is_refused_by_name(staged, capsys):
    with pytest.raises(SystemExit) as exit_:
        step_blocks.main(["--preset", "small", "--backend", "numpy", "--git-sha", "test", *staged])
    assert exit_.value.code == 2 and "a pipeline's stages are not cut into blocks" in capsys.readouterr().err
