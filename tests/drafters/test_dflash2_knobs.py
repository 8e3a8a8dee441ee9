"""The seed's two DFlash2 knobs, as `draft_options`: the verify window's cap (`verify_t`, the
seed's MEMRA_DFLASH_VERIFY_T, bounded 2..=max_k + 1) and the markov head switch (`markov`, the
seed's MEMRA_DFLASH_MARKOV=0). Both move the drafts, never the tape; bad values are refused by
name (the seed clamped an out-of-range width silently)."""

import numpy as np
import pytest

import memra
from memra.config import preset
from memra.drafters.dflash2 import DFlash2Source, write_fixture_drafter
from memra.errors import InputError
from memra.generate import generate
from memra.speculative.session import SpecSession

PROMPT_LEN, MAX_CTX, N = 12, 96, 20


@pytest.fixture(scope="module")
def model(fixture_dir):
    return memra.load_model(fixture_dir("mini"), backend="numpy")


@pytest.fixture(scope="module")
def prompt(model):
    return [int(t) for t in np.random.default_rng(5).integers(0, model.cfg.vocab_size, PROMPT_LEN)]


@pytest.fixture(scope="module")
def tape(model, prompt):
    return generate(model, prompt, N + 8).tokens


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    def write(name, **shape):
        return write_fixture_drafter(tmp_path_factory.mktemp(name), preset("mini"), seed=1, **shape)

    return {"plain": write("plain"), "markov": write("markov", with_markov=True),
            "markov-confidence": write("mc", strategy="dspark", with_markov=True, with_confidence=True)}


def proposals(model, prompt, drafter, k: int):
    """(tokens out, every Proposal) of a greedy session."""
    session = SpecSession(model, prompt, drafter, MAX_CTX)
    log, propose = [], session.state.propose
    session.state.propose = lambda kk, sampling: log.append(propose(kk, sampling)) or log[-1]
    out: list[int] = []
    while len(out) < N and not session.done:
        out.extend(session.burst(N - len(out), k)[0])
    return out[:N], log


# ---- verify_t ------------------------------------------------------------------------------------
@pytest.mark.parametrize("verify_t", [2, 3, 5])
def test_verify_t_caps_every_rounds_drafts_and_keeps_the_tape(model, prompt, tape, paths, verify_t):
    drafter = DFlash2Source().load(model, {"path": paths["plain"], "verify_t": verify_t})
    assert drafter.max_k == 7 and drafter.vt_cap == verify_t
    out, log = proposals(model, prompt, drafter, drafter.max_k)
    assert out == tape[:N]
    lengths = [len(p.tokens) for p in log]
    assert max(lengths) == verify_t - 1 == lengths[0], "the ladder opens at the cap and never passes it"


def test_verify_t_caps_the_confidence_windows_too(model, prompt, tape, paths):
    drafter = DFlash2Source().load(model, {"path": paths["markov-confidence"], "window": "confidence-slot",
                                           "tau": 0.01, "verify_t": 3})
    out, log = proposals(model, prompt, drafter, drafter.max_k)
    assert out == tape[:N] and {len(p.tokens) for p in log} == {2}, "tau 0.01 keeps every slot: the cap binds"


def test_verify_t_defaults_to_the_whole_harvest(model, prompt, paths):
    for path, max_k in ((paths["plain"], 7), (paths["markov-confidence"], 8)):   # dflash / dspark harvest
        drafter = DFlash2Source().load(model, {"path": path, "window": "ladder"})
        assert (drafter.max_k, drafter.vt_cap) == (max_k, max_k + 1)
        _, log = proposals(model, prompt, drafter, max_k)
        assert len(log[0].tokens) == max_k


@pytest.mark.parametrize("verify_t", [1, 9, 0, -3, 2.0, "4", True, None])
def test_verify_t_outside_its_bound_is_refused_by_name(model, paths, verify_t):
    if verify_t is None:   # an explicit None is the default, like an absent key
        assert DFlash2Source().load(model, {"path": paths["plain"], "verify_t": None}).vt_cap == 8
        return
    with pytest.raises(InputError, match=rf"verify_t={verify_t!r}: .* integer in 2..=8 .* 1..=7 drafts"):
        DFlash2Source().load(model, {"path": paths["plain"], "verify_t": verify_t})


