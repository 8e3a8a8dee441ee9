"""The DFlash2 drafter's loading half: config parsing, the precision codecs (byte-compatible with
ggml's q8_0 / q4_0 blocks and with the seed's encoders), and the loader's census and refusals."""

import math
import os
import warnings

import numpy as np
import pytest

from memra.config import preset
from memra.drafters.dflash2 import (
    DflashDraft,
    load_dflash_config,
    write_fixture_drafter,
)
from memra.drafters.dflash2.config import dspark_strategy_census, parse_dflash_config
from memra.drafters.dflash2.fixture import drafter_config
from memra.drafters.dflash2.quant import (
    decode_q4_0,
    decode_q8_0,
    encode_q4_0,
    encode_q8_0,
    held_values,
)
from memra.errors import CheckpointError, ConfigError, InputError
from memra.safetensors_io import (
    bf16_to_f32,
    f32_to_bf16,
    read_safetensors,
    write_safetensors,
)

from .dflash2_helpers import F32, drafter, primed, rewrite

# ---- config ---------------------------------------------------------------------------------

def test_config_reads_dflash_config_first_and_top_level_as_fallback():
    raw = drafter_config(preset("small"))
    raw["block_size"] = 16                           # shadowed by the nested key
    raw["dflash_config"]["block_size"] = 6
    raw["selector_rank"] = raw["dflash_config"].pop("selector_rank")  # only at the top level
    cfg = parse_dflash_config(raw)
    assert cfg.block_size == 6 and cfg.selector_rank == 16
    assert cfg.output_multiplier == 1.0 and cfg.final_logit_softcapping is None
    assert cfg.input_embedding_scale == 1.0 and cfg.target_layer_ids == (0, 2, 5)


