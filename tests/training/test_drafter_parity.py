"""The torch DFlash2 drafter that training/drafter.py trains computes what memra's numpy drafter
runs: a tiny random drafter (convs off the identity, a live selector, a learned mask row) for
memra's `small` target, exported as float32, gives the same block hidden rows, logits, selector
scores and greedy path in memra's DflashDraft as in torch, for the same context taps and anchor;
and through memra's `dflash2` source, the first proposal of a session is the torch walk.

Red arms beside each gate: one conv coefficient moved in the exported file, a causal block in
torch, and the source without the learned mask row each break the agreement.
"""

import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import memra  # noqa: E402
from memra.config import preset  # noqa: E402
from memra.drafters.dflash2 import DflashDraft, DFlash2Source  # noqa: E402
from memra.drafters.dflash2.selector import Selector, top_candidates  # noqa: E402
from memra.safetensors_io import read_safetensors, write_safetensors  # noqa: E402
from memra.speculative.session import SpecSession  # noqa: E402
from training.dflash2_torch import DFlash2Drafter, drafter_config  # noqa: E402
from training.export_drafter import MASK_FILE, export_drafter  # noqa: E402

TAPS = [1, 3, 4]
SHAPE = dict(target_layer_ids=TAPS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, selector_rank=16, selector_top_k=8)
N_CTX = 13
# float32 on both sides, different summation orders: agreement is ~1e-6 of the logit scale
TOL = 2e-4


@pytest.fixture(scope="module")
def target(fixture_dir):
    return memra.load_model(fixture_dir("small"), backend="numpy")


def randomized(drafter, seed=0):
    """Every drafter tensor random and O(1)-scaled: convs off the identity, selector gate live."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * (torch.rand(p.shape, generator=g) - 0.5))
            elif name.endswith("base_kernel"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
                p[:, 0] += 1.0
            elif p.ndim == 2 and not name.endswith("codebook"):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g))
    return drafter


@pytest.fixture(scope="module")
def pair(target, tmp_path_factory):
    """(torch drafter, its float32 export dir) borrowing the memra target's own tables."""
    cfg = drafter_config(preset("small"), **SHAPE)
    embed, head = torch.from_numpy(np.array(target.embed_table)), torch.from_numpy(np.array(target.lm_head))
    drafter = randomized(DFlash2Drafter(cfg, embed, head)).eval()
    out = export_drafter(drafter, tmp_path_factory.mktemp("drafter"), dtype="float32")
    return drafter, out


def torch_block(drafter, taps, anchor, causal=None):
    """(hidden [b, H], logits [b-1, V], path [b-1]) of one block after `taps` context rows."""
    with torch.no_grad():
        feats = drafter.context_features([torch.from_numpy(np.asarray(t)).unsqueeze(0) for t in taps])
        pos, ids = torch.tensor([[taps[0].shape[0]]]), torch.tensor([[anchor]])
        hidden = drafter(feats, pos, ids, causal=causal)[0, 0]
        logits = drafter.logits(hidden[1:])
        path = drafter.candidate_selector.greedy_walk(logits, hidden[1:], torch.tensor(anchor))
    return hidden.numpy(), logits.numpy(), path.tolist()


def memra_block(draft, taps, anchor):
    kv = draft.new_kv(64)
    draft.ingest(kv, draft.ctx_features(taps))
    c = draft.cfg
    hidden = draft.forward_block(kv, [anchor] + [c.mask_token_id] * (c.block_size - 1), start_pos=kv.len)
    logits = draft.logits(hidden[1:])
    sel = Selector(draft.sel_hidden_proj, draft.sel_pred, draft.sel_succ, c.selector_top_k)
    return hidden, logits, sel, sel.walk(logits, hidden[1:], anchor).path


def context_taps(seed=3):
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 1, (N_CTX, 64)).astype(np.float32) for _ in TAPS]


def gap(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1.0))


def load(target, out, drafter):
    return DflashDraft.load(out, target, precision="f32", mask_embedding=drafter.mask_embedding.detach().numpy())


# ---- the network -----------------------------------------------------------------------------------
def test_block_hidden_logits_and_path_match_memra(target, pair):
    drafter, out = pair
    draft = load(target, out, drafter)
    taps, anchor = context_taps(), 17
    t_hidden, t_logits, t_path = torch_block(drafter, taps, anchor)
    m_hidden, m_logits, _, m_path = memra_block(draft, taps, anchor)
    assert gap(t_hidden, m_hidden) < TOL and gap(t_logits, m_logits) < TOL
    assert t_path == m_path
    assert len(set(m_path)) > 1, "a degenerate path would match by accident"


def test_selector_scores_match_memra_for_a_teacher_forced_predecessor(target, pair):
    drafter, out = pair
    draft = load(target, out, drafter)
    taps, anchor = context_taps(5), 40
    _, m_logits, sel, _ = memra_block(draft, taps, anchor)
    hidden, logits, _ = torch_block(drafter, taps, anchor)
    z = sel.gate(hidden[1:])
    cs = drafter.candidate_selector
    with torch.no_grad():
        u, cand = cs.candidates(torch.from_numpy(logits))
        for slot, pred in enumerate([anchor, 3, 99, 250, 0, 7, 128]):
            m_u, m_cand = top_candidates(np.asarray(m_logits[slot], np.float64), sel.top_k)
            assert m_cand.tolist() == cand[slot].tolist()
            m_score = sel.scores(m_u, m_cand, z[slot], pred)
            t_score = cs.scores(u[slot], cand[slot], torch.from_numpy(hidden[1 + slot]), torch.tensor(pred))
            assert gap(t_score.numpy(), m_score) < TOL


