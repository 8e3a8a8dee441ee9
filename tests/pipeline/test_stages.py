"""Placement: stage plans, their refusals, the byte-balanced default, load_model and the CLI flags."""

import pytest

import memra
from memra.config import load_config
from memra.errors import InputError
from memra.memory_plan import balanced_split, checkpoint_weight_bytes
from memra.model.pipeline import StagedGlm5Model
from memra.model.stages import StagePlan, plan_stages
from memra.model.trunk import Glm5Model
from tests.cli_helpers import ok_json, run_cli


@pytest.mark.parametrize("spec,ranges", [
    ("0-2,3-5", ((0, 3), (3, 6))),
    ("0, 1-4, 5", ((0, 1), (1, 5), (5, 6))),
    ([(0, 2), (2, 6)], ((0, 2), (2, 6))),
])
def test_explicit_splits_parse_to_half_open_ranges(spec, ranges):
    plan = plan_stages(6, stage_layers=spec)
    assert plan.ranges == ranges and plan.count == len(ranges)
    assert plan_stages(6, stage_layers=plan.describe()) == plan


@pytest.mark.parametrize("spec,names", [
    ("0-2,2-5", "overlaps the stage before it"),
    ("0-1,3-5", "leaves layer 2 on no stage"),
    ("0-2", "the last range must end at layer 5"),
    ("0-2,3-6", "the last range must end at layer 5"),
    ("1-5", "leaves layer 0 on no stage"),
    ("3-1,2-5", "runs backwards"),
    ("0-2,,3-5", "is not a layer range"),
    ("a-b", "is not a layer range"),
    ([(0, 3), (3, 3), (3, 6)], "is empty; every stage owns at least one layer"),
    ([(0, 3), (3, 6.0)], "is not a (start, stop) pair"),
    (3, "must be a string like '0-3,4-7'"),
])
def test_bad_explicit_splits_are_refused_by_name(spec, names):
    with pytest.raises(InputError, match=names.replace("(", r"\(").replace(")", r"\)")):
        plan_stages(6, stage_layers=spec)


@pytest.mark.parametrize("stages", [0, 7, -1, True, 2.0, "2"])
def test_stage_counts_outside_one_to_the_layer_count_are_refused(stages):
    with pytest.raises(InputError, match=r"splits into 1\.\.6 stages"):
        plan_stages(6, stages)


def test_a_stage_count_that_contradicts_the_explicit_split_is_refused():
    with pytest.raises(InputError, match="has 2 stages"):
        plan_stages(6, 3, "0-2,3-5")
    assert plan_stages(6, 2, "0-2,3-5").count == 2


def test_without_a_balance_the_stages_get_equal_layer_counts():
    assert plan_stages(6, 2).ranges == ((0, 3), (3, 6))
    assert plan_stages(7, 3).ranges == ((0, 2), (2, 5), (5, 7))
    assert plan_stages(6, 6).ranges == tuple((i, i + 1) for i in range(6))


def test_a_balance_is_checked_like_an_explicit_split():
    assert plan_stages(6, 2, balance=lambda n: [(0, 4), (4, 6)]).ranges == ((0, 4), (4, 6))
    with pytest.raises(InputError, match="leaves layer 4 on no stage"):
        plan_stages(6, 2, balance=lambda n: [(0, 4), (5, 6)])


def test_stage_of_and_describe():
    plan = StagePlan(((0, 1), (1, 5), (5, 6)))
    assert [plan.stage_of(i) for i in range(6)] == [0, 1, 1, 1, 1, 2]
    assert plan.describe() == "0,1-4,5"
    with pytest.raises(InputError, match="outside the trunk"):
        plan.stage_of(6)


# ---- load_model ----------------------------------------------------------------------------------
def test_one_stage_is_exactly_the_plain_model(fixture_dir):
    assert type(memra.load_model(fixture_dir("small"), backend="numpy")) is Glm5Model
    assert type(memra.load_model(fixture_dir("small"), backend="numpy", stages=1)) is Glm5Model
    assert type(memra.load_model(fixture_dir("small"), backend="numpy", stage_layers="0-5")) is Glm5Model


@pytest.mark.parametrize("stages", [2, 3])
def test_the_default_split_is_the_memory_plans_split_by_weight_bytes(fixture_dir, stages):
    path = fixture_dir("small")
    want = balanced_split(checkpoint_weight_bytes(path, load_config(path)), stages)
    model = memra.load_model(path, backend="numpy", stages=stages)
    assert isinstance(model, StagedGlm5Model) and model.placement.count == stages
    assert model.placement.ranges == tuple(want)


def test_load_model_refuses_a_bad_split_before_loading(fixture_dir):
    with pytest.raises(InputError, match="overlaps"):
        memra.load_model(fixture_dir("small"), backend="numpy", stage_layers="0-3,3-5")
    with pytest.raises(InputError, match=r"splits into 1\.\.6 stages"):
        memra.load_model(fixture_dir("small"), backend="numpy", stages=7)
    with pytest.raises(InputError, match="one device per stage"):
        memra.load_model(fixture_dir("small"), backend="numpy", stages=2, devices=[0])


# ---- the CLI -------------------------------------------------------------------------------------
def test_cli_gpus_and_stage_layers_keep_the_tokens(fixture_dir):
    common = ("--checkpoint", fixture_dir("small"), "--backend", "numpy", "--prompt-ids", "1,2,3,4,5,6",
              "-n", "12", "--json")
    plain = run_cli(*common)
    assert plain.returncode == 0, plain.stderr
    for flags in (("--gpus", "2"), ("--stage-layers", "0-1,2-3,4-5")):
        split = run_cli(*common, *flags)
        assert split.returncode == 0, split.stderr
        assert ok_json(split)["tokens"] == ok_json(plain)["tokens"]


@pytest.mark.parametrize("flags,message", [
    (("--gpus", "0"), "--gpus 0: must be an integer >= 1"),
    (("--stage-layers", "0-2,2-5"), "overlaps the stage before it"),
])
def test_cli_refuses_bad_stage_flags_in_one_line(fixture_dir, flags, message):
    proc = run_cli("--checkpoint", fixture_dir("small"), "--backend", "numpy", "--prompt-ids", "1,2,3", "-n", "2",
                   *flags)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr
