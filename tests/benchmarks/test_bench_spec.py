"""bench_spec on CPU (small preset, numpy): ONE JSON line with every measurement, forced full
acceptance accepts every draft, and a session that leaves the plain tape voids the run.

No __init__.py in this folder: one would make `benchmarks` name this folder, not the scripts'.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_spec
from benchmarks.common import build_model, greedy_steps, prime_context, random_tokens
from memra.errors import MemraError

ARGS = ["--preset", "small", "--backend", "numpy", "--git-sha", "test", "--steps", "12",
        "--alphas", "0.5,1.0", "--ks", "1,3", "--context", "16", "--reps", "3"]
POINT_KEYS = {"alpha", "k", "tokens", "ms", "tokens_per_s", "rounds", "mean_accepted_per_round",
              "expected_tokens_per_round", "realised_tokens_per_round", "speedup_vs_plain", "verify_ms", "bound_tokens_per_s",
              "fraction_of_bound", "ms_per_round_by_phase", "captures_in_timed_burst", "with_draft_cost"}


def test_bench_spec_prints_one_json_line_and_full_acceptance_accepts_every_draft(capsys):
    assert bench_spec.main(ARGS) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["bench"] == "bench_spec" and record["plain"]["tokens_per_s"] > 0
    assert set(record["verify_ms"]) == {"1", "3"} and all(v > 0 for v in record["verify_ms"].values())
    assert record["draft_unavailable"] == {}  # small has an MTP block; its dflash2 fixture is cheap
    assert record["draft_profile"] == {"native-mtp": None, "dflash2": None}  # numpy: no kernels
    for name in ("native-mtp", "dflash2"):  # a propose's cost at each forced acceptance
        assert all(record["draft_ms"][name][a][k] > 0 for a in ("0.5", "1") for k in ("1", "3"))
    # native-mtp's lm head alone, per draft step: a part of the step it belongs to
    assert 0 < record["draft_head_ms_per_step"]["native-mtp"] < record["draft_ms"]["native-mtp"]["1"]["1"]
    spec = record["spec"]
    assert [(p["alpha"], p["k"]) for p in spec] == [(0.5, 1), (1.0, 1), (0.5, 3), (1.0, 3)]
    for p in spec:
        assert set(p) == POINT_KEYS and p["tokens"] >= 12 and p["bound_tokens_per_s"] > 0
        assert p["captures_in_timed_burst"] == 0
        # the bound is taken at the acceptance the timed rounds realised, not the analytic one
        assert p["realised_tokens_per_round"] == p["tokens"] / p["rounds"]
        assert p["bound_tokens_per_s"] == pytest.approx(p["realised_tokens_per_round"] / p["verify_ms"] * 1e3)
        assert set(p["with_draft_cost"]) == {"native-mtp", "dflash2"}
        if p["alpha"] == 1.0:
            assert p["mean_accepted_per_round"] == p["k"]  # the tape covers the overshoot: never truncated
            assert p["expected_tokens_per_round"] == p["k"] + 1
        else:
            assert p["mean_accepted_per_round"] < p["k"]


def test_trim_costs_native_mtp_with_its_draft_head_trimmed_as_a_source_of_its_own(capsys):
    """--trim N: native-mtp again with an N-row FR-Spec head: its propose times, its head alone
    and a column in every point (small's heads are too small for their times to order)."""
    assert bench_spec.main(ARGS[:-6] + ["--ks", "3", "--alphas", "1.0", "--reps", "2", "--trim", "64"]) == 0
    record = json.loads(capsys.readouterr().out.strip())
    trimmed = "native-mtp (d2t 64)"
    assert record["config"]["trim"] == 64
    heads = record["draft_head_ms_per_step"]
    assert record["draft_ms"][trimmed]["1"]["3"] > 0
    assert heads[trimmed] > 0 and heads["native-mtp"] > 0
    assert set(record["spec"][0]["with_draft_cost"]) == {"native-mtp", "dflash2", trimmed}


def test_one_propose_per_source_runs_under_the_kernel_profiler_untimed(capsys, monkeypatch):
    """numpy launches no kernels (no profiler: the profile is None, test above); a profiler
    stand-in shows the profiled call still hands its proposal to the session (the tape check
    passes) at each source's largest K."""
    calls = []

    def fake_profile(run, steps, launched):
        run()
        calls.append(steps)
        families = {f"k{i}": {"us_per_step": 100.0 - i} for i in range(12)}
        return {"kernel_us_per_step": 900.0, "span_us_per_step": 1500.0, "idle_share": 0.4, "families": families}

    monkeypatch.setattr(bench_spec, "profiler_for", lambda be: fake_profile)
    assert bench_spec.main(ARGS) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert calls == [1, 1]  # one propose per source
    for name in ("native-mtp", "dflash2"):
        p = record["draft_profile"][name]
        assert p["k"] == 3 and p["kernel_ms"] == 0.9 and p["span_ms"] == 1.5 and p["idle_share"] == 0.4
        assert list(p["families_us"]) == [f"k{i}" for i in range(bench_spec.PROFILE_FAMILIES)]


def test_the_profiled_propose_is_not_timed():
    class Stub:
        max_k, tap_layers = 4, ()

        def begin(self, start):
            return self

        def propose(self, k, sampling=None):
            return k

    profiled = []
    timed = bench_spec.TimedDrafter(Stub(), build_model("small", "numpy").be, profiled=1,
                                    profiler=lambda run, steps, launched: (run(), profiled.append(steps), {})[-1])
    state = timed.begin(None)
    assert [state.propose(2) for _ in range(3)] == [2, 2, 2]
    assert len(timed.ms) == 2 and profiled == [1] and timed.profile == {}


@pytest.mark.parametrize("alpha, first_rows", [(1.0, 4), (0.0, 1)])
def test_a_sources_forced_cost_is_paid_at_the_forced_acceptance(monkeypatch, alpha, first_rows):
    """ForcedDrafter: native-mtp proposes every round on its own state while the rounds accept
    the tape's drafts at alpha, so its next first step feeds the rows that round kept: K + 1 = 4
    at alpha = 1, the bonus row alone at alpha = 0 (what its own drafts reach on random weights,
    the cost the benchmark used to add to every point)."""
    from memra.drafters.native_mtp import NativeMtpState

    model = build_model("small", "numpy")
    tape, prompt = plain_tape(model, 40), random_tokens(model.cfg, 16, 0)
    firsts, step = [], NativeMtpState._step

    def counted(self, tokens, h):
        if self.pending_tokens:  # propose's first step: the rows the last round kept
            firsts.append(len(tokens))
        return step(self, tokens, h)

    monkeypatch.setattr(NativeMtpState, "_step", counted)
    timed = bench_spec.TimedDrafter(bench_spec.NativeMtpSource().load(model), model.be)
    forced = bench_spec.ForcedDrafter(timed, bench_spec.TapeSource(tape, alpha, model.cfg.vocab_size, seed=0))
    _, metrics, _ = bench_spec.spec_run(model, prompt, forced, tape, 12, 3)
    assert metrics.num_accepted_tokens == (3 * metrics.rounds if alpha == 1.0 else 0)
    assert len(timed.ms) == len(firsts) > 2  # every propose timed
    assert firsts[0] == 1 and set(firsts[1:]) == {first_rows}  # the first feeds the prompt's anchor alone


def test_expected_tokens_per_round_is_the_geometric_sum():
    assert bench_spec.expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert bench_spec.expected_tokens(1.0, 7) == 8


def plain_tape(model, n: int) -> list[int]:
    cache, anchor = prime_context(model, 16, n, seed=0)
    tape: list[int] = []
    _, last = greedy_steps(model, cache, anchor, n, tape=tape)
    return tape + [last]


def test_a_session_on_the_plain_tape_passes_the_identity_check():
    model = build_model("small", "numpy")
    tape, prompt = plain_tape(model, 12), random_tokens(model.cfg, 16, 0)
    source = bench_spec.TapeSource(tape, 0.7, model.cfg.vocab_size, seed=0)
    _, metrics, captured = bench_spec.spec_run(model, prompt, source, tape, 8, 3)
    assert metrics.rounds > 0 and captured == 0


def test_a_graph_captured_inside_the_timed_burst_is_reported(monkeypatch):
    """Red arm of the capture count: a walk runner that captures a graph at every walk (as a
    walk shape first met in the burst does once) shows up in the count."""
    from memra.backend.numpy_ref import EagerWalks

    class Capturing(EagerWalks):
        captures = 0

        def run(self, key, walk, tokens, pos0, *arrays):
            self.captures += 1
            return super().run(key, walk, tokens, pos0, *arrays)

    model = build_model("small", "numpy")
    tape, prompt = plain_tape(model, 24), random_tokens(model.cfg, 16, 0)  # covers the burst's overshoot
    monkeypatch.setattr(type(model.be), "walks", lambda be: Capturing(be))
    source = bench_spec.TapeSource(tape, 1.0, model.cfg.vocab_size, seed=0)
    _, metrics, captured = bench_spec.spec_run(model, prompt, source, tape, 8, 3)
    assert captured == metrics.rounds  # one verify walk a round


def test_output_off_the_tape_voids_the_run():
    """Red arm of the identity check: the spec output is right, the tape it is held to is not."""
    model = build_model("small", "numpy")
    tape, prompt = plain_tape(model, 12), random_tokens(model.cfg, 16, 0)
    wrong = tape[:4] + [(tape[4] + 1) % model.cfg.vocab_size] + tape[5:]
    source = bench_spec.TapeSource(wrong, 1.0, model.cfg.vocab_size, seed=0)
    with pytest.raises(MemraError, match="left the plain tape at token 4"):
        bench_spec.spec_run(model, prompt, source, wrong, 8, 3)