def test_red_arm_a_moved_conv_coefficient_breaks_the_match(target, pair, tmp_path):
    drafter, out = pair
    bent = str(tmp_path / "bent")
    os.makedirs(bent)
    tensors = {n: a for n, (_, _, a) in read_safetensors(os.path.join(out, "model.safetensors")).items()}
    tensors["layers.1.mlp_conv.base_kernel"][1, 1, 5] += 0.25     # post-conv, tap 1, one channel
    write_safetensors(os.path.join(bent, "model.safetensors"), tensors, dtype="float32")
    with open(os.path.join(out, "config.json")) as f, open(os.path.join(bent, "config.json"), "w") as g:
        g.write(f.read())
    taps, anchor = context_taps(), 17
    _, t_logits, _ = torch_block(drafter, taps, anchor)
    _, m_logits, _, _ = memra_block(load(target, bent, drafter), taps, anchor)
    assert gap(t_logits, m_logits) > 20 * TOL


def test_red_arm_a_causal_block_breaks_the_match(target, pair):
    drafter, out = pair
    taps, anchor = context_taps(), 17
    _, t_logits, _ = torch_block(drafter, taps, anchor, causal=True)
    _, m_logits, _, _ = memra_block(load(target, out, drafter), taps, anchor)
    assert gap(t_logits, m_logits) > 20 * TOL


# ---- through memra's dflash2 source ------------------------------------------------------------------
def first_proposal(target, options):
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, 256, 21)]
    drafter = DFlash2Source().load(target, options)
    session = SpecSession(target, prompt, drafter, 96)
    state = session.state
    taps = [np.array(rows) for rows in state.pending[0]]
    return taps, state.anchor, state.propose(7, None).tokens


def test_the_source_drafts_the_torch_path_from_memra_taps(target, pair):
    drafter, out = pair
    taps, anchor, tokens = first_proposal(target, {"path": out, "mask_embedding": os.path.join(out, MASK_FILE)})
    assert [t.shape for t in taps] == [(21, 64)] * 3
    _, _, path = torch_block(drafter, taps, anchor)
    assert tokens == path


def test_the_source_reads_the_learned_mask_row_beside_the_weights(target, pair):
    drafter, out = pair
    taps, anchor, tokens = first_proposal(target, {"path": out})
    _, _, path = torch_block(drafter, taps, anchor)
    assert tokens == path


def test_red_arm_the_source_without_the_learned_mask_row_drafts_otherwise(target, pair, tmp_path):
    drafter, out = pair
    bare = shutil.copytree(out, tmp_path / "no-mask", ignore=shutil.ignore_patterns(MASK_FILE))
    taps, anchor, tokens = first_proposal(target, {"path": str(bare)})
    _, _, path = torch_block(drafter, taps, anchor)
    assert tokens != path


# ---- against the exported demo target ------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(memra target loaded from an exported tiny DemoTarget, the DemoTarget) on numpy, float32."""
    pytest.importorskip("safetensors")
    from training.drafter import smoke_target
    from training.export_target import export_target

    target = smoke_target(seed=0, vocab=256)
    out = export_target(target, str(tmp_path_factory.mktemp("demo-target")), dtype="float32")
    return memra.load_model(out, backend="numpy"), target


def stage_drafter(demo_target, tables=None):
    """A randomized drafter the way training/drafter.py builds it (the target's borrowed tables)."""
    from training.drafter import build_drafter

    drafter = randomized(build_drafter(demo_target, smoke=True), seed=4).eval()
    if tables is not None:
        drafter.embed.copy_(tables[0])
        drafter.lm_head.copy_(tables[1])
    return drafter


def test_the_stage_drafter_drafts_the_same_through_memra_on_the_exported_demo_target(demo, tmp_path):
    model, demo_target = demo
    drafter = stage_drafter(demo_target)
    out = export_drafter(drafter, tmp_path / "drafter", dtype="float32")
    taps, anchor, tokens = first_proposal(model, {"path": out, "mask_embedding": os.path.join(out, MASK_FILE)})
    _, _, path = torch_block(drafter, taps, anchor)
    assert tokens == path and len(set(path)) > 1


def test_red_arm_a_drafter_borrowing_the_wrong_tables_drafts_otherwise(demo, tmp_path):
    model, demo_target = demo
    table = demo_target.trunk.embed_tokens.weight.detach()
    drafter = stage_drafter(demo_target, tables=(table, table))      # the embedding as its lm head
    out = export_drafter(drafter, tmp_path / "drafter", dtype="float32")
    taps, anchor, tokens = first_proposal(model, {"path": out, "mask_embedding": os.path.join(out, MASK_FILE)})
    _, _, path = torch_block(drafter, taps, anchor)
    assert tokens != path
