"""The attention-side blocks (KDA, kpool indexer, MLA, residency) against plain step-by-step formulas written independently here.

The references are naive float64 loops over rows, heads and positions, taken from
research/kda.md (sections 0, 2), research/glm5_blocks.md (2b, 3, 4) and DESIGN.md section 3;
they share no code with memra. Float32 blocks are compared with RTOL/ATOL; statements about
one float32 code path against itself (chunking, rollback) are bit-exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from memra.backend.numpy_ref import NumpyBackend
from memra.checkpoint import expected_tensors
from memra.errors import ResidencyError
from memra.model.cache import LatentPlane
from memra.model.kda import KdaMixer
from memra.model.mla import MlaMixer
from memra.model.trunk import Glm5Model

from .naive import (  # noqa: E402
    F32, MINI, SMALL, assert_close, f64, random_weights, rmsnorm, rows, sigmoid, silu, softmax, softplus, top_lowest_index,
)


# ---- KDA --------------------------------------------------------------------------------------

def kda_shapes(cfg):
    d, hk, dk, k = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    c = hk * dk
    return {"q_proj.weight": (c, d), "k_proj.weight": (c, d), "v_proj.weight": (c, d),
            "q_conv1d.weight": (c, 1, k), "k_conv1d.weight": (c, 1, k), "v_conv1d.weight": (c, 1, k),
            "f_a_proj.weight": (dk, d), "f_b_proj.weight": (c, dk), "A_log": (hk,), "dt_bias": (c,),
            "b_proj.weight": (hk, d), "g_a_proj.weight": (dk, d), "g_b_proj.weight": (c, dk),
            "o_norm.weight": (dk,), "o_proj.weight": (d, c)}


def naive_kda(W, x, cfg):
    """research/kda.md section 0 + 2, one row and one head at a time. Returns (out, S)."""
    W = {k: f64(v) for k, v in W.items()}
    x = f64(x)
    t_len, hk, dk, kk = x.shape[0], cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    lb = cfg.linear_lower_bound

    def conv_silu(part):
        u = x @ W[f"{part}_proj.weight"].T
        w = W[f"{part}_conv1d.weight"][:, 0, :]
        y = np.zeros_like(u)
        for t in range(t_len):
            for i in range(kk):  # causal cross-correlation, zero history
                if t - kk + 1 + i >= 0:
                    y[t] += w[:, i] * u[t - kk + 1 + i]
        return silu(y)

    q, k, v = conv_silu("q"), conv_silu("k"), conv_silu("v")
    S = np.zeros((hk, dk, dk))
    out = np.zeros((t_len, x.shape[1]))
    for t in range(t_len):
        f = W["f_b_proj.weight"] @ (W["f_a_proj.weight"] @ x[t])
        gate = W["g_b_proj.weight"] @ (W["g_a_proj.weight"] @ x[t])
        beta = sigmoid(W["b_proj.weight"] @ x[t])
        y = np.zeros(hk * dk)
        for h in range(hk):
            sl = slice(h * dk, (h + 1) * dk)
            qh = q[t, sl] / np.sqrt(np.sum(q[t, sl] ** 2) + 1e-6) * dk ** -0.5
            kh = k[t, sl] / np.sqrt(np.sum(k[t, sl] ** 2) + 1e-6)
            z = f[sl] + W["dt_bias"][sl]
            rate = np.exp(W["A_log"][h])
            g = lb * sigmoid(rate * z) if lb is not None else -rate * softplus(z)
            S[h] = S[h] * np.exp(g)[:, None]
            S[h] = S[h] + np.outer(kh, beta[h] * (v[t, sl] - S[h].T @ kh))
            o = S[h].T @ qh
            y[sl] = rmsnorm(o, W["o_norm.weight"], cfg.rms_norm_eps) * sigmoid(gate[sl])
        out[t] = W["o_proj.weight"] @ y
    return out, S


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["sigmoid_lower_bound_gate", "softplus_gate"])
def test_kda_mixer_matches_naive_delta_rule_formula(lower_bound):
    cfg = dataclasses.replace(SMALL, linear_lower_bound=lower_bound)
    W = random_weights(kda_shapes(cfg), seed=1)
    mixer = KdaMixer(NumpyBackend(), lambda n: W[n], cfg)
    x = rows(2, 13, cfg.hidden_size)
    st = mixer.new_state()
    got = mixer(x, st)
    want, S = naive_kda(W, x, cfg)
    assert_close(got, want)
    assert_close(st.state, S)


def test_kda_mixer_in_chunks_is_bit_identical_to_one_call():
    W = random_weights(kda_shapes(SMALL), seed=3)
    mixer = KdaMixer(NumpyBackend(), lambda n: W[n], SMALL)
    x = rows(4, 13, SMALL.hidden_size)
    whole, parts = mixer.new_state(), mixer.new_state()
    one = mixer(x, whole)
    chunked = np.concatenate([mixer(x[a:b], parts) for a, b in ((0, 5), (5, 6), (6, 13))])
    assert np.array_equal(one, chunked)
    assert np.array_equal(whole.state, parts.state) and np.array_equal(whole.ring, parts.ring)


def test_kda_l2norm_puts_eps_inside_the_sqrt():
    x = np.zeros((1, 1, 32), F32)
    x[0, 0, 0] = 1e-3  # sum x^2 = 1e-6 = eps: inside the sqrt gives 1/sqrt(2), outside ~1
    got = NumpyBackend().l2norm(x, 1e-6)
    assert got[0, 0, 0] == pytest.approx(1e-3 / np.sqrt(1e-6 + 1e-6), rel=1e-6)


# ---- kpool indexer ----------------------------------------------------------------------------

def naive_selection(q, w, pool_keys, p, pool, budget, scale):
    """glm5_blocks.md 2b for the row at position p: attended positions, ascending."""
    n = (p + 1) // pool
    if n <= budget:
        return list(range(p + 1))
    scores = [sum(w[h] * max(scale * float(f64(q[h]) @ f64(pool_keys[j])), 0.0) for h in range(len(w)))
              for j in range(n)]
    chosen = top_lowest_index(scores, budget)
    return [j * pool + m for j in chosen for m in range(pool)] + list(range(n * pool, p + 1))


def as_list(selection_row):
    return [int(i) for i in selection_row if i >= 0]


def test_kpool_select_matches_brute_force_top_pools_plus_tail():
    rng = np.random.default_rng(5)
    hi, di, pool, budget = 4, 16, 4, 2
    width = budget * pool + pool - 1
    keys = rng.standard_normal((13, di)).astype(F32)
    be, sparse_rows = NumpyBackend(), 0
    for pos0 in range(0, 50, 10):  # rows 0..49: dense up to p = 10, then 3..12 pools
        q = rng.standard_normal((10, hi, di)).astype(F32)
        w = rng.standard_normal((10, hi)).astype(F32)
        got = be.kpool_select(q, w, keys, pos0, pool, budget, width, di ** -0.5)
        for r in range(10):
            p = pos0 + r
            want = naive_selection(q[r], w[r], keys, p, pool, budget, di ** -0.5)
            assert as_list(got[r]) == want, p
            assert np.all(got[r, len(want):] == -1)
            sparse_rows += (p + 1) // pool > budget
    assert sparse_rows == 39  # the sparse regime really ran


def test_kpool_select_dense_regime_attends_every_position():
    be, di = NumpyBackend(), 8
    q, w = np.ones((11, 1, di), F32), np.ones((11, 1), F32)
    got = be.kpool_select(q, w, np.ones((3, di), F32), 0, 4, 2, 11, di ** -0.5)
    for p in range(11):  # n = (p+1)//4 <= 2 = budget
        assert as_list(got[p]) == list(range(p + 1))


def test_kpool_select_score_ties_go_to_the_lower_pool():
    be, di = NumpyBackend(), 4
    q, w = np.array([[[1, 0, 0, 0]]], F32), np.array([[1.0]], F32)
    # exactly representable scores 0.5*[1, 2, 1, 2, 2]: pools 1, 3, 4 tie for the best
    keys = np.array([[1, 0, 0, 0], [2, 0, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [2, 0, 0, 0]], F32)
    got = be.kpool_select(q, w, keys, 21, 4, 2, 11, di ** -0.5)
    assert as_list(got[0]) == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21]
    # every score relu-clamped to exactly 0: pools 0 and 1 win
    got = be.kpool_select(q, w, -keys, 21, 4, 2, 11, di ** -0.5)
    assert as_list(got[0]) == [0, 1, 2, 3, 4, 5, 6, 7, 20, 21]


def test_kpool_compress_is_per_channel_softmax_over_slots_of_gate_plus_ape():
    rng = np.random.default_rng(6)
    keys, gates = rng.standard_normal((2, 5, 4, 16)).astype(F32)
    ape = (0.5 * rng.standard_normal((4, 16))).astype(F32)
    got = NumpyBackend().kpool_compress(keys, gates, ape)
    want = np.zeros((5, 16))
    for j in range(5):
        for d in range(16):
            a = [float(gates[j, m, d]) + float(ape[m, d]) for m in range(4)]
            want[j, d] = sum(softmax(np.array(a))[m] * float(keys[j, m, d]) for m in range(4))
    assert_close(got, want)


# ---- MLA + indexer ----------------------------------------------------------------------------

def mla_shapes(cfg):
    d, h, rq, r = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dv, hi, di, p = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    return {"q_a_proj.weight": (rq, d), "q_a_layernorm.weight": (rq,), "q_b_proj.weight": (h * dn, rq),
            "kv_a_proj_with_mqa.weight": (r, d), "kv_a_layernorm.weight": (r,),
            "kv_b_proj.weight": (h * (dn + dv), r), "o_proj.weight": (d, h * dv),
            "indexer.wq_b.weight": (hi * di, rq), "indexer.wk.weight": (di, d),
            "indexer.k_norm.weight": (di,), "indexer.k_norm.bias": (di,),
            "indexer.weights_proj.weight": (hi, d), "indexer.index_kpool_compress_gate": (di, d),
            "indexer.index_kpool_compress_ape": (p, di)}


def naive_mla(W, x, cfg, attended):
    """Expanded-form NoPE MLA (glm5_blocks.md 1): k_nope = W_UK c, v = W_UV c per head; row p
    attends the positions attended(p) with softmax(q.k * qk_head_dim^-0.5)."""
    W = {k: f64(v) for k, v in W.items()}
    x, eps = f64(x), cfg.rms_norm_eps
    h, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    kv_b = W["kv_b_proj.weight"].reshape(h, dn + dv, -1)
    c = np.array([rmsnorm(W["kv_a_proj_with_mqa.weight"] @ xt, W["kv_a_layernorm.weight"], eps) for xt in x])
    out = np.zeros_like(x)
    for p in range(len(x)):
        qr = rmsnorm(W["q_a_proj.weight"] @ x[p], W["q_a_layernorm.weight"], eps)
        q = (W["q_b_proj.weight"] @ qr).reshape(h, dn)
        o = np.zeros(h * dv)
        for head in range(h):
            ks = [kv_b[head, :dn] @ c[j] for j in attended(p)]
            vs = [kv_b[head, dn:] @ c[j] for j in attended(p)]
            prob = softmax(np.array([q[head] @ kj for kj in ks]) * cfg.qk_head_dim ** -0.5)
            o[head * dv:(head + 1) * dv] = sum(pj * vj for pj, vj in zip(prob, vs))
        out[p] = W["o_proj.weight"] @ o
    return out


def naive_indexer_selection(W, x, cfg):
    """The kpool selection of every row from the layer input alone (glm5_blocks.md 2a, 2b)."""
    W = {k: f64(v) for k, v in W.items()}
    x, pool, hi, di = f64(x), cfg.index_kpool, cfg.index_n_heads, cfg.index_head_dim
    kk = W["indexer.wk.weight"] @ x.T  # [Di, T]
    mu, var = kk.mean(0), kk.var(0)
    k_idx = ((kk - mu) / np.sqrt(var + 1e-6)).T * W["indexer.k_norm.weight"] + W["indexer.k_norm.bias"]
    gates = x @ W["indexer.index_kpool_compress_gate"].T
    pks = np.array([(softmax(gates[j * pool:(j + 1) * pool] + W["indexer.index_kpool_compress_ape"], axis=0)
                     * k_idx[j * pool:(j + 1) * pool]).sum(0) for j in range(len(x) // pool)])
    out, margins = [], []
    for p in range(len(x)):
        qr = rmsnorm(W["q_a_proj.weight"] @ x[p], W["q_a_layernorm.weight"], cfg.rms_norm_eps)
        q = (W["indexer.wq_b.weight"] @ qr).reshape(hi, di)
        w = (W["indexer.weights_proj.weight"] @ x[p]) * hi ** -0.5
        out.append(naive_selection(q, w, pks, p, pool, cfg.index_pool_budget, di ** -0.5))
        n = (p + 1) // pool
        if n > cfg.index_pool_budget:
            s = sorted((sum(w[h] * max(di ** -0.5 * q[h] @ pks[j], 0) for h in range(hi)) for j in range(n)),
                       reverse=True)
            margins.append(s[cfg.index_pool_budget - 1] - s[cfg.index_pool_budget])
    return out, margins


def run_mla(cfg, W, x, chunks):
    mixer = MlaMixer(NumpyBackend(), lambda n: W[n], cfg, with_indexer=True)
    plane = mixer.new_plane(64)
    outs, sels = [], []
    for a, b in chunks:
        plane.check(a, cfg.index_kpool, "layer under test")
        o, s = mixer(x[a:b], plane, a, None)
        plane.advance(b, cfg.index_kpool)
        outs.append(o)
        sels += [as_list(r) for r in s]
    return np.concatenate(outs), sels


def test_mla_absorbed_decode_matches_expanded_causal_attention_in_dense_regime():
    W = random_weights(mla_shapes(SMALL), seed=7)
    x = rows(8, 11, SMALL.hidden_size)  # p+1 < (G+1)*P = 12: every row is dense
    got, sels = run_mla(SMALL, W, x, [(0, 5), (5, 6), (6, 11)])
    assert sels == [list(range(p + 1)) for p in range(11)]
    assert_close(got, naive_mla(W, x, SMALL, lambda p: range(p + 1)))


def test_mla_sparse_regime_attends_exactly_the_indexer_selection():
    W = random_weights(mla_shapes(SMALL), seed=9)
    x = rows(10, 30, SMALL.hidden_size)
    got, sels = run_mla(SMALL, W, x, [(0, 7), (7, 8), (8, 20), (20, 21), (21, 30)])
    want_sels, margins = naive_indexer_selection(W, x, SMALL)
    assert min(margins) > 1e-4  # fixture guard: no near-tie at the budget boundary
    assert sels == want_sels
    assert sum(len(s) < p + 1 for p, s in enumerate(sels)) == 19  # rows 11..29 are sparse
    assert_close(got, naive_mla(W, x, SMALL, lambda p: sels[p]))
    # the red arm beside it: dense attention is a different answer on the sparse rows
    assert not np.allclose(got[11:], naive_mla(W, x, SMALL, lambda p: range(p + 1))[11:], rtol=1e-3)



# ---- the residency tripwire -------------------------------------------------------------------

def test_latent_plane_with_pools_past_length_raises_residency_error_naming_index_pools_ready():
    plane = LatentPlane(latent=np.zeros((16, 4), F32), length=9, pools_ready=3)
    with pytest.raises(ResidencyError, match="index_pools_ready"):
        plane.check_residency(4, "layer 1")
    plane.pools_ready = 9 // 4
    plane.check_residency(4, "layer 1")  # the clamped value passes
    assert plane.pools_ready == 2


@pytest.fixture(scope="module")
def mini_model():
    return Glm5Model(MINI, random_weights(expected_tensors(MINI), seed=21), NumpyBackend())


def rolled_back_cache(model, tokens, keep, unclamped_layer=None):
    """Prime all tokens in one call, then roll every plane back to `keep` rows (KDA state from a
    cache that primed only `keep`); pools_ready is clamped except on `unclamped_layer`."""
    cache = model.new_cache(32)
    model.prime(tokens, cache)
    short = model.new_cache(32)
    model.prime(tokens[:keep], short)
    cache.pos = keep
    for i, st in short.kda.items():
        cache.kda[i].ring[...], cache.kda[i].state[...] = st.ring, st.state
    for i, plane in cache.mla.items():
        assert plane.pools_ready == len(tokens) // MINI.index_kpool
        plane.length = keep
        if i != unclamped_layer:
            plane.pools_ready = min(plane.pools_ready, keep // MINI.index_kpool)
    return cache, short


PROMPT = [3, 14, 15, 9, 26, 5, 31, 5, 8, 9, 7, 9, 3]


def test_decode_after_rollback_without_pool_clamp_raises_residency_error(mini_model):
    last_dsa = MINI.dsa_layers[-1]
    cache, _ = rolled_back_cache(mini_model, PROMPT, keep=9, unclamped_layer=last_dsa)
    with pytest.raises(ResidencyError, match=rf"layer {last_dsa}: index_pools_ready=3"):
        mini_model.decode_step(PROMPT[9], cache)


def test_decode_after_rollback_with_pool_clamp_equals_plain_decode(mini_model):
    cache, plain = rolled_back_cache(mini_model, PROMPT, keep=9)
    assert all(p.pools_ready == 2 for p in cache.mla.values())
    # new tokens past the rollback (rejected drafts replaced): pool 2 closes again at position
    # 11 and must be recomputed from the new rows, not the stale key of the rolled-back ones
    for tok in (7, 1, 2, 4):
        assert np.array_equal(mini_model.decode_step(tok, cache), mini_model.decode_step(tok, plain))
    for i, plane in cache.mla.items():
        assert plane.pools_ready == 3 and np.array_equal(plane.pool_keys[:3], plain.mla[i].pool_keys[:3])


def cache_snapshot(cache):
    kda = {i: (st.ring.copy(), st.state.copy()) for i, st in cache.kda.items()}
    mla = {i: (p.length, p.pools_ready, p.latent.copy()) for i, p in cache.mla.items()}
    return cache.pos, kda, mla


def test_residency_refusal_leaves_the_cache_as_it_was(mini_model):
    cache, _ = rolled_back_cache(mini_model, PROMPT, keep=9, unclamped_layer=MINI.dsa_layers[-1])
    pos, kda, mla = cache_snapshot(cache)
    with pytest.raises(ResidencyError):
        mini_model.decode_step(PROMPT[9], cache)
    pos2, kda2, mla2 = cache_snapshot(cache)
    assert pos2 == pos
    assert all(np.array_equal(a, b) for i in kda for a, b in zip(kda[i], kda2[i]))
    assert all(mla[i][:2] == mla2[i][:2] for i in mla)
