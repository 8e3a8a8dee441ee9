"""The whole-model benchmarks on CPU: the in-memory weights, the byte accounting, and
bench_decode / bench_verify printing ONE JSON line of positive numbers (small preset, numpy).

No __init__.py in this folder: one would make `benchmarks` name this folder, not the scripts'.
"""

from __future__ import annotations

import json
import math
import sys
import types

import numpy as np

from benchmarks import bench_decode, bench_verify, common
from benchmarks.common import bench_weights, build_model, counted_launches, prime_context
from benchmarks.walk_bytes import moe_layer_count, weight_bytes
from memra.backend.numpy_ref import NumpyBackend
from memra.checkpoint import expected_tensors, load_checkpoint, write_fixture
from memra.config import ModelConfig, preset
from memra.model.trunk import Glm5Model
from memra.safetensors_io import bf16_to_f32

SMALL = ModelConfig.from_dict(preset("small"))
COMMON = ["--preset", "small", "--backend", "numpy", "--git-sha", "test", "--context", "16", "--steps", "3"]


def test_weights_are_the_bf16_fixture_below_the_pool_threshold(tmp_path):
    fixture = load_checkpoint(write_fixture(tmp_path, preset("small"), seed=5, dtype="bfloat16"), SMALL, keep_bf16=True)
    built = bench_weights(SMALL, seed=5)
    assert list(built) == list(fixture)
    for name, arr in fixture.items():
        assert built[name].dtype == np.uint16 and np.array_equal(built[name], arr), name


def test_large_tensors_are_views_of_one_pool_and_the_model_runs_on_them(monkeypatch):
    monkeypatch.setattr(common, "POOL_ELEMENTS", 8192)  # smaller than the lm head: built from pieces
    weights = bench_weights(SMALL, seed=0, pooled_min=2048)
    large = {n: s for n, s in expected_tensors(SMALL).items() if math.prod(s) >= 2048}
    views = [n for n, s in large.items() if math.prod(s) <= 8192 and n != "embed_tokens.weight"]
    assert len(views) > 100 and len({id(weights[n].base) for n in views}) == 1
    assert all(weights[n].dtype == np.uint16 and weights[n].shape == s for n, s in large.items())
    head = bf16_to_f32(weights["lm_head.weight"])
    assert len(np.unique(head, axis=0)) == head.shape[0]  # rows stay distinct past the pool size
    assert 0.5 < bf16_to_f32(weights["embed_tokens.weight"]).std() < 2  # gathered, so unit scale
    model = Glm5Model(SMALL, weights, NumpyBackend())
    logits = model.prime([1, 2, 3, 4], model.new_cache(8))
    assert np.isfinite(logits).all() and 0.1 < logits.std() < 10


def test_weight_bytes_with_every_expert_is_every_trunk_tensor_once():
    model = build_model("small", "numpy")
    everything = weight_bytes(model, [SMALL.n_routed_experts] * moe_layer_count(model), rows=1)
    mtp = f"layers.{SMALL.num_hidden_layers}."
    trunk = sum(math.prod(s) for n, s in expected_tensors(SMALL).items()
                if not n.startswith(mtp) and n != "embed_tokens.weight")
    assert everything["total"] == 4 * (trunk + SMALL.hidden_size)  # numpy keeps float32; one embedding row
    picked = weight_bytes(model, [SMALL.num_experts_per_tok] * moe_layer_count(model), rows=1)
    expert = 3 * SMALL.moe_intermediate_size * SMALL.hidden_size * 4
    unpicked = SMALL.n_routed_experts - SMALL.num_experts_per_tok
    assert everything["total"] - picked["total"] == moe_layer_count(model) * unpicked * expert


def test_verify_times_leaves_the_cache_where_it_was_so_plain_decode_follows_the_tape():
    model = build_model("small", "numpy")
    cache, anchor = prime_context(model, 16, 32, seed=0)
    tape = bench_verify.greedy_tape(model, cache, anchor, 6)
    verify, rollback = common.verify_times(model, cache, tape, reps=2)
    assert len(verify) == len(rollback) == 2 and min(verify + rollback) > 0
    assert cache.pos == 16
    token = anchor
    for expected in tape[1:]:
        token = int(np.argmax(model.decode_step(token, cache)))
        assert token == expected


def test_counted_launches_counts_every_cuda_module_and_restores_them(monkeypatch):
    calls = []
    runtime = types.SimpleNamespace(launch=lambda family, name, *args: calls.append(name))
    dense = types.SimpleNamespace(launch=runtime.launch)
    monkeypatch.setitem(sys.modules, "memra.backend.cuda.runtime", runtime)
    monkeypatch.setitem(sys.modules, "memra.backend.cuda.dense", dense)
    with counted_launches() as counts:
        dense.launch("dense", "linear_bf16_t1", (1,), (256,), ())
        dense.launch("norm", "rmsnorm_rows", (1,), (256,), ())
        dense.launch("dense", "linear_bf16_t1", (1,), (256,), ())
    assert counts == {"dense.linear_bf16_t1": 2, "norm.rmsnorm_rows": 1}
    assert calls == ["linear_bf16_t1", "rmsnorm_rows", "linear_bf16_t1"]
    assert dense.launch is runtime.launch


