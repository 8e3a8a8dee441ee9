"""bench_ops' peers compute memra's math: each against the numpy reference, with a red arm.

The MLA, norm, mHC and routing peers run on CPU torch. The fla peer needs Triton, so it runs on a CUDA device with the
fla-core wheel importable (the GPU host: `pytest -m gpu`) and skips elsewhere.
No __init__.py in this folder: one would make `benchmarks` name this folder, not the scripts'.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks.peers import (  # noqa: E402
    fla_inputs, hc_collapse_torch, hc_combine_torch, kda_fla, max_rel_diff, mla_attend_torch, moe_route_torch,
    rmsnorm_torch,
)
from memra.backend.numpy_ref import NumpyBackend  # noqa: E402

F32 = np.float32


def _mla_case(rng, t=3, heads=4, rank=32, ctx=50, width=20):
    """Rows attend 20, 13 and 1 positions (ascending, -1 padded), like kpool_select's output."""
    q = rng.standard_normal((t, heads, rank)).astype(F32)
    latent = rng.standard_normal((ctx, rank)).astype(F32)
    positions = np.full((t, width), -1, np.int32)
    for r, n in enumerate((width, 13, 1)[:t]):
        positions[r, :n] = np.sort(rng.choice(ctx, n, replace=False))
    return q, latent, positions


def test_mla_attend_torch_matches_numpy_reference():
    q, latent, positions = _mla_case(np.random.default_rng(0))
    ref = NumpyBackend().mla_attend(q, latent, positions, 0.25)
    ours = mla_attend_torch(*map(torch.from_numpy, (q, latent, positions)), 0.25)
    assert max_rel_diff(ours, torch.from_numpy(ref)) < 1e-5


def test_mla_attend_torch_red_arm_padding_attended_breaks_agreement():
    """Padding slots read as position 0 (unmasked) change the rows that have padding."""
    q, latent, positions = _mla_case(np.random.default_rng(0))
    ref = NumpyBackend().mla_attend(q, latent, positions, 0.25)
    unmasked = torch.from_numpy(np.maximum(positions, 0))
    ours = mla_attend_torch(torch.from_numpy(q), torch.from_numpy(latent), unmasked, 0.25)
    assert max_rel_diff(ours, torch.from_numpy(ref)) > 1e-2


def test_fla_inputs_keep_memra_math():
    t, h, dk, dv = 2, 3, 4, 5
    args = fla_inputs(torch.zeros(t, h, dk), torch.zeros(t, h, dk), torch.zeros(t, h, dv),
                      torch.zeros(t, h, dk), torch.zeros(t, h), torch.zeros(h, dk, dv))
    assert args["q"].shape == args["g"].shape == (1, t, h, dk) and args["v"].shape == (1, t, h, dv)
    assert args["beta"].shape == (1, t, h) and args["initial_state"].shape == (1, h, dk, dv)
    assert args["scale"] == 1.0 and args["output_final_state"] and not args["state_v_first"]
    assert not (args["use_qk_l2norm_in_kernel"] or args["use_gate_in_kernel"]
                or args["use_beta_sigmoid_in_kernel"])


def kda_case(rng, t=5, heads=3, dk=32, dv=64):
    """Inputs as the model hands them to kda_recurrence: unit q, k; log-decay g < 0; beta in (0, 1).
    dk != dv so a transposed state layout cannot pass."""
    def unit(a):
        return (a / np.sqrt((a * a).sum(-1, keepdims=True) + F32(1e-6))).astype(F32)
    q = unit(rng.standard_normal((t, heads, dk)).astype(F32))
    k = unit(rng.standard_normal((t, heads, dk)).astype(F32))
    v = rng.standard_normal((t, heads, dv)).astype(F32)
    g = (-np.abs(rng.standard_normal((t, heads, dk))) * F32(0.1)).astype(F32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((t, heads))))).astype(F32)
    state = rng.standard_normal((heads, dk, dv)).astype(F32)
    return q, k, v, g, beta, state


