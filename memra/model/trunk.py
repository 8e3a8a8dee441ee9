"""The glm5_next target: the mHC trunk of KDA / DSA-MLA layers, the final norm, the lm head,
and the NextN/MTP block.

    model = load_model(dir, backend="numpy")
    cache = model.new_cache(max_ctx)
    logits = model.prime(prompt_ids, cache)       # [vocab] after the last prompt token
    logits = model.decode_step(token_id, cache)   # [vocab] after that token

Every method checks its input before it touches the cache, so a refused call leaves it as it was.
"""

from __future__ import annotations

import functools

import numpy as np

from memra.arguments import check_tap_layers
from memra.config import KDA, ModelConfig
from memra.errors import CheckpointError, ContextOverflowError, InputError
from memra.limits import PRIME_CHUNK, VERIFY_CAP
from memra.memory import check_cache_fits

from memra.model import hyper
from memra.model.cache import Cache, VerifyCkpt
from memra.model.kda import KdaMixer
from memra.model.mla import MlaMixer
from memra.model.moe import DenseMlp, Moe
from memra.model.mtp import MtpBlock
from memra.model.tokens import NextToken, check_token_ids, host_id


class TrunkLayer:
    def __init__(self, be, weights: dict, cfg: ModelConfig, i: int):
        prefix = f"layers.{i}."
        w = lambda name: weights[prefix + name]
        self.index, self.kind = i, cfg.layer_types[i]
        self.name = f"layer {i}"
        self.attn_site = hyper.HcSite(be, weights, prefix + "hc_attn", cfg)
        self.ffn_site = hyper.HcSite(be, weights, prefix + "hc_ffn", cfg)
        self.in_norm = be.weight(w("input_layernorm.weight"))
        self.post_norm = be.weight(w("post_attention_layernorm.weight"))
        attn_w = lambda name: w("self_attn." + name)
        if self.kind == KDA:
            self.mixer = KdaMixer(be, attn_w, cfg)
        else:
            self.mixer = MlaMixer(be, attn_w, cfg, with_indexer=cfg.indexer_types[i] == "full")
            self.selection_from = cfg.indexer_source(i)
        mlp_w = lambda name: w("mlp." + name)
        self.ffn = DenseMlp(be, mlp_w, cfg.swiglu_limit) if cfg.mlp_layer_types[i] == "dense" else Moe(be, mlp_w, cfg)


