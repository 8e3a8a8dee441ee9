"""Manifold-constrained Hyper-Connections (mHC): the n-stream residual trunk.

Each layer has two sites (attn, ffn). A site computes pre/post weights and a doubly
stochastic mixing matrix C from the flattened streams, feeds the block sum_i pre_i X_i, and
writes back X' = post (x) f + C^T X. The trunk enters by repeating the embedding into n
streams and leaves by their unweighted mean.
"""

from __future__ import annotations


class HcSite:
    def __init__(self, be, weights: dict, prefix: str, cfg):
        self.be = be
        self.fn = be.weight(weights[prefix + "_fn"])
        self.base = be.weight(weights[prefix + "_base"])
        self.scale = be.weight(weights[prefix + "_scale"])
        self.rms_eps = cfg.rms_norm_eps
        self.hc_eps = cfg.hc_eps
        self.iters = cfg.hc_sinkhorn_iters

    def __call__(self, streams, block):
        """Run `block` (rows [t, D] -> [t, D]) through this site; return the new streams."""
        return self.be.hc_site(streams, self.fn, self.base, self.scale, self.rms_eps, self.hc_eps,
                               self.iters, block)


def expand(x, n: int):
    """[t, D] -> [t, n, D]: every stream starts as the embedding."""
    return x[:, None, :].repeat(n, axis=1)
