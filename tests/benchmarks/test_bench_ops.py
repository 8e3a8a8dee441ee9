"""bench_ops' bookkeeping on CPU: ratios pair graph time with graph time and call time with call
time, a refused capture gives a reason instead of a number, every decode op runs on the numpy
backend (small preset) with the bytes it must move, and the README table renders new records and
every committed one. The GPU timers are stood in for.
No __init__.py in this folder: one would make `benchmarks` name this folder, not the scripts'.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import bench_ops_decode
from benchmarks.bench_ops_decode import DECODE_ROWS, bench_decode_ops, bench_layer, decode_ops
from benchmarks.op_timing import op_card, op_entry, timed
from benchmarks.readme_table import ops as ops_table
from memra.backend.numpy_ref import NumpyBackend
from memra.config import ModelConfig, preset

SMALL = ModelConfig.from_dict(preset("small"))
ROOF = 1000.0  # GB/s


def _clock(ms: float):
    """A stand-in timer: runs fn once (so the op really executes) and reports ms."""
    return lambda fn: (fn(), ms)[1]


def _refuse(fn):
    raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture(scope="module")
def small_layer():
    be = NumpyBackend()
    return be, bench_layer(SMALL, be)


def test_ratio_is_graph_over_graph_and_call_ratio_call_over_call():
    memra, peer = {"ms": 0.01, "call_ms": 0.05}, {"ms": 0.02, "call_ms": 0.01, "name": "peer"}
    v = op_entry(4_000_000, ROOF, memra, peer)
    assert v["ratio"] == pytest.approx(0.5) and v["call_ratio"] == pytest.approx(5.0)
    assert v["memra_gbs"] == pytest.approx(400.0) and v["memra_bandwidth_fraction"] == pytest.approx(0.4)
    assert v["peer"]["gbs"] == pytest.approx(200.0)  # bandwidth at graph time, not call time


def test_ratio_red_arm_a_per_call_peer_time_would_change_the_ratio():
    """The 9x trap: memra's graph time against the peer's launch-bound call time."""
    memra, peer = {"ms": 0.01, "call_ms": 0.05}, {"ms": 0.02, "call_ms": 0.09, "name": "peer"}
    assert op_entry(1, ROOF, memra, peer)["ratio"] != memra["ms"] / peer["call_ms"]


def test_refused_capture_gives_its_reason_and_no_graph_ratio():
    peer = timed(lambda: None, _refuse, call_ms=_clock(0.03)) | {"name": "fla"}
    assert peer["ms"] is None and "capturing" in peer["graph_refused"]
    v = op_entry(1000, ROOF, timed(lambda: None, _clock(0.01), call_ms=_clock(0.02)), peer)
    assert v["ratio"] is None and v["call_ratio"] == pytest.approx(2 / 3)
    assert v["peer"]["bandwidth_fraction"] is None
    assert "no graph ratio (RuntimeError" in op_card("kda_recurrence_t1", v)


def test_an_op_without_a_peer_says_why():
    v = op_entry(1000, ROOF, {"ms": 0.01, "call_ms": 0.02}, None, "fla missing")
    assert v["peer"] is None and v["peer_missing"] == "fla missing" and "ratio" not in v
    assert "no peer (fla missing)" in op_card("x", v)


def test_decode_ops_run_on_numpy_and_count_their_inputs_and_outputs(small_layer):
    be, layer = small_layer
    ops = decode_ops(be, SMALL, layer, 2, np.random.default_rng(0))
    assert set(ops) == {"rmsnorm", "hc_weights", "hc_collapse", "hc_combine", "moe_route", "moe_experts"}
    d, n, k = SMALL.hidden_size, SMALL.hc_mult, SMALL.num_experts_per_tok
    assert ops["rmsnorm"].nbytes == 4 * (2 * d + d + 2 * d)                      # x, w, out
    assert ops["hc_collapse"].nbytes == 4 * (2 * n * d + 2 * n + 2 * d)          # streams, pre, out
    assert ops["moe_route"].nbytes == 4 * (2 * d + SMALL.n_routed_experts * (d + 1)) + 2 * k * (8 + 4)
    assert ops["hc_weights"].peer is None and ops["moe_experts"].peer is None
    assert all(op.peer is not None for name, op in ops.items() if name not in ("hc_weights", "moe_experts"))


def test_routed_experts_count_only_the_picked_experts(small_layer):
    """Red arm beside it: all E experts' stacks would be more bytes than the op reads at t = 1."""
    be, layer = small_layer
    moe, op = layer.ffn, decode_ops(be, SMALL, layer, 1, np.random.default_rng(0))["moe_experts"]
    per_expert = sum(s.nbytes // s.shape[0] for s in (moe.gate_w, moe.up_w, moe.down_w))
    io = 4 * 2 * SMALL.hidden_size + SMALL.num_experts_per_tok * (8 + 4)  # x, out; idx, wts
    assert op.nbytes == SMALL.num_experts_per_tok * per_expert + io
    assert op.nbytes < SMALL.n_routed_experts * per_expert


def test_bench_decode_ops_times_every_op_at_every_row_count(small_layer, monkeypatch):
    be, layer = small_layer
    ran = []
    monkeypatch.setattr(bench_ops_decode, "decode_ops", lambda *a: {
        name: bench_ops_decode.DecodeOp((lambda f=op.run, name=name: (ran.append(name), f())[1]), op.nbytes,
                                        None, op.peer_missing or "torch not here")
        for name, op in decode_ops(*a).items()})
    out = bench_decode_ops(be, SMALL, layer, np.random.default_rng(0), ROOF, _clock(0.01), call_ms=_clock(0.02))
    assert set(out) == {f"{name}_t{t}" for t in DECODE_ROWS for name in
                        ("rmsnorm", "hc_weights", "hc_collapse", "hc_combine", "moe_route", "moe_experts")}
    assert {"moe_experts", "hc_weights"} <= set(ran)
    for v in out.values():
        assert v["memra_ms"] == 0.01 and v["memra_call_ms"] == 0.02 and v["bytes"] > 0 and v["peer"] is None


def test_without_a_torch_timer_the_peers_are_reported_missing(small_layer):
    be, layer = small_layer
    out = bench_decode_ops(be, SMALL, layer, np.random.default_rng(0), ROOF, _clock(0.01), call_ms=_clock(0.02))
    assert out["rmsnorm_t1"]["peer_missing"] == "torch not available"
    assert out["hc_weights_t1"]["peer_missing"].startswith("no short torch form")


def _new_record() -> dict:
    kda = op_entry(8_552_704, ROOF, {"ms": 0.04, "call_ms": 0.045},
                   {"ms": 0.05, "call_ms": 0.085, "name": "fla fused_recurrent_kda"})
    refused = op_entry(9_701_376, ROOF, {"ms": 0.05, "call_ms": 0.06},
                       timed(lambda: None, _refuse, call_ms=_clock(0.1)) | {"name": "fla fused_recurrent_kda"})
    norm = op_entry(32_768, ROOF, {"ms": 0.002, "call_ms": 0.01}, None, "no short torch form")
    return {"bench": "bench_ops", "git_sha": "abcdef0", "date": "2026-12-02", "device": "NVIDIA H200",
            "config": {"rows": [1], "shapes": {"proj_4096x4096": [4096, 4096]}, "graph_calls": 20},
            "linear": {"proj_4096x4096_t1": {"ratio": 1.08}},
            "ops": {"kda_recurrence_t1": kda, "kda_recurrence_t8": refused, "hc_weights_t1": norm}}


def test_readme_table_puts_the_graph_ratio_beside_the_call_ratio():
    lines = ops_table("new.json", _new_record())
    row = lambda name: next(line for line in lines if line.startswith(f"| {name} |"))  # noqa: E731
    assert row("kda_recurrence_t1") == ("| kda_recurrence_t1 | fla fused_recurrent_kda | 40 us | 50 us | 0.80x | "
                                        "0.53x | 8.55 MB | 21.4% |")
    assert "| capture refused | n/a | 0.60x |" in row("kda_recurrence_t8")
    assert row("hc_weights_t1").startswith("| hc_weights_t1 | none: no short torch form | 2.0 us | n/a | n/a | n/a |")


def test_readme_table_renders_every_committed_bench_ops_record_with_old_ratios_as_per_call():
    """Records before graph timing on both sides: their one ratio lands in the per-call column."""
    paths = sorted(Path(__file__).resolve().parents[2].glob("benchmarks/results/bench_ops-*.json"))
    assert paths
    for path in paths:
        record = json.loads(path.read_text())
        lines = ops_table(str(path), record)
        old = record.get("kda_recurrence_t1")  # the ops sit at the top level of older records
        if old is not None and "memra_ms" in old:
            kda = next(line for line in lines if line.startswith("| kda_recurrence_t1 |"))
            assert f"| n/a | n/a | n/a | {old['ratio']:.2f}x |" in kda


def test_every_torch_peer_agrees_with_memra_on_the_numpy_backend(small_layer):
    torch = pytest.importorskip("torch")
    be, layer = small_layer
    out = bench_decode_ops(be, SMALL, layer, np.random.default_rng(0), ROOF, _clock(0.01), _clock(0.02),
                           call_ms=_clock(0.03), as_torch=torch.from_numpy)
    peered = {name: v for name, v in out.items() if v["peer"] is not None}
    assert {name.rsplit("_t", 1)[0] for name in peered} == {"rmsnorm", "hc_collapse", "hc_combine", "moe_route"}
    for name, v in peered.items():
        assert v["peer"]["agree"], (name, v["peer"]["max_rel_diff"])
        assert v["ratio"] == pytest.approx(0.5) and v["call_ratio"] == pytest.approx(1.0)