class Glm5Model:
    chains_device_ids = True  # decode_next feeds a step's argmax to the next step where it lies

    def __init__(self, cfg: ModelConfig, weights: dict, backend):
        self.cfg, self.be = cfg, backend
        be = backend
        self.embed_table = be.weight(weights["embed_tokens.weight"])
        head = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        # the embedding table is gathered (float32); the head is a projection matrix
        self.lm_head = be.matrix(weights[head])
        self.final_norm = be.weight(weights["norm.weight"])
        self.layers = [TrunkLayer(be, weights, cfg, i) for i in range(cfg.num_hidden_layers)]
        self.mtp = MtpBlock(be, weights, cfg, self.embed_table, self.lm_head) if cfg.has_mtp else None

    # ---- cache -------------------------------------------------------------------------------
    def new_cache(self, max_ctx: int) -> Cache:
        if isinstance(max_ctx, bool) or not isinstance(max_ctx, (int, np.integer)) or max_ctx < 1:
            raise InputError(f"max_ctx must be a positive integer, got {max_ctx!r}")
        limit = self.cfg.max_position_embeddings
        if max_ctx > limit:
            raise InputError(
                f"max_ctx {max_ctx} exceeds the model's max_position_embeddings ({limit}); ask for less"
            )
        check_cache_fits(self.cfg, self.be, int(max_ctx))  # before a byte is allocated
        cache = Cache(config=self.cfg, max_ctx=int(max_ctx), owner=self, walks=self._new_walks())
        self._new_planes(cache, self.layers)
        return cache

    def _new_walks(self):
        return self.be.walks()

    def _walks_of(self, cache: Cache, index: int):
        """The walk runner of the cache that serves layer `index`."""
        return cache.walks

    def _new_planes(self, cache: Cache, layers) -> None:
        kda = [layer for layer in layers if layer.kind == KDA]
        if kda:
            part, states = kda[0].mixer.new_states(tuple(layer.index for layer in kda))
            cache.kda_parts.append(part)
            cache.kda.update({layer.index: st for layer, st in zip(kda, states)})
        for layer in layers:
            if layer.kind != KDA:
                cache.mla[layer.index] = layer.mixer.new_plane(cache.max_ctx)

    def _new_snapshots(self, layers, cache: Cache) -> None:
        """The KDA snapshot buffers of `layers`' parts, at the cache's first verify walk."""
        for part, first in self._kda_parts(cache, layers):
            first.mixer.new_snapshots(part)

    @staticmethod
    def _kda_parts(cache: Cache, layers) -> list:
        """(part, its first layer) for each KDA part of the cache whose layers `layers` hold."""
        by_index = {layer.index: layer for layer in layers}
        return [(part, by_index[part.layers[0]]) for part in cache.kda_parts if part.layers[0] in by_index]

    # ---- public steps ------------------------------------------------------------------------
    def prime(self, token_ids, cache: Cache) -> np.ndarray:
        """Prefill the prompt; returns float32 logits [vocab] after its last token."""
        return self.prime_rows(token_ids, cache)[0]

    def prime_rows(self, token_ids, cache: Cache, tap_layers=()):
        """prime, also returning the collapsed pre-final-norm rows [t, D] (the MTP h_seeds)
        and the contracted outputs of `tap_layers` ({layer: [t, D]}). A prompt of more than
        PRIME_CHUNK tokens walks PRIME_CHUNK rows at a time (its transient buffers stay bounded)."""
        tokens = self._check_tokens(token_ids, cache, "prime")
        layers = check_tap_layers(tap_layers, self.cfg.num_hidden_layers)
        rows, taps = [], {layer: [] for layer in layers}
        for start in range(0, len(tokens), PRIME_CHUNK):
            chunk, chunk_taps = tokens[start:start + PRIME_CHUNK], {layer: None for layer in layers}
            logits, collapsed = self.forward_rows(chunk, cache, taps=chunk_taps, replay=False)
            cache.pos += len(chunk)
            rows.append(self.be.copy(collapsed))
            for layer, tapped in chunk_taps.items():
                taps[layer].append(tapped)
        joined = lambda parts: parts[0] if len(parts) == 1 else self.be.concat(parts, axis=0)
        last = _finite_logits(self.be.to_host(logits[-1]))
        return last, joined(rows), {layer: joined(parts) for layer, parts in taps.items()}

    def decode_step(self, token_id, cache: Cache) -> np.ndarray:
        """Consume one token; returns float32 logits [vocab] for the next position."""
        return self.be.to_host(self._decode(token_id, cache, "decode_step"))

    def decode_logits(self, token_id, cache: Cache):
        """decode_step with the logits row [vocab] left where the backend keeps them (a sampled
        step filters and draws there: be.filtered_rows, be.race_draw)."""
        return self._decode(token_id, cache, "decode_step")

    def decode_greedy(self, token_id, cache: Cache) -> int:
        """decode_step for greedy decoding -> the next token: the argmax of the logits (the
        lowest index on ties), taken where they are, so one int crosses to the host."""
        return int(self.be.to_host(self.be.argmax(self._decode(token_id, cache, "decode_greedy"))))

    def decode_next(self, token, cache: Cache) -> NextToken:
        """decode_greedy without waiting for the token: the step is enqueued and its argmax
        taken on the device, then copied to the host behind it. `token` is an int or the
        NextToken of the step before, whose id stays where the backend keeps it, so a caller
        enqueues step n + 1 before it reads token n and the device never waits on the host."""
        ids = self.be.argmax(self._decode(token, cache, "decode_next")[None])
        return NextToken(ids, self.be.to_host_async(ids))

    def _decode(self, token, cache: Cache, what: str):
        """One decode walk -> the logits row [vocab] where the backend keeps it. `token`: an
        int, or a NextToken, whose id is read where it lies when the model chains device ids."""
        if isinstance(token, NextToken) and self.chains_device_ids:
            self._check_cache(cache, what)
            self._check_room(cache, 1)
            tokens = token.ids  # an argmax of this model's logits: inside the vocab
        else:
            tokens = self._check_tokens([host_id(token)], cache, what)
        logits, _ = self.forward_rows(tokens, cache)
        cache.pos += 1
        return logits[0]

    def verify_rows(self, token_ids, cache: Cache, tap_layers=()):
        """Score t <= 15 rows (row 0: the last committed token; then the drafts) in ONE walk
        at positions cache.pos.. -> (logits [t, V] host, collapsed [t, D], ckpt).

        Row r is bit-identical to the plain decode step that consumes token r there. Every
        plane advances t rows; cache.pos does not move: `rollback(cache, ckpt, keep)` commits.
        """
        logits, collapsed, ckpt = self._verify(token_ids, cache, tap_layers, "verify_rows")
        return self.be.to_host(logits), collapsed, ckpt

    def verify_logits(self, token_ids, cache: Cache, tap_layers=()):
        """verify_rows with the logits [t, V] left where the backend keeps them: a sampled accept
        filters them there and copies only what its walk reads (speculative.sampling.accept_walk)."""
        return self._verify(token_ids, cache, tap_layers, "verify_rows")

    def verify_greedy(self, token_ids, cache: Cache, tap_layers=()):
        """verify_rows for greedy acceptance -> (targets, collapsed [t, D], ckpt): targets[r] is
        the argmax of row r's logits (the lowest index on ties), taken where the logits are, so
        t ints cross to the host instead of t x vocab floats."""
        logits, collapsed, ckpt = self._verify(token_ids, cache, tap_layers, "verify_greedy")
        return self.be.to_host(self.be.argmax(logits)).tolist(), collapsed, ckpt

    def _verify(self, token_ids, cache: Cache, tap_layers, what: str):
        """The verify walk -> (logits [t, V] where the backend keeps them, collapsed rows, ckpt)."""
        tokens = self._check_tokens(token_ids, cache, what)
        taps = {layer: None for layer in check_tap_layers(tap_layers, self.cfg.num_hidden_layers)}
        if tokens.size > VERIFY_CAP:
            raise InputError(
                f"{what}: t={tokens.size} rows > cap {VERIFY_CAP}: at most {VERIFY_CAP - 1} "
                "drafts per round (K + 1 rows must stay inside the decode-exact class)"
            )
        self._new_snapshots(self.layers, cache)
        ckpt = VerifyCkpt(
            cache=cache, pos=cache.pos, rows=int(tokens.size),
            latent_len={i: plane.length for i, plane in cache.mla.items()},
            taps=taps,
        )
        logits, collapsed = self.forward_rows(tokens, cache, snapshots=True, taps=ckpt.taps)
        return logits, self.be.copy(collapsed), ckpt

    def rollback(self, cache: Cache, ckpt: VerifyCkpt, keep: int) -> None:
        """Commit the first `keep` rows of a verify walk (1 <= keep <= t) and undo the rest:
        latent planes truncate (pool keys clamped), KDA rings are copied back from the walk's
        per-row snapshots and states walked again from the ones it found through its kept rows
        (KdaPart.restore), cache.pos = snapshot + keep."""
        self._check_cache(cache, "rollback")
        if not isinstance(ckpt, VerifyCkpt) or ckpt.cache is not cache:
            raise InputError("rollback: this checkpoint was not taken on this cache by verify_rows")
        if ckpt.spent or cache.pos != ckpt.pos:
            raise InputError(
                f"rollback: the checkpoint is stale (taken at position {ckpt.pos}, the cache is at "
                f"{cache.pos}{', already rolled back' if ckpt.spent else ''}); roll back once, "
                "right after its verify_rows"
            )
        if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or not 1 <= keep <= ckpt.rows:
            raise InputError(
                f"rollback: keep={keep!r} outside 1..={ckpt.rows} (the anchor row is always kept; "
                "keep = accepted drafts + 1)"
            )
        self._rollback_layers(self.layers, cache, ckpt, int(keep))
        cache.pos = ckpt.pos + int(keep)
        ckpt.spent = True

    def _rollback_layers(self, layers, cache: Cache, ckpt: VerifyCkpt, keep: int) -> None:
        """`layers`' planes back to `keep` rows into the walk (0: where it found them, a rewind)."""
        if keep < ckpt.rows:  # each part's restore to `keep` replays a captured graph on CUDA
            for part, first in self._kda_parts(cache, layers):
                restore = functools.partial(part.restore, keep, self.be)
                self._walks_of(cache, first.index).steps(("restore", part.layers[0], keep), restore)
        for layer in layers:
            if layer.kind != KDA:
                plane = cache.mla[layer.index]
                plane.truncate(ckpt.latent_len[layer.index] + keep, self.cfg.index_kpool)

    def rewind(self, cache: Cache, ckpt: VerifyCkpt) -> None:
        """Put the cache back exactly where `ckpt`'s verify walk found it (cache.pos = ckpt.pos),
        right after that walk or right after its rollback. For callers that measure or probe a
        walk and must leave the sequence as it was (the benchmarks); a round always keeps its
        anchor row and uses `rollback`. The KDA snapshots may be buffers the next walk of that
        shape overwrites, so a later walk on the cache makes the checkpoint unusable here."""
        self._check_cache(cache, "rewind")
        if not isinstance(ckpt, VerifyCkpt) or ckpt.cache is not cache:
            raise InputError("rewind: this checkpoint was not taken on this cache by verify_rows")
        # untouched since: right after the walk every plane holds its t rows and pos has not
        # moved; right after rollback pos moved 1..t rows and the planes sit at pos
        kept = cache.pos - ckpt.pos
        ends = {i: plane.length - ckpt.latent_len[i] for i, plane in cache.mla.items()}
        fresh = not ckpt.spent and kept == 0 and all(e == ckpt.rows for e in ends.values())
        rolled = ckpt.spent and 1 <= kept <= ckpt.rows and all(e == kept for e in ends.values())
        if not (fresh or rolled):
            raise InputError(
                f"rewind: the checkpoint is stale (taken at position {ckpt.pos}, the cache is at "
                f"{cache.pos}{', already rewound' if ckpt.spent and kept == 0 else ''}); rewind once, "
                "right after its verify_rows or its rollback"
            )
        self._rollback_layers(self.layers, cache, ckpt, 0)
        cache.pos = ckpt.pos
        ckpt.spent = True

    # ---- the walk ----------------------------------------------------------------------------
    def forward_rows(self, tokens: np.ndarray, cache: Cache, snapshots: bool = False,
                     taps: dict | None = None, replay: bool = True):
        """One walk over t rows at positions cache.pos.. -> (logits [t, V], collapsed [t, D]);
        past VERIFY_CAP rows (a prompt) the logits are the last row's only, [1, V].

        Writes every state plane for the t rows; does not move cache.pos (the caller commits).
        `snapshots`: the KDA layers also write what a rollback needs (a verify walk; the
        cache's rollback buffers must exist, KdaPart). `taps` (layer -> None) is filled with
        each named layer's contracted output rows. With `replay` the cache's walk runner may
        replay a captured graph of this walk shape (a prefill passes False: its length
        varies). logits and collapsed may be the graph's buffers, which the shape's next walk
        overwrites; taps are copies the caller keeps.
        """
        self._check_cache(cache, "forward_rows")
        be, t = self.be, int(tokens.size)
        cache.check_planes()
        pos0, tap_layers = cache.pos, tuple(taps or ())
        logits, collapsed, tapped = self._run_walk(tokens, cache, snapshots, tap_layers, replay)
        for plane in cache.mla.values():
            plane.advance(pos0 + t, self.cfg.index_kpool)
        if taps is not None:
            taps.update({layer: be.copy(rows) for layer, rows in tapped.items()})
        return logits, collapsed

    def _run_walk(self, tokens, cache: Cache, snapshots: bool, tap_layers: tuple, replay: bool):
        """Run the walk through the cache's runner -> (logits, collapsed, taps)
        (a pipelined model runs it stage by stage instead: model/pipeline.py)."""
        walk = lambda tok, at: self._walk(tok, at, cache, snapshots, tap_layers)
        key = self._walk_key(tokens, snapshots, tap_layers, replay)
        return cache.walks.run(key, walk, tokens, cache.pos)

    def _walk_key(self, tokens, snapshots: bool, tap_layers: tuple, replay: bool):
        """The graph key of a walk: what fixes its launches (the rows, the snapshots, the taps),
        or None when it may not replay."""
        return (int(tokens.size), snapshots, tap_layers) if replay else None

    def _walk(self, tokens, at, cache: Cache, snapshots: bool, tap_layers: tuple):
        """The device work of a walk, from token ids and the first position (both as the
        backend reads them) -> (logits, collapsed, {tap layer: rows})."""
        streams = hyper.expand(self.be.embed(self.embed_table, tokens), self.cfg.hc_mult)
        tapped: dict = {}
        streams = self._walk_layers(self.layers, streams, at, cache, {}, snapshots, tap_layers, tapped)
        logits, collapsed = self._head(streams)
        return logits, collapsed, tapped

    def _walk_layers(self, layers, streams, at, cache: Cache, selections: dict, snapshots: bool,
                     tap_layers, tapped: dict):
        """`layers` in order over the streams (with `snapshots`, the KDA layers write their
        rollback snapshots); fills `selections` (indexer layer -> positions) and `tapped`
        (tap layer -> rows)."""
        for layer in layers:
            mix = lambda y: self._mix(layer, self._norm(y, layer.in_norm), cache, at, selections, snapshots)
            streams = layer.attn_site(streams, mix)
            streams = layer.ffn_site(streams, lambda y: layer.ffn(self._norm(y, layer.post_norm)))
            if layer.index in tap_layers:
                tapped[layer.index] = self.be.stream_mean(streams)
        return streams

    def _head(self, streams):
        """Final streams -> (logits, collapsed pre-final-norm rows). A walk of more rows than
        VERIFY_CAP is a prompt, whose caller reads the last row's logits only: it gets [1, V]."""
        collapsed = self.be.stream_mean(streams)
        rows = collapsed if collapsed.shape[0] <= VERIFY_CAP else collapsed[-1:]
        return self.be.linear(self._norm(rows, self.final_norm), self.lm_head), collapsed

    def _norm(self, x, w):
        return self.be.rmsnorm(x, w, self.cfg.rms_norm_eps)

    def _mix(self, layer: TrunkLayer, x, cache: Cache, at, selections: dict, snapshots: bool):
        if layer.kind == KDA:
            return layer.mixer(x, cache.kda[layer.index], snapshots)
        shared = selections.get(layer.selection_from)
        out, selections[layer.index] = layer.mixer(x, cache.mla[layer.index], at, shared)
        return out

    def _check_cache(self, cache, what: str) -> None:
        """A cache is bound to the model that made it: a twin with an identical config has
        other weights, and planes written under those would be read under these."""
        if not isinstance(cache, Cache):
            raise InputError(f"{what}: expected a cache from model.new_cache(max_ctx), got {type(cache).__name__}")
        if cache.owner is not self:
            raise InputError(f"{what}: this cache was made by another model (an identical config does not make "
                             "it this model's); create one with this model's new_cache(max_ctx)")

    def _check_tokens(self, token_ids, cache: Cache, what: str) -> np.ndarray:
        self._check_cache(cache, what)
        ids = check_token_ids(token_ids, self.cfg.vocab_size)
        self._check_room(cache, len(ids))
        return np.asarray(ids, dtype=np.int64)

    def _check_room(self, cache: Cache, n: int) -> None:
        if cache.pos + n > cache.max_ctx:
            raise ContextOverflowError(
                f"{n} more tokens at position {cache.pos} would pass max_ctx "
                f"{cache.max_ctx}; create the cache with a larger max_ctx"
            )


def _finite_logits(row: np.ndarray) -> np.ndarray:
    """The prompt's last logits row, or a CheckpointError: finite weights and config values can
    still overflow float32 inside the model, and every token chosen from such rows (NaN wins an
    argmax) would be garbage. Checked once a prompt, on the row the host reads anyway."""
    bad = ~np.isfinite(row)
    if bad.any():
        raise CheckpointError(f"the logits after the prompt are not finite ({int(bad.sum())} of {row.size} "
                              f"entries NaN or inf, the first at id {int(np.argmax(bad))}): the checkpoint's "
                              "weights or config values overflow float32 inside the model; check them")
    return row
