"""Plain float64 helpers for the block tests: independent of memra's code by construction."""

from __future__ import annotations


import numpy as np

from memra.config import ModelConfig, preset


RTOL, ATOL = 1e-5, 1e-6        # float32 block vs float64 reference (ATOL per unit of output scale)
SINKHORN_TOL = 1e-3            # doubly-stochastic residual after hc_sinkhorn_iters = 20
F32 = np.float32
SMALL = ModelConfig.from_dict(preset("small"))
MINI = ModelConfig.from_dict(preset("mini"))


# ---- plain float64 helpers -------------------------------------------------------------------

def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    return np.log1p(np.exp(x))


def softmax(x, axis=-1):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * (1.0 if w is None else w)


def top_lowest_index(scores, k):
    """The k best indices (ties to the lower index), ascending."""
    return sorted(sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:k])


def f64(a):
    return np.asarray(a, np.float64)


def assert_close(got, want):
    """RTOL/ATOL with the absolute part relative to the output's scale (max |want|, at least 1):
    float32 sums of large terms carry absolute rounding proportional to their magnitude."""
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * max(1.0, float(np.abs(want).max())))


def random_weights(shapes: dict, seed: int) -> dict:
    """float32 tensors: norms ~1+0.3N, linear ~N(0, 1/sqrt(fan_in)), embed ~N(0,1), the rest
    in the ranges their parameters take (research/kda.md 1b, glm5_blocks.md 3a, 4a)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        leaf = name.split(".")[-2] if name.endswith((".weight", ".bias")) else name.split(".")[-1]
        if name.endswith("norm.weight"):
            arr = 1.0 + 0.3 * rng.standard_normal(shape)
        elif name == "embed_tokens.weight":
            arr = rng.standard_normal(shape)
        elif leaf == "A_log":
            arr = rng.uniform(0.0, np.log(16.0), shape)
        elif leaf in ("dt_bias", "index_kpool_compress_ape") or name.endswith("_base"):
            arr = 0.5 * rng.standard_normal(shape)
        elif name.endswith("_scale"):
            arr = rng.uniform(0.5, 1.5, shape)
        elif name.endswith("k_norm.bias"):
            arr = 0.2 * rng.standard_normal(shape)
        elif leaf == "e_score_correction_bias":
            arr = rng.uniform(-0.1, 0.1, shape)
        elif leaf.endswith("conv1d"):
            arr = 0.5 * rng.standard_normal(shape)
        else:
            assert len(shape) == 2, name
            arr = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = arr.astype(F32)
    return out


def rows(seed, t, d, std=1.0):
    return (np.random.default_rng(seed).standard_normal((t, d)) * std).astype(F32)

