"""The DFlash2 drafter network: config, precision codecs, loader census, and the block forward
against a plain float64 re-implementation of the math in research/dflash2.md §2 and §4."""

import json
import math
import os
import warnings

import numpy as np
import pytest

from memra import load_model
from memra.config import preset
from memra.drafters.dflash2 import DflashDraft, load_dflash_config, write_fixture_drafter
from memra.drafters.dflash2.config import dspark_strategy_census, parse_dflash_config
from memra.drafters.dflash2.fixture import drafter_config
from memra.drafters.dflash2.model import conv_rows
from memra.drafters.dflash2.quant import decode_q4_0, decode_q8_0, encode_q4_0, encode_q8_0, held_values
from memra.drafters.dflash2.rope import inv_freq
from memra.errors import CheckpointError, ConfigError, ContextOverflowError, InputError
from memra.safetensors_io import bf16_to_f32, f32_to_bf16, read_safetensors, write_safetensors

F32 = np.float32


@pytest.fixture(scope="module")
def target(fixture_dir):
    return load_model(fixture_dir("small"), backend="numpy")


def _drafter(tmp_path, name="d", target_name="small", **shape):
    return write_fixture_drafter(tmp_path / name, preset(target_name), **shape)


def _rewrite(dir, edit):
    """Apply edit(tensors) to a fixture's safetensors (as float32)."""
    path = os.path.join(dir, "model.safetensors")
    tensors = {n: (bf16_to_f32(a) if d == "BF16" else a) for n, (d, _, a) in read_safetensors(path).items()}
    edit(tensors)
    write_safetensors(path, tensors, dtype="float32")


def _ctx_rows(draft, n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (n, draft.cfg.hidden_size)).astype(F32)


