"""The DFlash2 drafter network: the block forward against a plain float64 re-implementation of
the math in research/dflash2.md §2 and §4, the draft KV, the window, YaRN and the logits."""

import json
import math
import os

import numpy as np
import pytest

from memra import load_model
from memra.config import preset
from memra.drafters.dflash2 import DflashDraft, write_fixture_drafter
from memra.drafters.dflash2.config import parse_dflash_config
from memra.drafters.dflash2.fixture import drafter_config
from memra.drafters.dflash2.model import conv_rows
from memra.drafters.dflash2.rope import inv_freq
from memra.errors import ContextOverflowError, InputError
from memra.safetensors_io import read_safetensors

from .dflash2_helpers import F32, ctx_rows, drafter, primed

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
    d = drafter(tmp_path, rope="yarn", conv_kernel_size=3, sliding_window=5, is_causal=causal,
                 layer_types=["sliding_attention", "full_attention"], input_embedding_scale=1.5, dtype="float32")
    draft = DflashDraft.load(d, target, precision="f32")
    feats = ctx_rows(draft, 9)
    kv = draft.new_kv(32)
    draft.ingest(kv, feats)
    tokens = [3, 255, 255, 17, 255, 255]
    got = draft.forward_block(kv, tokens, kv.len)
    want = _naive_forward(draft, feats, tokens, kv.len)
    assert got.dtype == F32 and got.shape == (6, 64)
    assert np.abs(got - want).max() < 2e-4 * np.abs(want).max()


def test_block_attention_is_bidirectional_unless_causal(tmp_path, target):
    for causal in (False, True):
        draft = DflashDraft.load(drafter(tmp_path, f"c{causal}", is_causal=causal), target)
        kv = primed(draft)
        a = draft.forward_block(kv, [5, 255, 255, 255], kv.len)
        b = draft.forward_block(kv, [5, 255, 9, 255], kv.len)
        assert np.array_equal(a[:2], b[:2]) == causal      # rows before the change see it only when bidirectional
        assert not np.allclose(a[2:], b[2:])


def test_block_kv_is_transient_and_the_forward_repeats(tmp_path, target):
    draft = DflashDraft.load(drafter(tmp_path), target)
    kv = primed(draft)
    before = [x.copy() for x in kv.k + kv.v]
    first = draft.forward_block(kv, [5] + [255] * 7, kv.len)
    assert kv.len == 9 and all(np.array_equal(x, y) for x, y in zip(before, kv.k + kv.v))
    assert np.array_equal(draft.forward_block(kv, [5] + [255] * 7, kv.len), first)


def test_ingest_in_chunks_equals_ingest_at_once(tmp_path, target):
    draft = DflashDraft.load(drafter(tmp_path), target)
    feats = ctx_rows(draft, 11)
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
    draft = DflashDraft.load(drafter(tmp_path, sliding_window=4), target)
    kv = primed(draft, n_ctx=10)
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
    draft = DflashDraft.load(drafter(tmp_path, output_multiplier=0.5, final_logit_softcapping=3.0), target)
    kv = primed(draft)
    hidden = draft.forward_block(kv, [5] + [255] * 7, kv.len)
    head = target.be.linear(np.ascontiguousarray(hidden[1:]), target.lm_head)
    assert np.allclose(draft.logits(hidden[1:]), 3.0 * np.tanh(head * 0.5 / 3.0), atol=1e-6)
    plain = DflashDraft.load(drafter(tmp_path, "plain"), target)
    assert np.array_equal(plain.logits(hidden), target.be.linear(hidden, target.lm_head))


def test_target_taps_feed_the_context_features(tmp_path, target):
    draft = DflashDraft.load(drafter(tmp_path), target, precision="f32")
    cache = target.new_cache(64)
    _, _, taps = target.prime_rows(list(range(1, 13)), cache, draft.cfg.target_layer_ids)
    rows = [taps[layer] for layer in draft.cfg.target_layer_ids]
    x = np.concatenate([_f64(r) for r in rows], axis=1) @ _f64(draft.fc).T
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + draft.cfg.rms_norm_eps) * _f64(draft.hidden_norm)
    assert np.allclose(draft.ctx_features(rows), want, atol=1e-4)
    with pytest.raises(InputError, match="got 2 tapped layers, the drafter reads 3"):
        draft.ctx_features(rows[:2])


def test_forward_refusals_name_the_bound(tmp_path, target):
    draft = DflashDraft.load(drafter(tmp_path), target)
    kv = primed(draft)
    with pytest.raises(InputError, match="1..8"):
        draft.forward_block(kv, [5] * 9, kv.len)
    with pytest.raises(InputError, match="0..255"):
        draft.forward_block(kv, [5, 256], kv.len)
    with pytest.raises(InputError, match="9 cached context rows"):
        draft.forward_block(kv, [5, 255], kv.len - 1)
    block = [5] + [255] * 7
    with pytest.raises(InputError, match="rows 6..8 outside the 8-row block"):
        draft.draft_rows(kv, block, kv.len, 6, 3, None)
    with pytest.raises(InputError, match="top_k=0 outside 1..256"):
        draft.draft_rows(kv, block, kv.len, 1, 7, 0)
    rows, logits, (values, ids) = draft.draft_rows(kv, block, kv.len, 1, 7, 4)
    assert rows.shape == (7, draft.cfg.hidden_size) and logits.shape == (7, 256) and ids.shape == (7, 4)
    assert np.array_equal(rows, draft.forward_block(kv, block, kv.len)[1:])


def test_fixture_drafter_is_well_formed_and_not_an_identity_conv(tmp_path, target, fixture_dir):
    d = drafter(tmp_path, with_markov=True, with_confidence=True)
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
def test_cuda_drafter_matches_the_numpydrafter(tmp_path, fixture_dir):
    cp = pytest.importorskip("cupy")
    from memra.backend import cuda_available
    if not cuda_available():
        pytest.skip("no CUDA device")
    d = drafter(tmp_path, sliding_window=6, rope="yarn")
    host, dev = (DflashDraft.load(d, load_model(fixture_dir("small"), backend=b)) for b in ("numpy", "cuda"))
    assert dev.xp is cp
    feats = ctx_rows(host, 9)
    outs = []
    for draft in (host, dev):
        kv = draft.new_kv(32)
        draft.ingest(kv, feats)
        hidden = draft.forward_block(kv, [5] + [255] * 7, kv.len)
        outs.append((cp.asnumpy(hidden) if draft is dev else hidden, cp.asnumpy(draft.logits(hidden[1:]))
                     if draft is dev else draft.logits(hidden[1:])))
    assert np.allclose(outs[0][0], outs[1][0], atol=1e-4) and np.allclose(outs[0][1], outs[1][1], atol=1e-3)