def test_counted_launches_yields_none_without_kernels(monkeypatch):
    monkeypatch.delitem(sys.modules, "memra.backend.cuda.runtime", raising=False)
    with counted_launches() as counts:
        assert counts is None


def _record(capsys, main, argv) -> dict:
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, "stdout must be exactly one JSON line"
    record = json.loads(lines[0])
    assert record["config"]["preset"] == "small" and record["device"] == "cpu" and record["git_sha"] == "test"
    return record


def _positive(d: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(d[key], (int, float)) and d[key] > 0, (key, d[key])


def test_bench_decode_prints_one_json_line_of_positive_numbers(capsys):
    record = _record(capsys, bench_decode.main, [*COMMON, "--prompt-lens", "8,16"])
    assert record["bench"] == "bench_decode" and record["copy_bandwidth_gbs"] is None
    assert set(record["prefill"]) == {"prompt_8", "prompt_16"}
    for p in record["prefill"].values():
        _positive(p, "tokens", "ms", "tokens_per_s")
    d = record["decode"]
    _positive(d, "ms_per_step", "tokens_per_s", "weight_bytes_per_step", "state_bytes_per_step", "host_ms_per_step")
    assert d["weight_bytes"]["routed_experts"] > 0 and d["state_bytes"]["mla_latent"] > 0
    assert d["graph_replay"] is None and d["mode"] == "eager" and d["eager"]["ms_per_step"] == d["ms_per_step"]
    assert d["replay_gpu_ms"] is None  # numpy captures no graph
    assert d["launches_per_step"] is None and d["bandwidth_fraction"] is None  # numpy: no kernels, no roof


def test_bench_verify_prints_one_json_line_of_positive_numbers(capsys):
    record = _record(capsys, bench_verify.main, [*COMMON, "--rows", "1-3", "--reps", "2"])
    assert record["bench"] == "bench_verify"
    _positive(record, "decode_ms")
    assert list(record["verify"]) == ["t1", "t2", "t3"]
    for t, w in enumerate(record["verify"].values(), start=1):
        _positive(w, "verify_ms", "verify_rows_ms", "rollback_keep1_ms", "ratio_to_decode", "weight_bytes", "state_bytes")
        assert w["rows"] == t
        assert all(SMALL.num_experts_per_tok <= n <= min(SMALL.n_routed_experts, t * SMALL.num_experts_per_tok)
                   for n in w["distinct_experts_per_moe_layer"])
    by_t = [w["weight_bytes"] for w in record["verify"].values()]
    assert by_t == sorted(by_t)


def test_a_staged_benchmark_model_is_the_split_placement_with_the_one_stage_bits():
    """--gpus / --stage-layers build the model as load_model would (balanced by weight bytes),
    and its walks give the one-stage logits bit for bit; the byte accounting sees every layer."""
    one = build_model("small", "numpy")
    staged = build_model("small", "numpy", stages=2)
    by_hand = build_model("small", "numpy", stage_layers="0-1,2-5")
    assert staged.placement.describe() == "0-3,4-5" and by_hand.placement.describe() == "0-1,2-5"
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    logits = [m.prime(prompt, m.new_cache(16)) for m in (one, staged, by_hand)]
    assert all(np.array_equal(logits[0], other) for other in logits[1:])
    experts = [SMALL.num_experts_per_tok] * moe_layer_count(one)
    assert weight_bytes(staged, experts, rows=1) == weight_bytes(one, experts, rows=1)


def test_bench_decode_records_the_split_it_ran(capsys):
    record = _record(capsys, bench_decode.main, [*COMMON, "--prompt-lens", "8", "--gpus", "2"])
    assert record["config"]["stage_layers"] == "0-3,4-5" and record["config"]["stage_devices"] == [None, None]
    assert "stage_layers" not in _record(capsys, bench_decode.main, [*COMMON, "--prompt-lens", "8"])["config"]
    _positive(record["decode"], "ms_per_step", "weight_bytes_per_step")


def test_the_readme_table_shows_the_replay_gpu_time_where_a_record_has_it(capsys, tmp_path):
    from benchmarks import readme_table

    record = _record(capsys, bench_decode.main, [*COMMON, "--prompt-lens", "8"])
    record["decode"]["bandwidth_fraction"] = 0.5  # the README renders device records, which have a roof
    plain = readme_table.decode("r.json", record)
    record["decode"]["replay_gpu_ms"] = 4.0523
    timed = readme_table.decode("r.json", record)
    assert "replay alone" not in plain[2] and "replay alone" in timed[2]
    assert "| 4.052 |" in timed[4] and timed[4].startswith("| small | 16 |")
    assert all(row.count("|") == timed[2].count("|") for row in timed[2:5])  # header, rule, row agree
