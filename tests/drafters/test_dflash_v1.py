"""DFlash v1 and DSpark checkpoints in the seed's format (no dynamic convs, no candidate selector)
load through the `dflash2` source by tensor census and draft each harvested row on its own.

* the census names the family; a checkpoint with only part of the DFlash2 extras is refused;
* the block forward is the plain pre-norm residual stack (a float64 re-implementation);
* greedy drafts are each row's argmax plus the markov bias of its realized predecessor, sampled
  q is the dense filtered row the draft was drawn from (both against a from-the-rows reference);
* the greedy tape is the plain tape for every K and under forced acceptance patterns.
"""

import numpy as np
import pytest

from memra.config import preset
from memra.drafters.dflash2 import DFlash2Source, DflashDraft, write_fixture_drafter
from memra.errors import CheckpointError
from memra.generate import generate
from memra.speculative.contract import DenseQ
from memra.speculative.sampling import SamplingParams, filtered_probs
from memra.speculative.session import GateInstruments, SpecSession
from tests.speculative.battery import Oracle, run_bursts

from .dflash2_helpers import F32, TAPS, ctx_rows, drafter_maker, rewrite
from .test_dflash2_model import _f64, _naive_attention, _naive_mlp, _naive_norm

PROMPT_LEN, MAX_CTX, N = 16, 160, 20
VARIANTS = {   # the seed's two checkpoint kinds: a z-lab DFlash v1 and a DSpark (q38 arm-a) export
    "v1": {"strategy": "dflash"},
    "dspark": {"strategy": "dspark", "with_markov": True, "with_confidence": True},
}


@pytest.fixture(scope="module")
def model(trunk):
    return trunk


@pytest.fixture(scope="module")
def path(model, tmp_path_factory):
    return drafter_maker(model, tmp_path_factory, "v1", 4, VARIANTS, family="dflash")


@pytest.fixture(scope="module")
def prompt(model):
    return [int(t) for t in np.random.default_rng(9).integers(0, model.cfg.vocab_size, PROMPT_LEN)]


@pytest.fixture(scope="module")
def tape(model, prompt):
    return generate(model, prompt, 64).tokens


# ---- loading -------------------------------------------------------------------------------------
def test_the_census_names_the_backbone_family(model, path):
    draft = DflashDraft.load(path("dspark"), model, precision="f32")
    assert draft.family == "dflash" and draft.sel_pred is None
    assert all(layer.attn_base is None and layer.mlp_proj is None for layer in draft.layers)
    assert draft.markov_w1 is not None and draft.conf_with_markov, "the seed's head spellings map"
    drafter = DFlash2Source().load(model, {"path": path("dspark")})
    assert drafter.selector is None and drafter.harvest.value == "dspark" and drafter.max_k == 8
    assert drafter.policy.kind == "confidence-slot", "a confidence head picks the slot window, as for DFlash2"


@pytest.mark.parametrize("extra", ["layers.0.attention_conv.base_kernel", "candidate_selector.successor_codebook"])
def test_part_of_the_dflash2_extras_is_refused_naming_the_rest(model, path, tmp_path, extra):
    d = write_fixture_drafter(tmp_path / "d", preset(model.preset_name), family="dflash",
                              target_layer_ids=TAPS[model.preset_name])
    rewrite(d, lambda t: t.update({extra: np.zeros((2, 2), F32)}))
    with pytest.raises(CheckpointError, match=r"not the DFlash2 \(convs \+ candidate selector\) checkpoint.*missing"):
        DflashDraft.load(d, model)


def test_a_dspark_backbone_refuses_an_unmapped_tensor(model, tmp_path):
    d = write_fixture_drafter(tmp_path / "d", preset(model.preset_name), family="dflash", strategy="dspark",
                              with_markov=True, target_layer_ids=TAPS[model.preset_name])
    rewrite(d, lambda t: t.update({"lm_head.weight": np.zeros((4, 4), F32)}))
    with pytest.raises(CheckpointError, match="unmapped tensors.*lm_head.weight"):
        DflashDraft.load(d, model)


def test_forward_block_is_the_plain_residual_stack(model, path):
    draft = DflashDraft.load(path("v1"), model, precision="f32")
    feats = ctx_rows(draft, 7)
    kv = draft.new_kv(32)
    draft.ingest(kv, feats)
    mask = draft.cfg.mask_token_id
    tokens = [3, mask, mask, 5, mask]
    c = draft.cfg
    h = _f64(model.embed_table)[tokens] * c.input_embedding_scale
    for li, layer in enumerate(draft.layers):
        h = h + _naive_attention(draft, li, _naive_norm(h, layer.ln_in, c.rms_norm_eps), feats, kv.len)
        h = h + _naive_mlp(draft, li, _naive_norm(h, layer.ln_post, c.rms_norm_eps))
    want = _naive_norm(h, draft.norm, c.rms_norm_eps)
    got = draft.forward_block(kv, tokens, kv.len)
    assert np.abs(got - want).max() < 2e-4 * np.abs(want).max()


