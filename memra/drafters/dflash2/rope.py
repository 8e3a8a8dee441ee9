"""Rotary position embedding for the drafter: plain NeoX RoPE or YaRN, at absolute positions.

The frequencies follow transformers' `_compute_rope_parameters` / `_compute_yarn_parameters`
(computed here in float64); YaRN's attention factor multiplies cos and sin, so it reaches both
q and k, exactly as the HF rotary module applies it. Rotation is NeoX `rotate_half`: the first
half of each head pairs with the second half.

    inv = inv_freq(cfg.rope, cfg.head_dim)                 # float64 [hd/2]
    cos, sin = cos_sin(inv, cfg.rope.mscale, positions)    # float32 [n, hd] (xp=cupy: on the device)
    q = apply_rope(q, cos, sin, xp)                        # q [n, heads, hd]
"""

from __future__ import annotations

import math

import numpy as np


def yarn_attention_factor(factor: float, mscale=None, mscale_all_dim=None) -> float:
    """YaRN's cos/sin scaling: 0.1*ln(factor)+1, or the DeepSeek mscale ratio when both given."""
    def get(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get(factor, mscale) / get(factor, mscale_all_dim))
    return float(get(factor))


def _yarn_correction_range(rope, dim: int) -> tuple[float, float]:
    def corr(rotations):
        orig = rope.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = corr(rope.beta_fast), corr(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def inv_freq(rope, head_dim: int) -> np.ndarray:
    """float64 [head_dim/2] inverse frequencies (YaRN-blended when rope.type == "yarn")."""
    exps = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    base = 1.0 / rope.theta ** exps
    if rope.type != "yarn":
        return base
    low, high = _yarn_correction_range(rope, head_dim)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    return (base / rope.factor) * (1.0 - extrapolation) + base * extrapolation


def cos_sin(inv, mscale: float, positions, xp=np):
    """float32 cos, sin [n, hd] for absolute `positions`, both scaled by mscale; inv and
    positions arrays of module xp (numpy or cupy), computed in float64."""
    angles = xp.asarray(positions).astype(np.float64)[:, None] * inv[None, :]
    angles = xp.concatenate([angles, angles], axis=1)
    return (xp.cos(angles) * mscale).astype(np.float32), (xp.sin(angles) * mscale).astype(np.float32)


def apply_rope(x, cos, sin, xp=np):
    """x [n, heads, hd] rotated with cos/sin [n, hd], all arrays of module xp (numpy or cupy)."""
    half = x.shape[-1] // 2
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
