"""The mHC sites and the feed-forward blocks (MoE routing, SwiGLU) against plain step-by-step formulas written independently here.

The references are naive float64 loops over rows, heads and positions, taken from
research/kda.md (sections 0, 2), research/glm5_blocks.md (2b, 3, 4) and DESIGN.md section 3;
they share no code with memra. Float32 blocks are compared with RTOL/ATOL; statements about
one float32 code path against itself (chunking, rollback) are bit-exact.
"""

from __future__ import annotations


import numpy as np
import pytest

from memra.backend.numpy_ref import NumpyBackend
from memra.checkpoint import expected_tensors
from memra.model.hyper import HcSite
from memra.model.moe import DenseMlp, Moe

from .naive import (  # noqa: E402
    F32, MINI, RTOL, SINKHORN_TOL, SMALL, assert_close, f64, random_weights, rows, sigmoid, silu, softmax, top_lowest_index,
)


# ---- mHC --------------------------------------------------------------------------------------

def hc_site_weights(cfg, seed, std=0.5):
    n, d = cfg.hc_mult, cfg.hidden_size
    rng = np.random.default_rng(seed)
    m = (2 + n) * n
    return {"hc_fn": (rng.standard_normal((m, n * d)) * std / np.sqrt(n * d)).astype(F32),
            "hc_base": (0.5 * rng.standard_normal(m)).astype(F32),
            "hc_scale": rng.uniform(0.5, 1.5, 3).astype(F32)}


def naive_hc_weights(X, W, cfg, iters=None):
    """glm5_blocks.md 3a for one row X [n, D] (iters: Sinkhorn normalisations, default the config's)."""
    n, eps = cfg.hc_mult, cfg.hc_eps
    fn, base, scale = f64(W["hc_fn"]), f64(W["hc_base"]), f64(W["hc_scale"])
    v = f64(X).reshape(-1)
    m = (fn @ v) / np.sqrt(np.mean(v * v) + cfg.rms_norm_eps)
    pre = sigmoid(scale[0] * m[:n] + base[:n]) + eps
    post = 2 * sigmoid(scale[1] * m[n:2 * n] + base[n:2 * n])
    c = softmax(scale[2] * m[2 * n:].reshape(n, n) + base[2 * n:].reshape(n, n), axis=1) + eps
    c = c / (c.sum(0, keepdims=True) + eps)
    for _ in range((iters or cfg.hc_sinkhorn_iters) - 1):
        c = c / (c.sum(1, keepdims=True) + eps)
        c = c / (c.sum(0, keepdims=True) + eps)
    return pre, post, c


