"""The checkpoint contract: fixtures load back exactly, every spelling maps to one canonical set,
and every offender against the contract is named in one CheckpointError."""

import json
import re

import numpy as np
import pytest

from memra.checkpoint import expected_tensors, load_checkpoint, write_fixture
from memra.config import ModelConfig, preset
from memra.errors import CheckpointError
from memra.safetensors_io import (
    bf16_to_f32, f32_to_bf16, read_safetensors, write_raw_safetensors, write_safetensors,
)


def _cfg(name):
    return ModelConfig.from_dict(preset(name))


@pytest.fixture(scope="module", params=["mini", "small"])
def fixture_dir(request, tmp_path_factory):
    return request.param, write_fixture(tmp_path_factory.mktemp(request.param), preset(request.param))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The small fixture's loaded weights and its on-disk tensors (name -> f32 array)."""
    d = write_fixture(tmp_path_factory.mktemp("small_ref"), preset("small"))
    disk = {k: v[2] for k, v in read_safetensors(f"{d}/model.safetensors").items()}
    return load_checkpoint(d, _cfg("small")), disk


def _rewrite(tmp_path, tensors, cfg_name="small", dtype="float32"):
    """A checkpoint dir holding exactly `tensors` (on-disk name -> array)."""
    write_safetensors(tmp_path / "model.safetensors", tensors, dtype=dtype)
    (tmp_path / "config.json").write_text(json.dumps(preset(cfg_name)))
    return tmp_path


def _bare(disk):
    return {k.removeprefix("model."): v for k, v in disk.items()}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


# ---- the contract ------------------------------------------------------------------------------

def test_expected_tensors_follow_the_layer_schedules():
    cfg = _cfg("small")
    exp = expected_tensors(cfg)
    d, c = cfg.hidden_size, cfg.linear_dim
    assert exp["lm_head.weight"] == (cfg.vocab_size, d)
    assert exp["layers.0.self_attn.q_conv1d.weight"] == (c, 1, cfg.linear_conv_kernel_dim)
    assert exp["layers.0.hc_attn_fn"] == (24, 4 * d) and exp["layers.0.hc_ffn_scale"] == (3,)
    assert exp["layers.0.mlp.down_proj.weight"] == (d, cfg.intermediate_size)
    assert exp["layers.1.mlp.experts.7.down_proj.weight"] == (d, cfg.moe_intermediate_size)
    assert "layers.1.self_attn.indexer.wk.weight" in exp
    assert not any(k.startswith("layers.2.self_attn.indexer.") for k in exp)  # shared indexer layer
    assert exp["layers.6.eh_proj.weight"] == (d, 2 * d)
    assert sum(k.startswith("layers.6.self_attn.indexer.") for k in exp) == 7
    assert not any(k.startswith("layers.6.hc_") for k in exp)
    assert "lm_head.weight" not in expected_tensors(_cfg("mini"))  # tied head


def test_no_mtp_means_no_layer_l_block():
    raw = preset("small") | {"num_nextn_predict_layers": 0}
    assert not any(k.startswith("layers.6.") for k in expected_tensors(ModelConfig.from_dict(raw)))


def test_fixture_loads_exactly_the_contract_as_float32(fixture_dir):
    name, d = fixture_dir
    cfg = _cfg(name)
    got = load_checkpoint(d, cfg)
    exp = expected_tensors(cfg)
    assert list(got) == list(exp)
    assert all(got[k].shape == exp[k] and got[k].dtype == np.float32 for k in exp)
    assert json.loads(open(f"{d}/config.json").read())["pad_token_id"] == 0


def test_fixture_is_deterministic_and_seed_sensitive(tmp_path):
    cfg = _cfg("mini")
    a = load_checkpoint(write_fixture(tmp_path / "a", preset("mini"), seed=3), cfg)
    b = load_checkpoint(write_fixture(tmp_path / "b", preset("mini"), seed=3), cfg)
    c = load_checkpoint(write_fixture(tmp_path / "c", preset("mini"), seed=4), cfg)
    _same(a, b)
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()
    assert all(not np.array_equal(a[k], c[k]) for k in a)