def kda_fla_diffs(device: str, run=kda_fla) -> tuple[float, float]:
    """(max rel diff of o, of the final state) of run(q, k, v, g, beta, state) on `device`
    against NumpyBackend.kda_recurrence."""
    q, k, v, g, beta, state = kda_case(np.random.default_rng(1))
    ref_state = state.copy()
    ref_o = NumpyBackend().kda_recurrence(q, k, v, g, beta, ref_state)
    o, final = run(*(torch.from_numpy(a).to(device) for a in (q, k, v, g, beta, state)))
    return (max_rel_diff(o.cpu(), torch.from_numpy(ref_o)),
            max_rel_diff(final.cpu(), torch.from_numpy(ref_state)))


def fla_default_scale(q, k, v, g, beta, state):
    """The red arm: fla's own default scale (K^-0.5 on q), which memra's recurrence does not apply."""
    from fla.ops.kda import fused_recurrent_kda

    o, final = fused_recurrent_kda(**{**fla_inputs(q, k, v, g, beta, state), "scale": None})
    return o[0], final[0]


def _cuda_with_fla():
    pytest.importorskip("fla.ops.kda")
    if not torch.cuda.is_available():
        pytest.skip("fla's Triton kernels need a CUDA device")
    return "cuda"


@pytest.mark.gpu
def test_kda_fla_matches_numpy_reference():
    o_diff, state_diff = kda_fla_diffs(_cuda_with_fla())
    assert o_diff < 1e-4 and state_diff < 1e-4, (o_diff, state_diff)


@pytest.mark.gpu
def test_kda_fla_red_arm_default_scale_breaks_agreement():
    o_diff, _ = kda_fla_diffs(_cuda_with_fla(), fla_default_scale)
    assert o_diff > 1e-2


def _decode_case(rng, t=3, n=4, d=16, e=8):
    f = lambda *s: rng.standard_normal(s).astype(F32)  # noqa: E731
    pre, post, comb = f(t, n), f(t, n), f(t, n, n)
    return f(t, d), f(d), f(t, n, d), pre, post, comb, f(e, d), f(e) * F32(0.1)


def test_rmsnorm_and_hc_torch_forms_match_numpy_reference():
    x, w, streams, pre, post, comb, _, _ = map(torch.from_numpy, _decode_case(np.random.default_rng(2)))
    be, a = NumpyBackend(), lambda t: t.numpy()  # noqa: E731
    pairs = [(rmsnorm_torch(x, w, 1e-5), be.rmsnorm(a(x), a(w), 1e-5)),
             (hc_collapse_torch(streams, pre), be.hc_collapse(a(streams), a(pre))),
             (hc_combine_torch(streams, x, post, comb), be.hc_combine(a(streams), a(x), a(post), a(comb)))]
    for ours, ref in pairs:
        assert max_rel_diff(ours, torch.from_numpy(ref)) < 1e-5


def test_hc_combine_torch_red_arm_untransposed_mixing_breaks_agreement():
    x, _, streams, _, post, comb, _, _ = map(torch.from_numpy, _decode_case(np.random.default_rng(2)))
    ref = NumpyBackend().hc_combine(streams.numpy(), x.numpy(), post.numpy(), comb.numpy())
    untransposed = hc_combine_torch(streams, x, post, comb.transpose(1, 2))
    assert max_rel_diff(untransposed, torch.from_numpy(ref)) > 1e-2


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (4, 2)])
def test_moe_route_torch_matches_numpy_reference(n_group, topk_group):
    x, _, _, _, _, _, w_gate, bias = _decode_case(np.random.default_rng(3))
    ref_idx, ref_wts = NumpyBackend().moe_route(x, w_gate, bias, n_group, topk_group, 2, True, 2.5)
    idx, wts = moe_route_torch(*map(torch.from_numpy, (x, w_gate, bias)), n_group, topk_group, 2, True, 2.5)
    assert np.array_equal(idx.numpy(), ref_idx) and max_rel_diff(wts, torch.from_numpy(ref_wts)) < 1e-6


def test_moe_route_torch_red_arm_choosing_without_the_bias_picks_other_experts():
    x, _, _, _, _, _, w_gate, bias = _decode_case(np.random.default_rng(3))
    ref_idx, _ = NumpyBackend().moe_route(x, w_gate, bias * F32(100), 1, 1, 2, True, 2.5)
    idx, _ = moe_route_torch(*map(torch.from_numpy, (x, w_gate, 0 * bias)), 1, 1, 2, True, 2.5)
    assert not np.array_equal(idx.numpy(), ref_idx)
