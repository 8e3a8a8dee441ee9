"""The bytes a walk reads, counted from the arrays the model holds (bf16 counts 2 bytes, f32 4):
the weights of a trunk walk over some rows (routed experts by how many each MoE layer picked) and
the cache state it reads. The denominators of bench_decode's and bench_verify's bandwidth shares.

    weights = weight_bytes(model, [cfg.num_experts_per_tok] * moe_layer_count(model), rows=1)
    state = state_bytes(model, cache, rows=1)
    blocks = block_bytes(model, cfg.num_experts_per_tok)   # [(kind, bytes)] in walk order (step_blocks)
"""

from __future__ import annotations

from memra.model.kda import KdaMixer
from memra.model.moe import Moe
from memra.model.trunk import Glm5Model

ROUTED_STACKS = ("gate_w", "up_w", "down_w")  # Moe's [E, ...] expert stacks: only picked experts are read


def _is_array(v) -> bool:
    return all(hasattr(v, a) for a in ("nbytes", "shape", "dtype"))


def _block_bytes(block) -> tuple[int, int]:
    """(bytes of the arrays `block` and its sub-blocks read whole on every walk, bytes of one
    routed expert), from the arrays the block actually holds (so bf16 counts 2 bytes, f32 4)."""
    whole = per_expert = 0
    for name, v in vars(block).items():
        if _is_array(v):
            if isinstance(block, Moe) and name in ROUTED_STACKS:
                one = v.nbytes // v.shape[0]
                per_expert += one
                whole += one if block.shared_id >= 0 else 0  # the stacked shared expert, read every walk
            else:
                whole += v.nbytes
        elif type(v).__module__.startswith("memra.model."):
            w, e = _block_bytes(v)
            whole, per_expert = whole + w, per_expert + e
    return whole, per_expert


def moe_layer_count(model: Glm5Model) -> int:
    return sum(isinstance(layer.ffn, Moe) for layer in model.layers)


def weight_bytes(model: Glm5Model, experts_read: list[int], rows: int) -> dict[str, int]:
    """Weight bytes one trunk walk of `rows` tokens reads: every trunk layer's arrays once,
    experts_read[j] routed experts of the j-th MoE layer, the final norm and lm head, one embedding
    row per token. The MTP block is not part of a trunk walk."""
    assert len(experts_read) == moe_layer_count(model), "one expert count per MoE layer"
    trunk = routed = 0
    moe_layers = iter(experts_read)
    for layer in model.layers:
        whole, per_expert = _block_bytes(layer)
        trunk += whole
        if isinstance(layer.ffn, Moe):
            routed += next(moe_layers) * per_expert
    table = model.embed_table
    out = {
        "trunk": trunk, "routed_experts": routed,
        "lm_head": int(model.lm_head.nbytes + model.final_norm.nbytes),
        "embedding_rows": int(rows * table.nbytes // table.shape[0]),
    }
    return {k: int(v) for k, v in out.items()} | {"total": int(sum(out.values()))}


def block_bytes(model: Glm5Model, experts_read: int) -> list[tuple[str, int]]:
    """(kind, weight bytes) of each block of a one-row trunk walk, in walk order: each layer's
    attention block (its attention mHC site, input norm and mixer: "kda attention" or "mla
    attention"), then its FFN block (the FFN site, post-attention norm and FFN, with experts_read
    routed experts: "moe ffn", or "dense ffn"), and last "head" (final norm and lm head). With one
    embedding row they add up to weight_bytes' total for experts_read experts a MoE layer."""
    out = []
    for layer in model.layers:
        whole, _ = _block_bytes(layer)
        ffn_whole, per_expert = _block_bytes(layer.ffn)
        ffn = _block_bytes(layer.ffn_site)[0] + layer.post_norm.nbytes + ffn_whole
        out.append(("kda attention" if isinstance(layer.mixer, KdaMixer) else "mla attention", int(whole - ffn)))
        out.append(("moe ffn" if isinstance(layer.ffn, Moe) else "dense ffn", int(ffn + experts_read * per_expert)))
    out.append(("head", int(model.lm_head.nbytes + model.final_norm.nbytes)))
    return out


def state_bytes(model: Glm5Model, cache, rows: int, snapshot: bool = False) -> dict[str, int]:
    """Cache bytes one walk of `rows` tokens at cache.pos reads: each KDA layer's recurrent state
    and conv ring (once per walk; with `snapshot`, once more: the walk writes the state it
    found and the ring before each row, which a rollback reads back), each DSA row's attended
    latent rows, and the pool keys a full indexer scores once its rows see more pools than the
    budget."""
    cfg, pos = model.cfg, cache.pos
    pool, budget = cfg.index_kpool, cfg.index_pool_budget
    kda = sum(st.state.nbytes + st.ring.nbytes for st in cache.kda.values())
    latent = keys = 0
    for plane in cache.mla.values():
        row = plane.latent.nbytes // plane.latent.shape[0]
        for p in range(pos, pos + rows):
            seen = (p + 1) // pool
            latent += row * (p + 1 if seen <= budget else budget * pool + (p + 1) % pool)
        scored = (pos + rows) // pool
        if plane.pool_keys is not None and scored > budget:
            keys += rows * scored * (plane.pool_keys.nbytes // plane.pool_keys.shape[0])
    out = {"kda_state": kda, "mla_latent": latent, "index_pool_keys": keys}
    if snapshot:
        out["kda_snapshot"] = 2 * kda
    return {k: int(v) for k, v in out.items()} | {"total": int(sum(out.values()))}