def test_fixture_tensor_values_do_not_depend_on_other_tensors(tmp_path):
    without_mtp = preset("small") | {"num_nextn_predict_layers": 0}
    a = load_checkpoint(write_fixture(tmp_path / "a", without_mtp), ModelConfig.from_dict(without_mtp))
    b = load_checkpoint(write_fixture(tmp_path / "b", preset("small")), _cfg("small"))
    assert a.keys() < b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_fixture_has_no_constant_parameters_and_no_all_ones_norms(small):
    weights, _ = small
    for name, arr in weights.items():
        if arr.size > 1:
            assert arr.std() > 1e-3, f"{name} is constant"
        if name.endswith("norm.weight"):
            assert not np.allclose(arr, 1.0) and 0.7 <= arr.min() and arr.max() <= 1.3, name
    assert weights["layers.0.self_attn.A_log"].min() >= 0.0
    assert 0.5 <= weights["layers.0.hc_attn_scale"].min() and weights["layers.0.hc_attn_scale"].max() <= 1.5


def test_bf16_fixture_widens_to_bf16_rounded_f32(tmp_path, small):
    weights, _ = small
    d = write_fixture(tmp_path, preset("small"), dtype="bfloat16")
    wide = load_checkpoint(d, _cfg("small"))
    raw = load_checkpoint(d, _cfg("small"), keep_bf16=True)
    for k, w in weights.items():
        assert wide[k].dtype == np.float32 and np.array_equal(wide[k], bf16_to_f32(f32_to_bf16(w))), k
        assert raw[k].dtype == np.uint16 and np.array_equal(raw[k], f32_to_bf16(w)), k


def test_f16_tensors_are_widened_even_with_keep_bf16(tmp_path, small):
    weights, disk = small
    entries = {k: ("F16", v.shape, v.astype("<f2").tobytes()) for k, v in disk.items()}
    write_raw_safetensors(tmp_path / "model.safetensors", entries)
    for keep in (False, True):
        got = load_checkpoint(tmp_path, _cfg("small"), keep_bf16=keep)
        assert all(got[k].dtype == np.float32 and np.array_equal(got[k], weights[k].astype(np.float16))
                   for k in weights)


# ---- spellings ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["model.language_model.", "model.", ""])
def test_every_prefix_loads_identically(tmp_path, small, prefix):
    weights, disk = small
    renamed = {k if k == "lm_head.weight" else prefix + k: v for k, v in _bare(disk).items()}
    _same(load_checkpoint(_rewrite(tmp_path, renamed), _cfg("small")), weights)


def test_ignored_tensors_are_dropped(tmp_path, small):
    weights, disk = small
    junk = np.ones((2, 2), np.float32)
    extra = {"model.visual.blocks.0.attn.qkv.weight": junk, "model.visual.merger.weight": junk,
             "model.language_model.layers.0.hc_head_fn": junk, "model.hc_head_base": junk,
             "model.layers.6.shared_head.head.weight": junk, "model.layers.6.embed_tokens.weight": junk}
    _same(load_checkpoint(_rewrite(tmp_path, {**disk, **extra}), _cfg("small")), weights)


def test_tied_config_ignores_an_lm_head(tmp_path):
    d = write_fixture(tmp_path, preset("mini"))
    disk = {k: v[2] for k, v in read_safetensors(f"{d}/model.safetensors").items()}
    want = load_checkpoint(d, _cfg("mini"))
    disk["lm_head.weight"] = np.zeros((32, 128), np.float32)
    _same(load_checkpoint(_rewrite(tmp_path, disk, "mini"), _cfg("mini")), want)