# ---- drafts against a from-the-rows reference ----------------------------------------------------
def _checked_session(model, prompt, drafter, sampling=None):
    """A session whose every proposal is compared with the rows' own argmax / filtered rows."""
    session = SpecSession(model, prompt, drafter, MAX_CTX, sampling=sampling)
    state, bad, rounds = session.state, [], [0]
    propose = state.propose

    def checked(k, draft_sampling):
        anchor = state.anchor
        prop = propose(k, draft_sampling)
        cfg, first = drafter.cfg, drafter.harvest.first_row
        hidden = drafter.draft.forward_block(state.kv, [anchor] + [cfg.mask_token_id] * (cfg.block_size - 1),
                                             state.kv.len)
        logits = np.asarray(drafter.draft.logits(hidden[first:first + k]), np.float64)
        prev = anchor
        for i, token in enumerate(prop.tokens):
            row = logits[i] + (drafter.markov.bias(prev) if drafter.markov_bias else 0.0)
            if sampling is None:
                ok = token == int(np.argmax(row)) and prop.q is None
            else:
                ok = isinstance(prop.q, DenseQ) and prop.q.rows[i, token] > 0 and \
                    np.allclose(prop.q.rows[i], filtered_probs(row, sampling), rtol=1e-9, atol=1e-12)
            if not ok:
                bad.append(f"round {rounds[0]} slot {i}")
            prev = token
        rounds[0] += 1
        return prop

    state.propose = checked
    return session, bad, rounds


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_drafts_are_each_rows_argmax_after_the_markov_bias(model, prompt, tape, path, variant):
    drafter = DFlash2Source().load(model, {"path": path(variant), "window": "ladder", "adapt": False})
    session, bad, rounds = _checked_session(model, prompt, drafter)
    assert run_bursts(session, N, 5)[:N] == tape[:N]
    assert rounds[0] >= 3 and bad == []


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sampled_q_is_the_dense_filtered_row_each_draft_was_drawn_from(model, prompt, path, variant):
    drafter = DFlash2Source().load(model, {"path": path(variant), "window": "ladder", "adapt": False})
    sp = SamplingParams(temperature=0.8, top_k=12, seed=17)
    session, bad, rounds = _checked_session(model, prompt, drafter, sp)
    out = run_bursts(session, N, 4)
    assert len(out) >= N and rounds[0] >= 3 and bad == []
    assert session.streams.sctr >= 1 + 4 * rounds[0], "each draft is a draw on the session's stream"


# ---- the tape ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tape_is_the_plain_tape_for_every_k(model, prompt, tape, path, variant):
    drafter = DFlash2Source().load(model, {"path": path(variant)})
    for k in range(1, drafter.max_k + 1):
        result = generate(model, prompt, N, draft="dflash2", num_draft_tokens=k, draft_options={"path": path(variant)})
        assert result.tokens == tape[:N], f"k={k}"
        assert result.stats["num_draft_tokens"] > 0


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("pattern", ["full-accept", "accept-j-cycle"])
def test_forced_acceptance_patterns_keep_the_tape(model, prompt, tape, path, variant, pattern):
    """Forced drafts (battery.Oracle): every round commits K+1 rows, or j = 0..K in turn, so the
    drafter's context grows by every round size."""
    drafter = DFlash2Source().load(model, {"path": path(variant), "window": "ladder", "adapt": False})
    k = 5
    reject_at = (lambda r: None) if pattern == "full-accept" else (lambda r: r % (k + 1))
    oracle = Oracle(tape, model.cfg.vocab_size, reject_at)
    session = SpecSession(model, prompt, drafter, MAX_CTX, instruments=GateInstruments(draft_override=oracle))
    oracle.bind(session)
    out = run_bursts(session, 36, k)
    assert out == tape[:len(out)] and len(out) >= 36
    m = session.metrics
    if pattern == "full-accept":
        assert m.num_accepted_tokens == m.num_draft_tokens == k * m.rounds
    else:
        assert m.num_accepted_tokens == sum(r % (k + 1) for r in range(m.rounds))
    assert session.state.kv.len + sum(len(p[0]) for p in session.state.pending) == len(session.committed)