def _primed(draft, n_ctx=9, seed=1):
    kv = draft.new_kv(64)
    draft.ingest(kv, _ctx_rows(draft, n_ctx, seed))
    return kv


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
    d = _drafter(tmp_path)
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
    d = _drafter(tmp_path, dtype="float32")
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
    d = _drafter(tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        DflashDraft.load(d, target)
    with pytest.raises(CheckpointError, match="config.json"):
        DflashDraft.load(tmp_path / "empty", target)


def test_census_names_every_missing_and_misshaped_tensor_at_once(tmp_path, target):
    d = _drafter(tmp_path)

    def edit(t):
        del t["layers.1.mlp_conv.base_kernel"]
        t["layers.0.self_attn.k_proj.weight"] = t["layers.0.self_attn.k_proj.weight"][:16]
    _rewrite(d, edit)
    with pytest.raises(CheckpointError) as err:
        DflashDraft.load(d, target)
    assert "layers.1.mlp_conv.base_kernel" in str(err.value) and "layers.0.self_attn.k_proj.weight" in str(err.value)


def test_unmapped_tensor_refused_on_dspark_and_warned_on_dflash(tmp_path, target):
    for strategy in ("dspark", "dflash"):
        d = _drafter(tmp_path, strategy, strategy=strategy)
        _rewrite(d, lambda t: t.update({"embed_tokens.weight": np.zeros((256, 64), F32)}))
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
    d = _drafter(tmp_path, with_markov=True, with_confidence=True, strategy="dspark")
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
    _rewrite(d, respell)
    again = DflashDraft.load(d, target, precision="f32")
    assert np.array_equal(again.markov_w2, draft.markov_w2) and np.array_equal(again.sel_succ, draft.sel_succ)
    assert np.array_equal(again.conf_w, draft.conf_w) and again.conf_b == draft.conf_b
    plain = DflashDraft.load(_drafter(tmp_path, "plain", with_confidence=True), target)
    assert plain.markov_w1 is None and plain.conf_w.shape == (64,) and not plain.conf_with_markov
    _rewrite(d, lambda t: t.pop("markov_head.markov_w2.weight"))
    with pytest.raises(CheckpointError, match="markov"):
        DflashDraft.load(d, target)


def test_mask_embedding_override_replaces_only_mask_rows(tmp_path, target):
    d = _drafter(tmp_path)
    base = DflashDraft.load(d, target)
    mask = base.cfg.mask_token_id
    same = np.asarray(target.embed_table[mask])
    other = np.random.default_rng(5).normal(0, 1, 64).astype(F32)
    np.save(tmp_path / "m.npy", other)
    write_safetensors(tmp_path / "m.safetensors", {"embedding": other[None]})
    block = [7] + [mask] * 5
    kv = _primed(base)
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


# ---- the forward --------------------------------------------------------------------------------

def _naive_conv(z, base, coef, g):
    b, hid = z.shape
    out = np.zeros_like(z)
    for t in range(b):
        for j in range(base.shape[0]):
            if t - j >= 0:                                  # row 0 reads zeros for every earlier tap
                for c in range(hid):
                    out[t, c] += (base[j, c] + coef[t, j, c // g]) * z[t - j, c]
    return out


def test_conv_rows_matches_the_per_element_definition():
    rng = np.random.default_rng(0)
    z, base, coef = rng.normal(0, 1, (5, 12)), rng.normal(0, 1, (3, 12)), rng.normal(0, 1, (5, 3, 3))
    assert np.allclose(conv_rows(np, z, base, coef, 4), _naive_conv(z, base, coef, 4), atol=1e-12)


def _f64(a):
    return np.asarray(a, np.float64)


def _naive_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * _f64(w)


def _naive_rope(x, pos, inv, mscale):
    """NeoX rotate_half on x [heads, hd] at one absolute position."""
    half = x.shape[1] // 2
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    x1, x2 = x[:, :half], x[:, half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], 1) * mscale


def _naive_attention(draft, li, x, ctx_feats, start):
    c, L = draft.cfg, draft.layers[li]
    nh, nkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    rope = lambda v, pos: _naive_rope(v, pos, draft.inv_freq, c.rope.mscale)  # noqa: E731
    key = lambda row, pos: rope(_naive_norm((row @ _f64(L.wk).T).reshape(nkv, hd), L.k_norm, eps), pos)  # noqa: E731
    n_ctx, b = len(ctx_feats), len(x)
    # context rows sit at cache index r, straight from the features (no norm, no conv)
    keys = [key(_f64(ctx_feats[r]), r) for r in range(n_ctx)] + [key(x[r], start + r) for r in range(b)]
    vals = [(_f64(row) @ _f64(L.wv).T).reshape(nkv, hd) for row in list(ctx_feats) + list(x)]
    out = np.zeros((b, nh * hd))
    for i in range(b):
        q = rope(_naive_norm((x[i] @ _f64(L.wq).T).reshape(nh, hd), L.q_norm, eps), start + i)
        qi = n_ctx + i
        seen = [j for j in range(n_ctx + b)
                if (not c.layer_causal[li] or j <= qi) and (not c.layer_sliding[li] or abs(qi - j) < c.sliding_window)]
        for head in range(nh):
            group = head // (nh // nkv)
            s = np.array([q[head] @ keys[j][group] for j in seen]) / math.sqrt(hd)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, head * hd:(head + 1) * hd] = sum(pj * vals[j][group] for pj, j in zip(p, seen))
    return out @ _f64(L.wo).T


def _naive_mlp(draft, li, x):
    L = draft.layers[li]
    gate = x @ _f64(L.w_gate).T
    return (gate / (1 + np.exp(-gate)) * (x @ _f64(L.w_up).T)) @ _f64(L.w_down).T


def _naive_sublayer(draft, x, base, proj, out_of):
    c = draft.cfg
    coef = (x @ _f64(proj).T).reshape(len(x), 2, c.conv_kernel_size, -1)  # both sides from the input
    pre = _naive_conv(x, _f64(base[0]), coef[:, 0], c.conv_group_size)
    return _naive_conv(out_of(pre), _f64(base[1]), coef[:, 1], c.conv_group_size)


def _naive_forward(draft, ctx_feats, tokens, start):
    """research/dflash2.md §2/§4 in float64 loops."""
    c = draft.cfg
    h = _f64(draft.target.embed_table)[tokens] * c.input_embedding_scale
    for li, L in enumerate(draft.layers):
        x = _naive_norm(h, L.ln_in, c.rms_norm_eps)
        h = h + _naive_sublayer(draft, x, L.attn_base, L.attn_proj,
                                lambda y, li=li: _naive_attention(draft, li, y, ctx_feats, start))
        x = _naive_norm(h, L.ln_post, c.rms_norm_eps)
        h = h + _naive_sublayer(draft, x, L.mlp_base, L.mlp_proj, lambda y, li=li: _naive_mlp(draft, li, y))
    return _naive_norm(h, draft.norm, c.rms_norm_eps)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_block_matches_a_float64_reimplementation(tmp_path, target, causal):
    d = _drafter(tmp_path, rope="yarn", conv_kernel_size=3, sliding_window=5, is_causal=causal,
                 layer_types=["sliding_attention", "full_attention"], input_embedding_scale=1.5, dtype="float32")
    draft = DflashDraft.load(d, target, precision="f32")
    feats = _ctx_rows(draft, 9)
    kv = draft.new_kv(32)
    draft.ingest(kv, feats)
    tokens = [3, 255, 255, 17, 255, 255]
    got = draft.forward_block(kv, tokens, kv.len)
    want = _naive_forward(draft, feats, tokens, kv.len)
    assert got.dtype == F32 and got.shape == (6, 64)
    assert np.abs(got - want).max() < 2e-4 * np.abs(want).max()


def test_block_attention_is_bidirectional_unless_causal(tmp_path, target):
    for causal in (False, True):
        draft = DflashDraft.load(_drafter(tmp_path, f"c{causal}", is_causal=causal), target)
        kv = _primed(draft)
        a = draft.forward_block(kv, [5, 255, 255, 255], kv.len)
        b = draft.forward_block(kv, [5, 255, 9, 255], kv.len)
        assert np.array_equal(a[:2], b[:2]) == causal      # rows before the change see it only when bidirectional
        assert not np.allclose(a[2:], b[2:])


def test_block_kv_is_transient_and_the_forward_repeats(tmp_path, target):
    draft = DflashDraft.load(_drafter(tmp_path), target)
    kv = _primed(draft)
    before = [x.copy() for x in kv.k + kv.v]
    first = draft.forward_block(kv, [5] + [255] * 7, kv.len)
    assert kv.len == 9 and all(np.array_equal(x, y) for x, y in zip(before, kv.k + kv.v))
    assert np.array_equal(draft.forward_block(kv, [5] + [255] * 7, kv.len), first)


def test_ingest_in_chunks_equals_ingest_at_once(tmp_path, target):
    draft = DflashDraft.load(_drafter(tmp_path), target)
    feats = _ctx_rows(draft, 11)
    once, chunked = draft.new_kv(16), draft.new_kv(16)
    draft.ingest(once, feats)
    for lo, hi in [(0, 4), (4, 5), (5, 11)]:
        draft.ingest(chunked, feats[lo:hi])
    assert once.len == chunked.len == 11
    for a, b in zip(once.k + once.v, chunked.k + chunked.v):
        assert np.allclose(a, b, atol=1e-6)
    with pytest.raises(ContextOverflowError, match="max_ctx 16"):
        draft.ingest(chunked, feats[:6])


def test_sliding_window_hides_context_beyond_it(tmp_path, target):
    draft = DflashDraft.load(_drafter(tmp_path, sliding_window=4), target)
    kv = _primed(draft, n_ctx=10)
    block = [5, 255, 255]
    ref = draft.forward_block(kv, block, kv.len)
    for layer in kv.k + kv.v:
        layer[:7] = 99.0                                    # index <= len - W: no block row sees it
    assert np.array_equal(draft.forward_block(kv, block, kv.len), ref)
    kv.k[0][7] = 99.0                                       # row 0's window reaches index len - W + 1
    assert not np.allclose(draft.forward_block(kv, block, kv.len), ref)


def test_yarn_frequencies_and_mscale_match_the_formula(tmp_path):
    rope = parse_dflash_config(drafter_config(preset("small"), rope="yarn")).rope
    dim, base, factor, orig = 16, rope.theta, rope.factor, rope.original_max_position_embeddings
    corr = lambda rot: dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), dim - 1)
    want = []
    for j in range(dim // 2):
        plain = base ** (-2 * j / dim)
        extrap = 1 - min(max((j - low) / (high - low), 0), 1)
        want.append(plain / factor * (1 - extrap) + plain * extrap)
    got = inv_freq(rope, dim)
    assert np.allclose(got, want, rtol=1e-12) and got[0] == 1.0 and got[-1] < base ** (-14 / 16)
    assert rope.mscale == pytest.approx(0.1 * math.log(4) + 1)
    hf = pytest.importorskip("transformers")
    cfg = hf.Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=dim, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "yarn", "rope_theta": base, "factor": factor,
                                          "original_max_position_embeddings": orig})
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert np.allclose(hf_inv.numpy(), got, rtol=1e-6) and hf_scale == pytest.approx(rope.mscale)