def _fuse_like_transformers(bare, cfg):
    """The live names transformers uses in memory (save_pretrained(save_original_format=False))."""
    out = dict(bare)
    e = cfg.n_routed_experts
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        if p + "self_attn.q_conv1d.weight" in out:
            out[p + "self_attn.conv1d.weight"] = np.concatenate(
                [out.pop(f"{p}self_attn.{c}_conv1d.weight") for c in "qkv"])
            for leaf in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
                out[f"{p}self_attn.forget_gate.{leaf}"] = out.pop(f"{p}self_attn.{leaf}")
        for site in ("attn", "ffn"):
            for leaf in ("fn", "base", "scale"):
                out[f"{p}{site}_hc.{leaf}"] = out.pop(f"{p}hc_{site}_{leaf}")
        if p + "mlp.experts.0.gate_proj.weight" in out:
            x = p + "mlp.experts."
            out[x + "gate_up_proj"] = np.stack([np.concatenate(
                [out.pop(f"{x}{j}.gate_proj.weight"), out.pop(f"{x}{j}.up_proj.weight")]) for j in range(e)])
            out[x + "down_proj"] = np.stack([out.pop(f"{x}{j}.down_proj.weight") for j in range(e)])
    return out


def test_transformers_fused_live_names_convert_to_canonical(tmp_path, small):
    weights, disk = small
    fused = _fuse_like_transformers(_bare(disk), _cfg("small"))
    assert "layers.0.self_attn.conv1d.weight" in fused and "layers.1.mlp.experts.gate_up_proj" in fused
    _same(load_checkpoint(_rewrite(tmp_path, fused), _cfg("small")), weights)


def test_fused_tensor_of_impossible_shape_is_named(tmp_path, small):
    _, disk = small
    fused = _fuse_like_transformers(_bare(disk), _cfg("small"))
    fused["layers.0.self_attn.conv1d.weight"] = np.zeros((5, 1, 4), np.float32)
    with pytest.raises(CheckpointError, match=r"fused layers\.0\.self_attn\.conv1d\.weight has shape \[5, 1, 4\]"):
        load_checkpoint(_rewrite(tmp_path, fused), _cfg("small"))


def test_two_spellings_of_one_tensor_are_a_duplicate(tmp_path, small):
    _, disk = small
    both = {**disk, "norm.weight": disk["model.norm.weight"]}
    with pytest.raises(CheckpointError, match=r"duplicate: norm\.weight"):
        load_checkpoint(_rewrite(tmp_path, both), _cfg("small"))


# ---- files: single, sharded, missing ------------------------------------------------------------

def _shard(tmp_path, disk, n=3):
    names = sorted(disk)
    weight_map = {}
    for s in range(n):
        shard = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        part = names[s::n]
        write_safetensors(tmp_path / shard, {k: disk[k] for k in part})
        weight_map.update(dict.fromkeys(part, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path, weight_map


def test_sharded_index_loads_like_a_single_file(tmp_path, small):
    weights, disk = small
    d, _ = _shard(tmp_path, disk)
    _same(load_checkpoint(d, _cfg("small")), weights)


def test_sharded_index_with_missing_shard_raises(tmp_path, small):
    d, _ = _shard(tmp_path, small[1])
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors but it is missing"):
        load_checkpoint(d, _cfg("small"))


def test_weight_map_naming_a_tensor_its_shard_lacks_raises(tmp_path, small):
    d, weight_map = _shard(tmp_path, small[1])
    weight_map["model.norm.weight"] = next(s for s in weight_map.values() if s != weight_map["model.norm.weight"])
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"maps model\.norm\.weight to .*does not hold it"):
        load_checkpoint(d, _cfg("small"))


@pytest.mark.parametrize("index", ["{not json", '{"weight_map": ["a"]}', '{"weight_map": {"w": "../x.safetensors"}}'])
def test_malformed_or_escaping_index_raises(tmp_path, index):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match="weight_map"):
        load_checkpoint(tmp_path, _cfg("small"))


def test_single_safetensors_file_path_loads(small, tmp_path):
    weights, disk = small
    write_safetensors(tmp_path / "weights.safetensors", disk)
    _same(load_checkpoint(tmp_path / "weights.safetensors", _cfg("small")), weights)


@pytest.mark.parametrize("where", ["empty dir", "no such path"])
def test_path_without_a_checkpoint_raises(tmp_path, where):
    path = tmp_path if where == "empty dir" else tmp_path / "nope"
    with pytest.raises(CheckpointError, match="neither model.safetensors|does not exist"):
        load_checkpoint(path, _cfg("small"))