def test_hc_weights_comb_is_doubly_stochastic_with_bounded_pre_and_post():
    cfg, W = MINI, hc_site_weights(MINI, seed=11)
    X = rows(12, 8 * cfg.hc_mult, cfg.hidden_size, std=2.0).reshape(8, cfg.hc_mult, cfg.hidden_size)
    pre, post, comb = NumpyBackend().hc_weights(X, W["hc_fn"], W["hc_base"], W["hc_scale"],
                                               cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    # sums are ~1 - O(hc_eps) (each normalisation divides by sum + hc_eps), far inside the bound
    np.testing.assert_allclose(comb.sum(axis=2), 1.0, atol=SINKHORN_TOL)
    np.testing.assert_allclose(comb.sum(axis=1), 1.0, atol=SINKHORN_TOL)
    assert np.all(comb > 0)
    assert np.all((pre > cfg.hc_eps) & (pre < 1 + cfg.hc_eps)) and np.all((post > 0) & (post < 2))
    for r in range(len(X)):
        for got, want in zip((pre[r], post[r], comb[r]), naive_hc_weights(X[r], W, cfg)):
            assert_close(got, want)


def test_hc_weights_runs_exactly_hc_sinkhorn_iters_normalisations():
    # peaked logits: Sinkhorn is still moving at 20 iterations, so 19 or 21 would show
    cfg, W = MINI, hc_site_weights(MINI, seed=11, std=4.0)
    X = rows(12, 8 * cfg.hc_mult, cfg.hidden_size, std=2.0).reshape(8, cfg.hc_mult, cfg.hidden_size)
    _, _, comb = NumpyBackend().hc_weights(X, W["hc_fn"], W["hc_base"], W["hc_scale"],
                                           cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    want = {it: np.array([naive_hc_weights(x, W, cfg, it)[2] for x in X]) for it in (19, 20, 21)}
    assert_close(comb, want[20])
    assert not np.allclose(comb, want[19], rtol=1e-4) and not np.allclose(comb, want[21], rtol=1e-4)


def test_hc_combine_uses_comb_transposed():
    rng = np.random.default_rng(13)
    n, d = 4, 8
    X = rng.standard_normal((1, n, d)).astype(F32)
    f = rng.standard_normal((1, d)).astype(F32)
    post = np.array([[0.5, 1.0, 1.5, 0.25]], F32)
    comb = np.array([[[0.7, 0.3, 0, 0], [0, 0.5, 0.5, 0], [0, 0.2, 0.5, 0.3], [0.3, 0, 0, 0.7]]], F32)
    assert not np.array_equal(comb[0], comb[0].T)  # a check that would fail for C instead of C^T
    got = NumpyBackend().hc_combine(X, f, post, comb)
    C, Xs = f64(comb[0]), f64(X[0])
    want = np.array([post[0, b] * f64(f[0]) + sum(C[a, b] * Xs[a] for a in range(n)) for b in range(n)])
    wrong = np.array([post[0, b] * f64(f[0]) + sum(C[b, a] * Xs[a] for a in range(n)) for b in range(n)])
    assert_close(got[0], want)
    assert not np.allclose(got[0], wrong, atol=1e-2)


def test_hc_site_feeds_pre_weighted_sum_and_writes_post_f_plus_comb_transposed():
    cfg = MINI
    W = hc_site_weights(cfg, seed=14)
    site = HcSite(NumpyBackend(), {"s" + k[2:]: v for k, v in W.items()}, "s", cfg)
    M = rows(15, cfg.hidden_size, cfg.hidden_size, std=cfg.hidden_size ** -0.5)
    X = rows(16, 3 * cfg.hc_mult, cfg.hidden_size).reshape(3, cfg.hc_mult, cfg.hidden_size)
    got = site(X, lambda y: np.tanh(y @ M).astype(F32))
    for r in range(3):
        pre, post, C = naive_hc_weights(X[r], W, cfg)
        y = sum(pre[i] * f64(X[r, i]) for i in range(cfg.hc_mult))
        f = np.tanh(y @ f64(M))
        want = [post[b] * f + sum(C[a, b] * f64(X[r, a]) for a in range(cfg.hc_mult)) for b in range(cfg.hc_mult)]
        assert_close(got[r], np.array(want))


# ---- MoE and SwiGLU ---------------------------------------------------------------------------

def route(scores_logits, bias, scaling=2.5, k=2, n_group=1, topk_group=1):
    """moe_route on one row whose router logits are exactly `scores_logits` (x = e_0)."""
    e = len(scores_logits)
    x = np.zeros((1, 4), F32)
    x[0, 0] = 1.0
    w_gate = np.zeros((e, 4), F32)
    w_gate[:, 0] = scores_logits
    idx, wts = NumpyBackend().moe_route(x, w_gate, np.asarray(bias, F32), n_group, topk_group, k, True, scaling)
    return list(idx[0]), wts[0]


def test_moe_route_chooses_by_biased_score_but_weighs_by_unbiased_score():
    logits = np.array([2.0, 1.0, 0.0, -1.0], F32)
    assert route(logits, [0, 0, 0, 0])[0] == [0, 1]
    experts, wts = route(logits, [0, 0, 0, 1.0])  # the bias lifts expert 3 past 1
    assert experts == [0, 3]
    s = sigmoid(f64(logits))[[0, 3]]
    np.testing.assert_allclose(wts, s / s.sum() * 2.5, rtol=RTOL)


def test_moe_grouped_route_picks_only_from_group_with_best_top2_sum():
    # biased scores: group 0 = [.95 .3 .3 .3] (max .95, sum 1.85, top-2 sum 1.25);
    # group 1 = [.1 .7 .65 .1] (top-2 sum 1.35): only the top-2-sum rule keeps group 1
    target = np.array([0.95, 0.3, 0.3, 0.3, 0.1, 0.7, 0.65, 0.1])
    logits = np.linspace(-1.0, 1.0, 8).astype(F32)
    bias = target - sigmoid(f64(logits))
    experts, wts = route(logits, bias, n_group=2, topk_group=1)
    assert experts == [5, 6]
    s = sigmoid(f64(logits))[[5, 6]]
    np.testing.assert_allclose(wts, s / s.sum() * 2.5, rtol=RTOL)


def test_moe_route_ties_go_to_the_lower_index():
    flat = np.zeros(8, F32)  # sigmoid(0) = 0.5 exactly: every biased score is exact
    assert route(flat[:4], [0, 0.25, 0, 0])[0] == [0, 1]
    assert route(flat, [0, 0.25, 0, 0, 0, 0, 0.25, 0], n_group=2)[0] == [0, 1]  # tied groups: group 0
    assert route(flat, np.zeros(8), n_group=2)[0] == [0, 1]


def naive_swiglu(gate, up, limit):
    return silu(np.minimum(f64(gate), limit)) * np.clip(f64(up), -limit, limit)


def naive_moe(W, x, cfg):
    W = {k: f64(v) for k, v in W.items()}
    out = np.zeros((len(x), cfg.hidden_size))

    def mlp(p, xr):
        return W[p + "down_proj.weight"] @ naive_swiglu(
            W[p + "gate_proj.weight"] @ xr, W[p + "up_proj.weight"] @ xr, cfg.swiglu_limit)

    e, g = cfg.n_routed_experts, cfg.n_group
    for r, xr in enumerate(f64(x)):
        s = sigmoid(W["gate.weight"] @ xr)
        sb = s + W["gate.e_score_correction_bias"]
        group_score = [sum(sorted(sb[i * e // g:(i + 1) * e // g])[-2:]) for i in range(g)]
        keep = top_lowest_index(group_score, cfg.topk_group)
        masked = [sb[j] if j // (e // g) in keep else -np.inf for j in range(e)]
        chosen = top_lowest_index(masked, cfg.num_experts_per_tok)
        wts = s[chosen] / s[chosen].sum() * cfg.routed_scaling_factor
        out[r] = sum(wt * mlp(f"experts.{j}.", xr) for j, wt in zip(chosen, wts)) + mlp("shared_experts.", xr)
    return out


def test_moe_block_matches_naive_grouped_routing_and_shared_expert():
    W, x = _moe_inputs()
    assert_close(Moe(NumpyBackend(), lambda n: W[n], SMALL)(x), naive_moe(W, x, SMALL))


def _moe_inputs():
    shapes = {k[len("layers.1.mlp."):]: v for k, v in expected_tensors(SMALL).items() if k.startswith("layers.1.mlp.")}
    return random_weights(shapes, seed=17), rows(18, 12, SMALL.hidden_size, std=3.0)


def test_moe_stacks_the_shared_expert_and_routes_every_row_to_it_last():
    """The shared expert, stacked as expert E and routed to every row as slot k at weight 1, gives
    the bits of a separate shared MLP added after the routed sum (y * 1 is y, added last)."""
    W, x = _moe_inputs()
    be = NumpyBackend()
    stacked = Moe(be, lambda n: W[n], SMALL)
    assert stacked.shared is None and stacked.shared_id == SMALL.n_routed_experts
    assert stacked.gate_w.shape[0] == SMALL.n_routed_experts + 1
    separate = Moe(be, lambda n: W[n], SMALL)
    separate.shared_id, separate.shared = -1, DenseMlp(be, lambda n: W["shared_experts." + n], SMALL.swiglu_limit)
    assert np.array_equal(stacked(x), separate(x))


def test_red_arm_a_scaled_shared_slot_changes_the_moe_bits(monkeypatch):
    """The stacking test above can fail: a shared slot that took routed_scaling_factor (the routed
    experts' weight scale) instead of 1 changes every row."""
    W, x = _moe_inputs()
    be = NumpyBackend()
    want = Moe(be, lambda n: W[n], SMALL)(x)
    route = NumpyBackend.moe_route

    def scaled(self, *args, **kwargs):
        idx, wts = route(self, *args, **kwargs)
        wts[:, -1] = np.float32(SMALL.routed_scaling_factor)
        return idx, wts
    monkeypatch.setattr(NumpyBackend, "moe_route", scaled)
    got = Moe(be, lambda n: W[n], SMALL)(x)
    assert (got != want).any(axis=1).all()


def test_dense_mlp_matches_naive_clamped_swiglu():
    d, i = 64, 96
    W = random_weights({"gate_proj.weight": (i, d), "up_proj.weight": (i, d), "down_proj.weight": (d, i)}, seed=19)
    x = rows(20, 6, d, std=12.0)  # large enough that both clamps engage
    got = DenseMlp(NumpyBackend(), lambda n: W[n], 10.0)(x)
    Wd = {k: f64(v) for k, v in W.items()}
    want = [Wd["down_proj.weight"] @ naive_swiglu(Wd["gate_proj.weight"] @ xr, Wd["up_proj.weight"] @ xr, 10.0)
            for xr in f64(x)]
    assert_close(got, np.array(want))


def test_swiglu_clamps_gate_above_only_and_up_on_both_sides():
    gate = np.array([[-12.0, -12.0, 30.0, 30.0, 3.0, 3.0]], F32)
    up = np.array([[1.0, -30.0, 1.0, 30.0, -30.0, 5.0]], F32)
    got = NumpyBackend().swiglu(gate, up, 10.0)
    assert_close(got, naive_swiglu(gate, up, 10.0))
    assert got[0, 0] == pytest.approx(silu(-12.0), rel=1e-5)   # gate -12 passes unclamped
    assert got[0, 0] != pytest.approx(silu(-10.0), rel=1e-2)
    assert got[0, 2] == pytest.approx(silu(10.0), rel=1e-5)    # gate 30 -> 10
    assert got[0, 1] == pytest.approx(-10 * silu(-12.0), rel=1e-5) and got[0, 3] == pytest.approx(10 * silu(10.0))