def test_logits_are_the_target_head_scaled_and_softcapped(tmp_path, target):
    draft = DflashDraft.load(_drafter(tmp_path, output_multiplier=0.5, final_logit_softcapping=3.0), target)
    kv = _primed(draft)
    hidden = draft.forward_block(kv, [5] + [255] * 7, kv.len)
    head = target.be.linear(np.ascontiguousarray(hidden[1:]), target.lm_head)
    assert np.allclose(draft.logits(hidden[1:]), 3.0 * np.tanh(head * 0.5 / 3.0), atol=1e-6)
    plain = DflashDraft.load(_drafter(tmp_path, "plain"), target)
    assert np.array_equal(plain.logits(hidden), target.be.linear(hidden, target.lm_head))


def test_target_taps_feed_the_context_features(tmp_path, target):
    draft = DflashDraft.load(_drafter(tmp_path), target, precision="f32")
    cache = target.new_cache(64)
    _, _, taps = target.prime_rows(list(range(1, 13)), cache, draft.cfg.target_layer_ids)
    rows = [taps[layer] for layer in draft.cfg.target_layer_ids]
    x = np.concatenate([_f64(r) for r in rows], axis=1) @ _f64(draft.fc).T
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + draft.cfg.rms_norm_eps) * _f64(draft.hidden_norm)
    assert np.allclose(draft.ctx_features(rows), want, atol=1e-4)
    with pytest.raises(InputError, match="got 2 tapped layers, the drafter reads 3"):
        draft.ctx_features(rows[:2])


