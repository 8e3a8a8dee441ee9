"""The speculative byte-identity battery on the CUDA backend (GPU host only).

Same gates as the numpy battery, on device planes: W (verify rows == plain decode chain),
A (accept-j-then-continue), E (spec tapes == plain tape), and the red arms that must bite.
"""

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra import load_model  # noqa: E402
from memra.drafters.registry import load_drafter  # noqa: E402
from memra.errors import MemraError, ResidencyError  # noqa: E402
from memra.generate import generate  # noqa: E402
from memra.speculative.plain import PlainSession  # noqa: E402
from memra.speculative.session import GateInstruments, SpecSession  # noqa: E402
from tests.speculative.battery import feed_next_id_over, hand_tape  # noqa: E402

K = 7
PLEN = 28  # past the kpool dense threshold (11)
CONTINUATION = [3, 1, 4, 1, 5, 9]


@pytest.fixture(scope="module", params=[("mini", 0), ("small", 13)], ids=["mini", "small"])
def model(request, fixture_dir):
    name, seed = request.param
    return load_model(fixture_dir(name, seed=seed), backend="cuda")


def _prompt(model, n=PLEN, seed=2):
    return [int(t) for t in np.random.default_rng(seed).integers(0, model.cfg.vocab_size, n)]


def _primed(model, prompt, max_ctx=96):
    cache = model.new_cache(max_ctx)
    model.prime(prompt, cache)
    return cache


@pytest.mark.parametrize("t", range(1, 16))
def test_w_verify_rows_equal_the_plain_decode_chain(model, t):
    prompt = _prompt(model, seed=t)
    rows = _prompt(model, t, seed=100 + t)
    logits, _, _ = model.verify_rows(rows, _primed(model, prompt))
    plain = _primed(model, prompt)
    for r in range(t):
        assert np.array_equal(logits[r], model.decode_step(rows[r], plain)), f"row {r} of t={t}"


def test_e_plain_session_steps_ahead_on_device_ids_give_the_hand_written_tape(model, monkeypatch):
    """PlainSession's greedy steps are fed the step before's argmax on the device (captured
    graphs copy it into their inputs there) and still make the decode_step tape; the red arm
    feeds the next id over instead and must leave it."""
    prompt, n = _prompt(model), 24
    tape = hand_tape(model, prompt, n)
    assert PlainSession(model, prompt, len(prompt) + n).burst(n) == tape
    feed_next_id_over(monkeypatch, model)
    assert PlainSession(model, prompt, len(prompt) + n).burst(n) != tape


@pytest.mark.parametrize("t", [1, 8, 15])
def test_w_verify_greedy_targets_are_the_plain_chain_argmaxes(model, t):
    """The argmaxes taken on the device are the host argmaxes of the plain chain's logits."""
    prompt, rows = _prompt(model, seed=t), _prompt(model, t, seed=100 + t)
    targets, _, _ = model.verify_greedy(rows, _primed(model, prompt))
    plain = _primed(model, prompt)
    assert targets == [int(np.argmax(model.decode_step(tok, plain))) for tok in rows]
    greedy = _primed(model, prompt)
    assert [model.decode_greedy(tok, greedy) for tok in rows] == targets


@pytest.mark.parametrize("j", range(K + 1))
def test_a_accept_j_then_continue_equals_the_never_drafted_chain(model, j):
    prompt, rows = _prompt(model), _prompt(model, K + 1, seed=50)
    cache = _primed(model, prompt)
    _, _, ckpt = model.verify_rows(rows, cache)
    model.rollback(cache, ckpt, j + 1)
    assert cache.pos == PLEN + j + 1
    plain = _primed(model, prompt)
    for tok in rows[:j + 1]:
        model.decode_step(tok, plain)
    for tok in CONTINUATION:
        assert np.array_equal(model.decode_step(tok, cache), model.decode_step(tok, plain))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 14])
def test_e_spec_tape_equals_plain_tape(model, k):
    prompt = _prompt(model)
    plain = generate(model, prompt, 24).tokens
    assert generate(model, prompt, 24, draft="native-mtp", num_draft_tokens=k).tokens == plain


def _session(model, prompt, instruments):
    return SpecSession(model, prompt, load_drafter("native-mtp", model), PLEN + 64, instruments=instruments)


def _run(session, n):
    out = []
    while len(out) < n and not session.done:
        out += session.burst(n - len(out), K)[0]
    return out[:n]


def test_e_forced_full_accept_and_rejection_sweep(model):
    prompt = _prompt(model)
    longer = generate(model, prompt, 30 + 2 * K + 2).tokens  # the truth a last, overshooting round needs
    plain = longer[:30]

    def truth(session, i):
        """The plain tape's token for draft slot i of the session's next round."""
        return longer[len(session.committed) - PLEN + 1 + i]

    full = _session(model, prompt, None)
    full.instruments.draft_override = lambda rnd, i, d: truth(full, i)
    assert _run(full, 30) == plain
    assert full.metrics.num_accepted_tokens == full.metrics.num_draft_tokens > 0
    sweep = _session(model, prompt, None)

    def reject_at(rnd, i, d):
        tok = truth(sweep, i)
        return (tok + 1) % model.cfg.vocab_size if i == rnd % (K + 1) else tok

    sweep.instruments.draft_override = reject_at
    assert _run(sweep, 30) == plain


def test_red_stale_kda_state_diverges(model):
    prompt, rows = _prompt(model), _prompt(model, K + 1, seed=50)
    cache = _primed(model, prompt)
    _, _, ckpt = model.verify_rows(rows, cache)
    post = {i: (st.ring.copy(), st.state.copy()) for i, st in cache.kda.items()}
    model.rollback(cache, ckpt, 3)
    for i, (ring, state) in post.items():
        cache.kda[i].ring[...], cache.kda[i].state[...] = ring, state
    plain = _primed(model, prompt)
    for tok in rows[:3]:
        model.decode_step(tok, plain)
    diverged = any(not np.array_equal(model.decode_step(t, cache), model.decode_step(t, plain)) for t in CONTINUATION)
    assert diverged


def test_red_unclamped_pool_keys_trip_the_residency_wire(model):
    prompt, rows = _prompt(model), _prompt(model, K + 1, seed=50)
    cache = _primed(model, prompt)
    _, _, ckpt = model.verify_rows(rows, cache)
    ready = {i: plane.pools_ready for i, plane in cache.mla.items()}
    model.rollback(cache, ckpt, 1)
    layer = next(i for i, plane in cache.mla.items() if plane.pool_keys is not None)
    cache.mla[layer].pools_ready = ready[layer]
    with pytest.raises(ResidencyError, match="index_pools_ready"):
        model.decode_step(CONTINUATION[0], cache)


def test_red_rollback_disabled_breaks_the_tape_or_fails_loudly(model):
    prompt = _prompt(model)
    plain = generate(model, prompt, 30).tokens
    session = _session(model, prompt, GateInstruments(disable_rollback=True))
    session.instruments.draft_override = lambda rnd, i, d: (d + 1) % model.cfg.vocab_size
    try:
        tape = _run(session, 30)
    except MemraError:
        return
    assert tape != plain
