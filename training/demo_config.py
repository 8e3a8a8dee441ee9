"""The demo model's shapes: one place the training stages and the export read them from.

The target is a glm5_next config dict (memra.presets style) with every layer kind memra runs:
KDA, DSA-MLA with a full indexer (layers 2 and 7) and a shared one (layer 3, right after its
full layer: the only placement transformers can run), dense and MoE FFNs with grouped routing,
mHC, and one NextN/MTP layer. Sizes follow research/training.md's recipe, shrunk so target and
drafter ship in <= 40 MB of bf16: MoE experts 128 wide (the recipe's 256 would be ~36 MB alone).
"""

from __future__ import annotations

from memra.presets import preset

VOCAB = 8192
SPECIALS = ("<|endoftext|>", "<|mask|>", "<|pad|>")   # ids 0, 1, 2 in the tokenizer
EOS_ID, MASK_ID, PAD_ID = 0, 1, 2
SEQ_LEN = 1024

_K, _D = "linear_attention", "indexed_attention"
_LAYERS = [_K, _K, _D, _D, _K, _K, _K, _D]


def target_config() -> dict:
    base = preset("small")
    kda = [i for i, kind in enumerate(_LAYERS) if kind == _K]
    dsa = [i for i, kind in enumerate(_LAYERS) if kind == _D]
    base.update(
        num_hidden_layers=len(_LAYERS),
        hidden_size=256,
        intermediate_size=768,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        layer_types=list(_LAYERS),
        mlp_layer_types=["dense"] + ["sparse"] * (len(_LAYERS) - 1),
        indexer_types=["shared" if i == 3 else "full" for i in range(len(_LAYERS))],
        linear_attn_config={**base["linear_attn_config"], "num_heads": 4, "head_dim": 64,
                            "kda_layers": kda, "full_attn_layers": dsa},
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=64,
        qk_rope_head_dim=0,
        v_head_dim=64,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=256,      # 64 pools of 4: attention turns sparse past position ~260
        index_kpool=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.0,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return base


# The DFlash2 drafter (research/training.md section 6): 2 layers at D=256, block 8 (7 drafts),
# taps spread over the 8-layer trunk, grouped conv kernel 2, group 16, selector rank 64, top-K 16.
DRAFTER = {
    "num_hidden_layers": 2,
    "block_size": 8,
    "target_layer_ids": [1, 3, 5],
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 64,
    "selector_top_k": 16,
    "mask_token_id": MASK_ID,
}