def test_forward_refusals_name_the_bound(tmp_path, target):
    draft = DflashDraft.load(_drafter(tmp_path), target)
    kv = _primed(draft)
    with pytest.raises(InputError, match="1..8"):
        draft.forward_block(kv, [5] * 9, kv.len)
    with pytest.raises(InputError, match="0..255"):
        draft.forward_block(kv, [5, 256], kv.len)
    with pytest.raises(InputError, match="9 cached context rows"):
        draft.forward_block(kv, [5, 255], kv.len - 1)


def test_fixture_drafter_is_well_formed_and_not_an_identity_conv(tmp_path, target, fixture_dir):
    d = _drafter(tmp_path, with_markov=True, with_confidence=True)
    with open(os.path.join(d, "config.json")) as f:
        raw = json.load(f)
    assert raw["dflash_config"]["mask_token_id"] == 255 and raw["is_causal"] is False
    draft = DflashDraft.load(d, target)
    base = draft.layers[0].attn_base
    assert np.abs(base[:, 1]).mean() > 0.1 and np.abs(draft.layers[0].mlp_proj).max() > 0
    assert {e for (e, _, _) in read_safetensors(os.path.join(d, "model.safetensors")).values()} == {"BF16"}
    mini = load_model(fixture_dir("mini"), backend="numpy")
    assert DflashDraft.load(write_fixture_drafter(tmp_path / "m", preset("mini")), mini).cfg.hidden_size == 128
    with pytest.raises(InputError, match="unknown shape keys"):
        write_fixture_drafter(tmp_path / "x", preset("small"), num_layers=3)


@pytest.mark.gpu
def test_cuda_drafter_matches_the_numpy_drafter(tmp_path, fixture_dir):
    cp = pytest.importorskip("cupy")
    from memra.backend import cuda_available
    if not cuda_available():
        pytest.skip("no CUDA device")
    d = _drafter(tmp_path, sliding_window=6, rope="yarn")
    host, dev = (DflashDraft.load(d, load_model(fixture_dir("small"), backend=b)) for b in ("numpy", "cuda"))
    assert dev.xp is cp
    feats = _ctx_rows(host, 9)
    outs = []
    for draft in (host, dev):
        kv = draft.new_kv(32)
        draft.ingest(kv, feats)
        hidden = draft.forward_block(kv, [5] + [255] * 7, kv.len)
        outs.append((cp.asnumpy(hidden) if draft is dev else hidden, cp.asnumpy(draft.logits(hidden[1:]))
                     if draft is dev else draft.logits(hidden[1:])))
    assert np.allclose(outs[0][0], outs[1][0], atol=1e-4) and np.allclose(outs[0][1], outs[1][1], atol=1e-3)
