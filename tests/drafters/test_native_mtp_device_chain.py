"""native-mtp's greedy chain on the GPU: each step's argmax id feeds the next step on the device.

The chain never copies a logits row to the host: its ids go into the next replay's inputs on the
device (graphs._load), and the ids and confidences come back once per round. It must propose
what a chain through the host proposes (the row to the host, np.argmax, the id uploaded into the
next step): the same tokens, the same confidences within float32 rounding, with and without an
FR-Spec trim (d2t), over forced patterns that commit 1..K+1 rows a round.
Red arm: replays that ignore device ids (the ids the graph last held stay) draft other tokens,
so the comparison can fail.
"""

import functools

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda import graphs  # noqa: E402
from memra.drafters.native_mtp import NativeMtpState  # noqa: E402
from memra.drafters.registry import load_drafter  # noqa: E402
from memra.speculative.contract import Proposal  # noqa: E402
from tests.speculative.battery import (  # noqa: E402
    Oracle, model_fixture, open_session, plain_tape, prompt_ids, proposal_log, run_bursts,
)

K = 4
N_TOKENS = 30
model = model_fixture("cuda")


def host_chain(self, k, logits, carrier) -> Proposal:
    """The reference: every step's row goes to the host, its argmax id comes back up."""
    be = self.drafter.model.be
    tokens, confidences = [], []
    for ki in range(k):
        row = np.asarray(be.to_host(logits[-1]), np.float64)
        z = np.exp(row - row.max())
        tokens.append(self._token(int(np.argmax(row))))
        confidences.append(float(z.max() / z.sum()))
        if ki + 1 < k:
            logits, carrier = self._step(np.asarray([tokens[-1]], dtype=np.int64), carrier)
    return Proposal(tokens=tokens, confidences=confidences)


@functools.cache
def _tape(model) -> tuple:
    """The plain tape, made once per model: before a red arm's patch, which PlainSession's own
    device-fed steps would also feel."""
    return tuple(plain_tape(model, prompt_ids(model), 64))


def proposals(model, options, monkeypatch, chain=None) -> list[Proposal]:
    """Every proposal of a greedy session whose rounds accept 0..K drafts in turn."""
    tape = list(_tape(model))
    with monkeypatch.context() as m:
        if chain is not None:
            m.setattr(NativeMtpState, "_greedy", chain)
        prompt = prompt_ids(model)
        oracle = Oracle(tape, model.cfg.vocab_size, lambda r: r % (K + 1))
        session = open_session(model, prompt, drafter=load_drafter("native-mtp", model, options), oracle=oracle)
        log = proposal_log(session)
        tokens = run_bursts(session, N_TOKENS, K)
        assert tokens == oracle.tape[:len(tokens)]
    return log


def differences(device, host) -> list[str]:
    assert len(device) == len(host) >= 8
    bad = []
    for rnd, (a, b) in enumerate(zip(device, host)):
        if a.tokens != b.tokens or not np.allclose(a.confidences, b.confidences, rtol=1e-5, atol=0):
            bad.append(f"round {rnd}: {a.tokens} vs {b.tokens}")
    return bad


def _options(model, trim: bool):
    return {"d2t": list(range(model.cfg.vocab_size - 1, 0, -3))} if trim else None


@pytest.mark.parametrize("trim", [False, True], ids=["full-head", "d2t"])
def test_the_device_chain_proposes_what_a_host_chain_proposes(model, trim, monkeypatch):
    options = _options(model, trim)
    assert differences(proposals(model, options, monkeypatch), proposals(model, options, monkeypatch, host_chain)) == []


def test_red_arm_replays_that_ignore_device_ids_draft_other_tokens(model, monkeypatch):
    replay = graphs.CapturedWalk.replay

    def keeps_captured_ids(self, tokens, pos0, arrays):
        if isinstance(tokens, cp.ndarray):  # the position moves on; the ids the graph holds stay
            tokens = cp.asnumpy(self.inputs[1:])
        return replay(self, tokens, pos0, arrays)

    host = proposals(model, None, monkeypatch, host_chain)
    monkeypatch.setattr(graphs.CapturedWalk, "replay", keeps_captured_ids)
    assert differences(proposals(model, None, monkeypatch), host)