# ---- contract offenders -------------------------------------------------------------------------

def _broken(tmp_path, disk, drop=(), add=None, raw=None):
    entries = {k: ("F32", v.shape, v.astype("<f4").tobytes()) for k, v in disk.items() if k not in drop}
    entries.update({k: ("F32", v.shape, v.astype("<f4").tobytes()) for k, v in (add or {}).items()})
    entries.update(raw or {})
    write_raw_safetensors(tmp_path / "model.safetensors", entries)
    return tmp_path


def _offenders(path, cfg_name="small"):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, _cfg(cfg_name))
    return str(info.value)


def test_missing_tensor_is_named(tmp_path, small):
    msg = _offenders(_broken(tmp_path, small[1], drop={"model.layers.3.self_attn.A_log"}))
    assert re.search(r"missing: layers\.3\.self_attn\.A_log \[2\]", msg) and "1 missing" in msg


def test_unexpected_tensor_is_named(tmp_path, small):
    msg = _offenders(_broken(tmp_path, small[1], add={"model.layers.0.mlp.bias": np.zeros(3, np.float32)}))
    assert "unexpected: layers.0.mlp.bias" in msg


def test_wrong_shape_is_named_with_both_shapes(tmp_path, small):
    msg = _offenders(_broken(tmp_path, small[1], add={"model.norm.weight": np.zeros(63, np.float32)}))
    assert "wrong shape: norm.weight is [63], expected [64]" in msg


def test_unsupported_dtype_is_named(tmp_path, small):
    raw = {"model.norm.weight": ("I64", (64,), bytes(8 * 64))}
    msg = _offenders(_broken(tmp_path, small[1], raw=raw))
    assert "model.norm.weight is I64" in msg and "F32, F16, BF16" in msg


def test_all_offenders_are_named_in_one_error(tmp_path, small):
    path = _broken(tmp_path, small[1], drop={"model.layers.0.self_attn.dt_bias"},
                   add={"model.norm.weight": np.zeros(2, np.float32), "model.extra": np.zeros(1, np.float32)},
                   raw={"model.layers.1.hc_ffn_base": ("F8_E4M3", (24,), bytes(24))})
    msg = _offenders(path)
    for needle in ("missing: layers.0.self_attn.dt_bias", "unexpected: extra",
                   "wrong shape: norm.weight", "model.layers.1.hc_ffn_base is F8_E4M3"):
        assert needle in msg


def test_huge_offender_list_is_truncated_with_a_count(tmp_path, small):
    drop = {k for k in small[1] if ".experts." in k}
    msg = _offenders(_broken(tmp_path, small[1], drop=drop))
    assert f"{len(drop)} missing" in msg and re.search(r"\.\.\. and \d+ more missing", msg)
    assert msg.count("\n") < 50


def test_config_mismatch_is_refused_by_the_contract(tmp_path, small):
    msg = _offenders(_rewrite(tmp_path, small[1]), cfg_name="mini")
    assert "wrong shape: embed_tokens.weight is [256, 64], expected [32, 128]" in msg


# ---- transformers agrees (slow import; skipped without torch/transformers) ----------------------

def test_transformers_loads_the_fixture_with_no_missing_keys(fixture_dir):
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    name, d = fixture_dir
    model, info = modeling.Glm5NextTextModel.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    n = _cfg(name).num_hidden_layers
    assert all(k == "lm_head.weight" or f"layers.{n}." in k for k in info["unexpected_keys"])
    ours = load_checkpoint(d, _cfg(name))
    live = model.state_dict()
    conv = torch.cat([torch.from_numpy(ours[f"layers.0.self_attn.{c}_conv1d.weight"]) for c in "qkv"])
    assert torch.equal(live["layers.0.self_attn.conv1d.weight"], conv)
    assert torch.equal(live["layers.1.attn_hc.base"], torch.from_numpy(ours["layers.1.hc_attn_base"]))
