"""The plugin-path draft sources on the CUDA backend (GPU host only): greedy speculative tapes
through `dflash2` (K = 1..7), a DSpark checkpoint in the seed's format (K = 1..8) and the
installed `ngram` plugin (K = 1..14) equal the plain CUDA tape, and the dflash2 tap-shift red arm
changes the drafts but never the output."""

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra import load_model  # noqa: E402
from memra.config import preset  # noqa: E402
from memra.drafters.dflash2 import DFlash2Source, write_fixture_drafter  # noqa: E402
from memra.drafters.registry import list_draft_sources  # noqa: E402
from memra.generate import generate  # noqa: E402
from memra.speculative.contract import DenseQ  # noqa: E402
from memra.speculative.sampling import SamplingParams  # noqa: E402
from memra.speculative.session import SpecSession  # noqa: E402

MODELS = (("mini", 0, (0, 2)), ("small", 13, (0, 2, 4)))
N = 24


@pytest.fixture(scope="module", params=MODELS, ids=[m[0] for m in MODELS])
def setup(request, fixture_dir, tmp_path_factory):
    name, seed, taps = request.param
    model = load_model(fixture_dir(name, seed=seed), backend="cuda")
    drafter = write_fixture_drafter(tmp_path_factory.mktemp(f"dflash2-{name}"), preset(name), seed=0,
                                    target_layer_ids=taps)
    rng = np.random.default_rng(7)
    motif = [int(t) for t in rng.integers(0, model.cfg.vocab_size, 6)]
    prompt = [int(t) for t in rng.integers(0, model.cfg.vocab_size, 12)] + motif * 3  # room for n-gram hits
    return model, drafter, prompt, generate(model, prompt, N).tokens


@pytest.mark.parametrize("k", range(1, 8))
def test_dflash2_tape_is_the_plain_tape_on_cuda(setup, k):
    model, drafter, prompt, plain = setup
    got = generate(model, prompt, N, draft="dflash2", num_draft_tokens=k, draft_options={"path": drafter})
    assert got.tokens == plain


@pytest.fixture(scope="module")
def dspark_v1(setup, tmp_path_factory):
    """A DSpark export in the seed's format (backbone + markov + confidence heads) for this target."""
    model = setup[0]
    name = "small" if model.cfg.num_hidden_layers > 4 else "mini"
    taps = dict((m[0], m[2]) for m in MODELS)[name]
    return write_fixture_drafter(tmp_path_factory.mktemp(f"v1-{name}"), preset(name), seed=4, family="dflash",
                                 strategy="dspark", with_markov=True, with_confidence=True, target_layer_ids=taps)


@pytest.mark.parametrize("k", range(1, 9))
def test_dspark_v1_tape_is_the_plain_tape_on_cuda(setup, dspark_v1, k):
    model, _, prompt, plain = setup
    got = generate(model, prompt, N, draft="dflash2", num_draft_tokens=k, draft_options={"path": dspark_v1})
    assert got.tokens == plain


def test_dspark_v1_sampled_proposals_carry_the_dense_q_on_cuda(setup, dspark_v1):
    model, _, prompt, _ = setup
    drafter = DFlash2Source().load(model, {"path": dspark_v1, "window": "ladder"})
    session = SpecSession(model, prompt, drafter, len(prompt) + N + 16, sampling=SamplingParams(temperature=0.8, seed=2))
    log, propose = [], session.state.propose
    session.state.propose = lambda k, s: log.append(propose(k, s)) or log[-1]
    out = []
    while len(out) < N and not session.done:
        out += session.burst(N - len(out), 4)[0]
    assert len(out) >= N and log
    assert all(isinstance(p.q, DenseQ) and all(p.q.rows[i, t] > 0 for i, t in enumerate(p.tokens)) for p in log)


@pytest.mark.parametrize("k", range(1, 15))
def test_ngram_plugin_tape_is_the_plain_tape_on_cuda(setup, k):
    if "ngram" not in list_draft_sources():
        pytest.skip("the memra-ngram plugin is not installed (pip install -e plugins/memra-ngram)")
    model, _, prompt, plain = setup
    assert generate(model, prompt, N, draft="ngram", num_draft_tokens=k).tokens == plain


def test_dflash2_tap_shift_moves_drafts_not_the_tape_on_cuda(setup):
    model, drafter_path, prompt, plain = setup
    drafts, tapes = {}, {}
    for shift in (0, 1):
        drafter = DFlash2Source().load(model, {"path": drafter_path, "tap_shift": shift, "adapt": False})
        session = SpecSession(model, prompt, drafter, len(prompt) + N + 16)
        log, propose = [], session.state.propose
        session.state.propose = lambda k, s, propose=propose: log.append(propose(k, s)) or log[-1]
        out = []
        while len(out) < N and not session.done:
            out += session.burst(N - len(out), 4)[0]
        tapes[shift], drafts[shift] = out[:N], [p.tokens for p in log]
    assert tapes[0] == tapes[1] == plain
    assert drafts[0] != drafts[1]
