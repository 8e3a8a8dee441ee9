"""Shared by the backend test tables (numpy reference and CUDA twins): random op inputs and the
row-invariance check.

Float32 draws with no subnormals in practice (CuPy compiles with -ftz=true). A `make_*`
returns `make(rng, t) -> (row inputs with a leading t axis, shared inputs)`.
"""

import numpy as np

F32 = np.float32


def normal(rng, shape, std=1.0):
    return (rng.standard_normal(shape) * std).astype(F32)


def uniform(rng, shape, lo, hi):
    return rng.uniform(lo, hi, shape).astype(F32)


def make_linear(d_in, d_out, weight=normal):
    def make(rng, t):
        return {"x": normal(rng, (t, d_in))}, {"w": weight(rng, (d_out, d_in), d_in ** -0.5)}
    return make


def make_linears(d_in, d_outs, weight=normal):
    """One input and several weights (the projections that share it: be.linears)."""
    def make(rng, t):
        return {"x": normal(rng, (t, d_in))}, {f"w{i}": weight(rng, (d, d_in), d_in ** -0.5) for i, d in enumerate(d_outs)}
    return make


def linears(be, r, s):
    return tuple(be.linears(r["x"], [s[k] for k in sorted(s)]))


def make_head_linear(h, d_in, d_out, weight=normal):
    def make(rng, t):
        return {"x": normal(rng, (t, h, d_in))}, {"w": weight(rng, (h, d_out, d_in), d_in ** -0.5)}
    return make


def make_norm(shape, weighted=True, bias=False):
    def make(rng, t):
        shared = {"w": (1 + 0.3 * normal(rng, shape[-1:])).astype(F32) if weighted else None}
        if bias:
            shared["b"] = normal(rng, shape[-1:], 0.2)
        return {"x": normal(rng, (t, *shape), 2.0)}, shared
    return make


def make_rows(**shapes):
    """Row inputs only, N(0, std): `make_rows(x=(2, 32, 1.0))` draws x [t, 2, 32] with std 1."""
    def make(rng, t):
        return {k: normal(rng, (t, *s[:-1]), s[-1]) for k, s in shapes.items()}, {}
    return make


def mismatched_rows(full: tuple, alone: list[tuple]) -> list[tuple[int, int]]:
    """(row, output index) pairs where row r of the t-row outputs (host arrays) is not
    bit-identical to the row computed alone: compared as bytes, so -0.0 differs from 0.0.
    Shapes and dtypes must agree too."""
    bad = []
    for r, single in enumerate(alone):
        assert len(single) == len(full)
        for i, (a, b) in enumerate(zip(full, single)):
            assert b.shape == (1, *a.shape[1:]) and a.dtype == b.dtype, (a.dtype, b.dtype, a.shape, b.shape)
            if a[r].tobytes() != b[0].tobytes():
                bad.append((r, i))
    return bad


def attend_case(rng, t, h, rank, ctx, skip=0.3):
    """A prompt's absorbed attention at rows ctx - t .. ctx - 1: q_lat [t, h, rank] (half the
    rows leaning on a latent row, so some softmaxes are peaky), latent [ctx, rank] with per-channel
    gains (an RMSNorm's output), ascending position lists that skip a `skip` share of the earlier
    positions (row r always lists itself), -1 padded; the last row lists nothing."""
    latent = (rng.standard_normal((ctx, rank)) * rng.uniform(0.5, 2.0, rank)).astype(F32)
    q = rng.standard_normal((t, h, rank)) * 1.5
    q[: t // 2] += 0.6 * latent[rng.integers(0, ctx, (t // 2, h))]
    positions = np.full((t, ctx), -1, np.int32)
    for r in range(t - 1):
        at = ctx - t + r
        listed = np.flatnonzero(np.append(rng.random(at) >= skip, True))
        positions[r, : listed.size] = listed
    return q.astype(F32), latent, positions


def attend_reference(q, latent, positions, scale):
    """float64 absorbed attention: softmax over each row's listed positions of scale q . c_j,
    then sum_j p_j c_j; a row listing nothing gives zeros."""
    t, h, _ = q.shape
    out = np.zeros(q.shape, np.float64)
    for r in range(t):
        listed = positions[r][positions[r] >= 0]
        if listed.size:
            c = latent[listed].astype(np.float64)
            z = q[r].astype(np.float64) @ c.T * scale
            p = np.exp(z - z.max(axis=1, keepdims=True))
            out[r] = (p / p.sum(axis=1, keepdims=True)) @ c
    return out
