"""The peers bench_ops times memra's ops against: the same math in someone else's code.

    o, state = kda_fla(q, k, v, g, beta, state)        # fla's fused_recurrent_kda (Triton)
    o_lat = mla_attend_torch(q_lat, latent, positions, scale)  # gather + einsum + softmax
    y = rmsnorm_torch(x, w, eps)                       # and hc_collapse_torch, hc_combine_torch,
    idx, wts = moe_route_torch(x, w_gate, bias, ...)   # the decode ops with a short torch form

Each takes and returns torch tensors in memra's layouts and means exactly what the NumpyBackend
method of the same name means (backend/numpy_ref.py). No cupy here, so
tests/benchmarks/test_peers.py checks them against the numpy reference; bench_ops hands them its
cupy arrays as zero-copy torch views. fla (the fla-core wheel) is imported only when kda_fla is
called.
"""

from __future__ import annotations

import torch


def fla_inputs(q, k, v, g, beta, state) -> dict:
    """fused_recurrent_kda's keyword arguments for memra's kda_recurrence(q, k, v, g, beta, state).

    The convention mapping, read in fla-core 0.6.0 fla/ops/kda/fused_recurrent.py
    (fused_recurrent_kda and fused_recurrent_kda_fwd_kernel):
    * layout: fla is time-major with a batch axis, q, k, g [B, T, H, K], v [B, T, HV, V],
      beta [B, T, HV]; memra's t rows of [Hk, .] are one sequence, so B = 1, T = t, HV = H.
    * state: fla's default [N, HV, K, V] (state_v_first=False) is memra's [Hk, dk, dv] with N = 1.
      fla reads it as initial_state and returns a fresh fp32 final_state; memra advances in place.
    * scale: kda_recurrence applies none (the model scales q by dk^-0.5 before the call), while
      fla's default multiplies q by K^-0.5; so scale=1.0.
    * q and k arrive L2-normalised, g is the log-decay, beta a probability: the three *_in_kernel
      flags stay False (no L2 norm, no gate activation, no beta sigmoid inside fla's kernel).
    * the step is the same: S *= exp(g)[:, None]; u = beta (v - S^T k); S += k u^T; o = S^T q,
      in fp32 registers, o stored in v's dtype.
    """
    return {
        "q": q[None], "k": k[None], "v": v[None], "g": g[None], "beta": beta[None],
        "initial_state": state[None], "output_final_state": True, "scale": 1.0,
        "use_qk_l2norm_in_kernel": False, "use_gate_in_kernel": False,
        "use_beta_sigmoid_in_kernel": False, "state_v_first": False,
    }


def kda_fla(q, k, v, g, beta, state):
    """fla's fused_recurrent_kda on memra's inputs -> (o [t, Hk, dv], final state [Hk, dk, dv]).
    The state passed in is left unchanged."""
    from fla.ops.kda import fused_recurrent_kda

    o, final = fused_recurrent_kda(**fla_inputs(q, k, v, g, beta, state))
    return o[0], final[0]


def mla_attend_torch(q_lat, latent, positions, scale: float):
    """NumpyBackend.mla_attend in torch ops: o_lat [t, H, R] = sum_j softmax_j(scale q . c_j) c_j.

    q_lat [t, H, R] float32; latent [len, R]; positions [t, W] int, -1 padded (each row needs at
    least one position). The padding slots gather row 0 and are masked out of the softmax.
    """
    pos = positions.long()
    c = latent[pos.clamp(min=0)]  # [t, W, R]: each row's selected latent rows, shared by the heads
    scores = torch.einsum("thr,twr->thw", q_lat, c) * scale
    scores = scores.masked_fill((pos < 0)[:, None, :], float("-inf"))
    return torch.einsum("thw,twr->thr", torch.softmax(scores, dim=-1), c)


def rmsnorm_torch(x, w, eps: float):
    """NumpyBackend.rmsnorm with a weight: x / sqrt(mean(x^2) + eps) * w over the last axis."""
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def hc_collapse_torch(streams, pre):
    """sum_i pre_i X_i: [t, n, D] -> [t, D]."""
    return torch.einsum("tn,tnd->td", pre, streams)


def hc_combine_torch(streams, f, post, comb):
    """X'_b = post_b f + sum_a C[a, b] X_a (C transposed)."""
    return post[:, :, None] * f[:, None, :] + torch.einsum("tab,tad->tbd", comb, streams)


def moe_route_torch(x, w_gate, bias, n_group: int, topk_group: int, k: int, renormalize: bool, scaling: float):
    """NumpyBackend.moe_route: choose by sigmoid score + bias among the topk_group groups with the
    largest top-2 sums, weigh by the unbiased score -> (experts [t, k] ascending, weights [t, k])."""
    scores = torch.sigmoid(x @ w_gate.T)
    t, e = scores.shape
    groups = (scores + bias).view(t, n_group, e // n_group)
    kept = groups.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    mask = torch.zeros(t, n_group, dtype=torch.bool, device=x.device).scatter_(1, kept, True)
    choice = groups.masked_fill(~mask[:, :, None], float("-inf")).view(t, e)
    idx = choice.topk(k, dim=-1).indices.sort(dim=-1).values
    wts = scores.gather(1, idx)
    if renormalize:
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    return idx, wts * scaling


def max_rel_diff(ours, ref) -> float:
    """max |ours - ref| / max |ref|: one number for how far two outputs of the same math drift."""
    return float((ours - ref).abs().max() / ref.abs().max())