def test_config_rope_nested_and_legacy_spellings_agree():
    nested = drafter_config(preset("small"), rope="yarn")
    legacy = drafter_config(preset("small"), rope="yarn")
    params = legacy.pop("rope_parameters")
    legacy["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    legacy["rope_scaling"] = params
    a, b = parse_dflash_config(nested).rope, parse_dflash_config(legacy).rope
    assert a == b and a.type == "yarn" and a.factor == 4.0 and a.original_max_position_embeddings == 1024
    assert a.mscale == pytest.approx(0.1 * math.log(4.0) + 1.0)
    plain = parse_dflash_config(drafter_config(preset("small"))).rope
    assert plain.type == "default" and plain.theta == 10000.0 and plain.mscale == 1.0


def test_config_yarn_null_factor_is_the_context_ratio_and_mscale_pair_is_a_ratio():
    raw = drafter_config(preset("small"), rope={"rope_type": "yarn", "rope_theta": 1e6, "factor": None,
                                                "original_max_position_embeddings": 512,
                                                "mscale": 1.0, "mscale_all_dim": 0.5})
    rope = parse_dflash_config(raw).rope
    assert rope.factor == 4096 / 512
    get = lambda m: 0.1 * m * math.log(8.0) + 1.0  # noqa: E731
    assert rope.mscale == pytest.approx(get(1.0) / get(0.5))


@pytest.mark.parametrize("edit, words", [
    (lambda r: r["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda r: r["dflash_config"].update(mask_token_id=256), "outside the vocab"),
    (lambda r: r["dflash_config"].update(conv_group_size=24), "does not divide"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[]), "target_layer_ids"),
    (lambda r: r["dflash_config"].update(block_size=1), "block_size"),
    (lambda r: r.update(num_key_value_heads=3), "multiple"),
    (lambda r: r["rope_parameters"].update(rope_type="llama3"), "rope_type"),
    (lambda r: r.update(layer_types=["full_attention"]), "layer_types"),
    (lambda r: r.update(layer_types=["sliding_attention"] * 2, sliding_window=None), "sliding_window"),
    (lambda r: r.update(head_dim=True), "head_dim"),
])
def test_config_refusals_name_the_key(edit, words):
    raw = drafter_config(preset("small"))
    edit(raw)
    with pytest.raises(ConfigError, match=words):
        parse_dflash_config(raw)


def test_config_causality_explicit_or_the_reference_default_with_a_warning():
    raw = drafter_config(preset("small"), sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    assert parse_dflash_config(raw).layer_causal == (False, False)
    raw["is_causal"] = True
    cfg = parse_dflash_config(raw)
    assert cfg.layer_causal == (True, True) and cfg.is_causal
    del raw["is_causal"]
    with pytest.warns(UserWarning, match="is_causal"):
        cfg = parse_dflash_config(raw)
    assert cfg.layer_causal == (True, False) and cfg.sliding_window == 4
    plain = drafter_config(preset("small"), is_causal=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_dflash_config(plain).layer_causal == (False, False)


def test_load_dflash_config_takes_a_dir_or_the_file_and_names_a_missing_one(tmp_path):
    d = drafter(tmp_path)
    assert load_dflash_config(d) == load_dflash_config(os.path.join(d, "config.json"))
    with pytest.raises(CheckpointError, match=str(tmp_path / "nope")):
        load_dflash_config(tmp_path / "nope")


def test_dspark_strategy_census_reads_architectures_or_projector_type():
    assert dspark_strategy_census({"architectures": ["Qwen3DSparkModel"], "block_size": 7,
                                   "dflash_config": {"projector_type": "dspark", "markov_rank": 256}})
    assert dspark_strategy_census({"architectures": ["Qwen3DSparkModel"]})
    assert dspark_strategy_census({"dflash_config": {"projector_type": "dspark"}})
    assert not dspark_strategy_census({"architectures": ["Qwen3DFlashModel"],
                                       "dflash_config": {"attention_mode": "gqa"}})
    assert not dspark_strategy_census({})
    assert parse_dflash_config(drafter_config(preset("small"), strategy="dspark")).strategy_dspark
    assert not parse_dflash_config(drafter_config(preset("small"))).strategy_dspark


# ---- precision codecs -------------------------------------------------------------------------

def _seed_half(v) -> int:
    """The seed's half_from_f32 (round-to-nearest-even; flushes fp16 subnormals)."""
    b = int(np.asarray(v, F32).view(np.uint32))
    sign, exp, man = (b >> 16) & 0x8000, ((b >> 23) & 0xFF) - 127 + 15, b & 0x7FFFFF
    if exp <= 0:
        return sign
    if exp >= 31:
        return sign | 0x7C00
    h = sign | (exp << 10) | (man >> 13)
    rem = man & 0x1FFF
    return h + 1 if rem > 0x1000 or (rem == 0x1000 and h & 1) else h


def _rust_round(x) -> float:
    return math.copysign(math.floor(abs(float(x)) + 0.5), float(x))


def _seed_q8_0(vals) -> bytes:
    out = bytearray()
    for blk in np.asarray(vals, F32).reshape(-1, 32):
        amax = F32(0)
        for v in blk:
            amax = max(amax, abs(v))
        d = F32(amax / F32(127))
        inv = F32(1) / d if d > 0 else F32(0)
        out += _seed_half(d).to_bytes(2, "little")
        out += bytes(int(min(max(_rust_round(F32(v * inv)), -127), 127)) & 0xFF for v in blk)
    return bytes(out)


def _seed_q4_0(vals) -> bytes:
    out = bytearray()
    for blk in np.asarray(vals, F32).reshape(-1, 32):
        amax, mx = F32(0), F32(0)
        for v in blk:
            if abs(v) > amax:
                amax, mx = abs(v), v
        d = F32(mx / F32(-8))
        inv = F32(1) / d if d != 0 else F32(0)
        out += _seed_half(d).to_bytes(2, "little")
        nib = [int(min(max(float(F32(v * inv) + F32(8.5)), 0.0), 15.0)) for v in blk]
        out += bytes(nib[j] | (nib[j + 16] << 4) for j in range(16))
    return bytes(out)


def test_q8_0_known_answer_block():
    x = np.zeros(32, F32)
    x[:6] = [127.0, -63.5, 62.5, -0.5, 0.49, 2.5]          # d = 1: roundf rounds halves away from 0
    blob = encode_q8_0(x).tobytes()
    assert len(blob) == 34 and blob[:2] == bytes([0x00, 0x3C])  # fp16 1.0
    assert list(np.frombuffer(blob[2:8], np.int8)) == [127, -64, 63, -1, 0, 3]
    assert blob[8:] == bytes(26)


def test_q4_0_known_answer_blocks():
    neg = np.zeros(32, F32)
    neg[[0, 3, 16, 17, 20]] = [7.0, -8.0, 3.4, -2.6, 7.9]   # signed max -8 -> d = 1
    blob = encode_q4_0(neg).tobytes()
    assert len(blob) == 18 and blob[:2] == bytes([0x00, 0x3C])
    expect = [0x88] * 16
    expect[0], expect[1], expect[3], expect[4] = 0xBF, 0x58, 0x80, 0xF8  # low nibble j, high j+16
    assert list(blob[2:]) == expect
    pos = np.zeros(32, F32)
    pos[[0, 5, 9]] = [8.0, 4.0, -8.0]                        # first of equal magnitude wins: d = -1
    blob = encode_q4_0(pos).tobytes()
    assert blob[:2] == bytes([0x00, 0xBC])
    assert blob[2] & 0xF == 0 and blob[2 + 5] & 0xF == 4 and blob[2 + 9] & 0xF == 15
    back = decode_q4_0(encode_q4_0(pos), pos.shape)
    assert back[0] == 8.0 and back[5] == 4.0 and back[9] == -7.0  # the clamped side loses one step


def test_fp16_subnormal_scales_are_kept_as_ggml_keeps_them():
    x = np.linspace(-1e-3, 1e-3, 32, dtype=F32)              # d = amax/127 is an fp16 subnormal
    blob = encode_q8_0(x)
    assert blob[:2].view("<f2")[0] == np.float16(F32(1e-3) / F32(127)) != 0  # the seed flushed it to 0
    assert np.abs(decode_q8_0(blob, x.shape) - x).max() < 2e-5


@pytest.mark.parametrize("scale", [0.05, 3.0])
def test_encodes_are_byte_identical_to_the_seed(scale):
    x = (np.random.default_rng(7).standard_normal((4, 96)) * scale).astype(F32)
    x[1, 40] = -6 * scale                                     # a negative-dominant q4 block
    assert encode_q8_0(x).tobytes() == _seed_q8_0(x)
    assert encode_q4_0(x).tobytes() == _seed_q4_0(x)


def test_round_trips_stay_inside_their_error_bounds():
    x = (np.random.default_rng(3).standard_normal((8, 64)) * 0.1).astype(F32)
    amax = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True)
    err8 = np.abs(decode_q8_0(encode_q8_0(x), x.shape) - x).reshape(-1, 32)
    assert np.all(err8 <= 0.5 * amax / 127 * 1.14)            # half a step, plus the fp16 scale
    err4 = np.abs(decode_q4_0(encode_q4_0(x), x.shape) - x).reshape(-1, 32)
    assert np.all(err4 <= amax / 8 * 1.01)                    # one step on the clamped side
    assert np.all(np.abs(held_values(x, "bf16") - x) <= np.abs(x) * 2.0 ** -8)
    assert np.array_equal(held_values(x, "f32"), x)
    assert np.array_equal(held_values(x, "bf16"), bf16_to_f32(f32_to_bf16(x)))
    with pytest.raises(InputError, match="blocks of 32"):
        encode_q8_0(np.ones((2, 48), F32))


# ---- loader -------------------------------------------------------------------------------------

def test_loader_holds_each_precisions_values(tmp_path, target):
    d = drafter(tmp_path, dtype="float32")
    raw = {n: a for n, (_, _, a) in read_safetensors(os.path.join(d, "model.safetensors")).items()}
    wq = raw["layers.0.self_attn.q_proj.weight"]
    for precision in ("f32", "bf16", "q8_0", "q4_0"):
        draft = DflashDraft.load(d, target, precision=precision)
        assert np.array_equal(draft.layers[0].wq, held_values(wq, precision))
        norm_kind = "f32" if precision == "f32" else "bf16"     # small tensors never go blockwise
        assert np.array_equal(draft.norm, held_values(raw["norm.weight"], norm_kind))
        assert np.array_equal(draft.sel_pred, held_values(raw["candidate_selector.predecessor_codebook"],
                                                          norm_kind))
    with pytest.raises(InputError, match="f32.*bf16.*q8_0.*q4_0"):
        DflashDraft.load(d, target, precision="int8")


def test_loader_names_missing_files(tmp_path, target):
    d = drafter(tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        DflashDraft.load(d, target)
    with pytest.raises(CheckpointError, match="config.json"):
        DflashDraft.load(tmp_path / "empty", target)


def test_census_names_every_missing_and_misshaped_tensor_at_once(tmp_path, target):
    d = drafter(tmp_path)

    def edit(t):
        del t["layers.1.mlp_conv.base_kernel"]
        t["layers.0.self_attn.k_proj.weight"] = t["layers.0.self_attn.k_proj.weight"][:16]
    rewrite(d, edit)
    with pytest.raises(CheckpointError) as err:
        DflashDraft.load(d, target)
    assert "layers.1.mlp_conv.base_kernel" in str(err.value) and "layers.0.self_attn.k_proj.weight" in str(err.value)


def test_unmapped_tensor_refused_on_dspark_and_warned_on_dflash(tmp_path, target):
    for strategy in ("dspark", "dflash"):
        d = drafter(tmp_path, strategy, strategy=strategy)
        rewrite(d, lambda t: t.update({"embed_tokens.weight": np.zeros((256, 64), F32)}))
        if strategy == "dspark":
            with pytest.raises(CheckpointError, match="embed_tokens.weight"):
                DflashDraft.load(d, target)
        else:
            with pytest.warns(UserWarning, match="embed_tokens.weight"):
                DflashDraft.load(d, target)


@pytest.mark.parametrize("case", ["hidden", "vocab", "tap"])
def test_loader_refuses_a_drafter_made_for_another_target(tmp_path, target, case):
    tcfg = preset("small")
    shape = {}
    if case == "hidden":
        tcfg["hidden_size"] = 128
    elif case == "vocab":
        tcfg["vocab_size"] = 512
    else:
        shape["target_layer_ids"] = [1, 6]
    d = write_fixture_drafter(tmp_path / case, tcfg, **shape)
    bound = {"hidden": "hidden_size 128 != target hidden_size 64", "vocab": "vocab_size 512 != target",
             "tap": r"\[6\] outside the target's layers 0..5"}[case]
    with pytest.raises(ConfigError, match=bound):
        DflashDraft.load(d, target)


def test_optional_heads_load_under_either_spelling(tmp_path, target):
    d = drafter(tmp_path, with_markov=True, with_confidence=True, strategy="dspark")
    draft = DflashDraft.load(d, target, precision="f32")
    assert draft.markov_w1.shape == draft.markov_w2.shape == (256, 16)
    assert draft.conf_w.shape == (64 + 16,) and draft.conf_with_markov and isinstance(draft.conf_b, float)

    def respell(t):
        for old, new in [("markov_head.w1", "markov_head.markov_w1.weight"),
                         ("markov_head.w2", "markov_head.markov_w2.weight"),
                         ("confidence_head.weight", "confidence_head.proj.weight"),
                         ("confidence_head.bias", "confidence_head.proj.bias"),
                         ("candidate_selector.successor_codebook", "candidate_selector.successor_codebook.weight")]:
            t[new] = t.pop(old)
    rewrite(d, respell)
    again = DflashDraft.load(d, target, precision="f32")
    assert np.array_equal(again.markov_w2, draft.markov_w2) and np.array_equal(again.sel_succ, draft.sel_succ)
    assert np.array_equal(again.conf_w, draft.conf_w) and again.conf_b == draft.conf_b
    plain = DflashDraft.load(drafter(tmp_path, "plain", with_confidence=True), target)
    assert plain.markov_w1 is None and plain.conf_w.shape == (64,) and not plain.conf_with_markov
    rewrite(d, lambda t: t.pop("markov_head.markov_w2.weight"))
    with pytest.raises(CheckpointError, match="markov"):
        DflashDraft.load(d, target)


def test_mask_embedding_override_replaces_only_mask_rows(tmp_path, target):
    d = drafter(tmp_path)
    base = DflashDraft.load(d, target)
    mask = base.cfg.mask_token_id
    same = np.asarray(target.embed_table[mask])
    other = np.random.default_rng(5).normal(0, 1, 64).astype(F32)
    np.save(tmp_path / "m.npy", other)
    write_safetensors(tmp_path / "m.safetensors", {"embedding": other[None]})
    block = [7] + [mask] * 5
    kv = primed(base)
    ref = base.forward_block(kv, block, kv.len)
    assert np.allclose(DflashDraft.load(d, target, mask_embedding=same).forward_block(kv, block, kv.len), ref,
                       atol=1e-6)
    outs = [DflashDraft.load(d, target, mask_embedding=src).forward_block(kv, block, kv.len)
            for src in (other, tmp_path / "m.npy", tmp_path / "m.safetensors")]
    assert not np.allclose(outs[0], ref) and np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    no_mask = [7, 8, 9]
    assert np.array_equal(DflashDraft.load(d, target, mask_embedding=other).forward_block(kv, no_mask, kv.len),
                          base.forward_block(kv, no_mask, kv.len))
    with pytest.raises(InputError, match=r"\[64\]"):
        DflashDraft.load(d, target, mask_embedding=np.zeros(63, F32))
