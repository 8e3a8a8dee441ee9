"""The NextN / MTP block: checkpoint layer `num_hidden_layers`, no mHC.

Row i pairs the next token with the trunk's collapsed pre-final-norm row h_i:
z = eh_proj([enorm(embed(tok_{i+1})); hnorm(h_i)]), then a DSA-MLA + MoE pre-norm residual
block over its own latent plane; logits = lm_head(shared_head.norm(z)). The returned carrier
is z before shared_head.norm: it chains into the next draft step as its h.
"""

from __future__ import annotations

from memra.errors import ResidencyError
from memra.model.mla import MlaMixer
from memra.model.moe import Moe


class MtpBlock:
    def __init__(self, be, weights: dict, cfg, embed, lm_head):
        prefix = f"layers.{cfg.num_hidden_layers}."
        w = lambda name: weights[prefix + name]
        self.be, self.cfg, self.embed, self.lm_head = be, cfg, embed, lm_head
        self.enorm, self.hnorm = be.weight(w("enorm.weight")), be.weight(w("hnorm.weight"))
        self.eh_proj = be.matrix(w("eh_proj.weight"))
        self.in_norm = be.weight(w("input_layernorm.weight"))
        self.post_norm = be.weight(w("post_attention_layernorm.weight"))
        self.head_norm = be.weight(w("shared_head.norm.weight"))
        self.attn = MlaMixer(be, lambda n: w("self_attn." + n), cfg, with_indexer=True)
        self.mlp = Moe(be, lambda n: w("mlp." + n), cfg)
        self.name = f"mtp layer {cfg.num_hidden_layers}"

    def new_plane(self, max_ctx: int):
        return self.attn.new_plane(max_ctx)

    def reset_plane(self, plane, length: int) -> None:
        """Drop the rows past `length` (a round's chain rows) and clamp the pool keys with them.
        A reset only ever shortens: rows the plane never held cannot be reset to."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= plane.length:
            raise ResidencyError(f"{self.name}: reset to {length!r} rows, and the plane holds {plane.length}; "
                                 "a reset only ever shortens the plane (to the committed boundary)")
        plane.truncate(length, self.cfg.index_kpool)

    def __call__(self, next_tokens, h, plane, pos0: int, head=None, walks=None, last_only: bool = False):
        """Rows (tok_{i+1}, h_i) at positions pos0.. -> (logits [t, V], carrier [t, D]).
        `head` replaces the trunk lm head (an FR-Spec trim projects through fewer rows).
        `walks` (a runner from be.walks(), one per plane) replays a captured graph per row
        count; its outputs are then the graph's buffers, overwritten by the next replay.
        `last_only`: the block past its attention (MoE, norm, head) runs on the last row alone,
        -> ([1, V], [1, D]): a draft step reads only that row, and at 8 kept rows the MoE would
        read some 5x the experts for rows nobody reads. The plane still takes every row, and the
        exact class gives the last row the bits a call over every row gives it."""
        pool, t = self.cfg.index_kpool, len(next_tokens)
        plane.check(pos0, pool, self.name)
        rows = lambda tok, at, h_rows: self._rows(tok, h_rows, plane, at, head, last_only)
        if walks is None:
            out = rows(next_tokens, self.be.position(pos0), h)
        else:
            out = walks.run((t, last_only), rows, next_tokens, pos0, h)
        plane.advance(pos0 + t, pool)
        return out

    def warm(self, next_tokens, h, plane, pos0: int) -> None:
        """Fill the plane's rows for these pairs; the rest of the block only feeds logits."""
        pool = self.cfg.index_kpool
        plane.check(pos0, pool, self.name)
        self._attend(next_tokens, h, plane, self.be.position(pos0))
        plane.advance(pos0 + len(next_tokens), pool)

    def _rows(self, next_tokens, h, plane, at, head, last_only: bool):
        be, eps = self.be, self.cfg.rms_norm_eps
        z, a = self._attend(next_tokens, h, plane, at)
        if last_only:
            z, a = z[-1:], a[-1:]
        z = be.add(z, a)
        z = be.add(z, self.mlp(be.rmsnorm(z, self.post_norm, eps)))
        logits = be.linear(be.rmsnorm(z, self.head_norm, eps), self.lm_head if head is None else head)
        return logits, z

    def _attend(self, next_tokens, h, plane, at):
        be, eps = self.be, self.cfg.rms_norm_eps
        e = be.rmsnorm(be.embed(self.embed, next_tokens), self.enorm, eps)
        z = be.linear(be.concat([e, be.rmsnorm(h, self.hnorm, eps)], axis=-1), self.eh_proj)
        a, _ = self.attn(be.rmsnorm(z, self.in_norm, eps), plane, at, None)
        return z, a