def test_verify_t_bound_follows_the_harvest(model, paths):
    shifted = DFlash2Source().load(model, {"path": paths["markov-confidence"], "verify_t": 9})
    assert shifted.vt_cap == 9, "the shifted harvest drafts block_size rows, so its cap is one higher"
    with pytest.raises(InputError, match=r"in 2..=8"):
        DFlash2Source().load(model, {"path": paths["markov-confidence"], "verify_t": 9, "harvest": "dflash"})


def test_generate_takes_verify_t_through_draft_options(model, prompt, tape, paths):
    result = generate(model, prompt, N, draft="dflash2", num_draft_tokens=7,
                      draft_options={"path": paths["plain"], "verify_t": 3})
    assert result.tokens == tape[:N]
    assert result.stats["num_draft_tokens"] <= 2 * result.stats["num_drafts"]


# ---- markov ---------------------------------------------------------------------------------------
def _walk_without_bias(drafter, state, anchor, k):
    draft, cfg = drafter.draft, drafter.cfg
    hidden = draft.forward_block(state.kv, [anchor] + [cfg.mask_token_id] * (cfg.block_size - 1), state.kv.len)
    rows = hidden[drafter.harvest.first_row:drafter.harvest.first_row + k]
    return drafter.selector.walk(draft.logits(rows), rows, anchor).path


@pytest.mark.parametrize("variant", ["markov", "markov-confidence"])
def test_markov_off_drafts_without_the_bias_and_keeps_the_tape(model, prompt, tape, paths, variant):
    on = DFlash2Source().load(model, {"path": paths[variant], "window": "ladder", "adapt": False})
    off = DFlash2Source().load(model, {"path": paths[variant], "window": "ladder", "adapt": False, "markov": False})
    assert on.markov_bias and not off.markov_bias and off.markov is not None, "the head stays for the embeddings"
    k = 5
    out_on, log_on = proposals(model, prompt, on, k)
    session = SpecSession(model, prompt, off, MAX_CTX)
    state, log_off, propose = session.state, [], session.state.propose

    def checked(kk, sampling):
        anchor = state.anchor
        prop = propose(kk, sampling)
        log_off.append((prop.tokens, _walk_without_bias(off, state, anchor, kk)))
        return prop

    state.propose = checked
    out_off: list[int] = []
    while len(out_off) < N:
        out_off.extend(session.burst(N - len(out_off), k)[0])
    assert out_on == out_off[:N] == tape[:N]
    assert all(tokens == ref for tokens, ref in log_off), "markov off: the plain selector walk"
    assert [p.tokens for p in log_on] != [tokens for tokens, _ in log_off], "red arm: the bias moves the drafts"


def test_the_confidence_head_keeps_reading_markov_embeddings_with_the_bias_off(model, prompt, paths):
    off = DFlash2Source().load(model, {"path": paths["markov-confidence"], "markov": False,
                                       "window": "confidence", "tau": 0.3})
    assert off.confidence.with_markov
    _, log = proposals(model, prompt, off, off.max_k)
    assert all(0 < c < 1 for p in log for c in p.confidences)


@pytest.mark.parametrize("value, match", [("no", "must be true or false"), (0, "must be true or false"),
                                          (True, "has none")])
def test_bad_markov_values_are_refused_by_name(model, paths, value, match):
    with pytest.raises(InputError, match=rf"markov={value!r}.*{match}" if match != "has none" else match):
        DFlash2Source().load(model, {"path": paths["plain"], "markov": value})


def test_markov_true_on_a_checkpoint_with_the_head_is_the_default(model, paths):
    assert DFlash2Source().load(model, {"path": paths["markov"], "markov": True}).markov_bias
    assert not DFlash2Source().load(model, {"path": paths["plain"]}).markov_bias
