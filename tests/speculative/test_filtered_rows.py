"""The sampling filter over rows where the backend keeps them, and the accept walk over them.

* NumpyBackend.filtered_rows is filtered_probs row by row (the definition, bit for bit).
* accept_walk over the backend's rows is the host walk: the same (j, bonus) for point-mass,
  sparse and dense q, accepted and rejected, with be=NumpyBackend() and with host rows.
* CUDA (GPU host): filtered_rows against the host definition over temperature, top-k (the
  kernel's k and the sorted one), top-p, min-p, ties at the boundaries, +-0, -inf and NaN rows:
  the same kept set and probabilities within float64 rounding. Red arm: a top-k that breaks ties
  to the higher index keeps another set, and the comparison says so.
* A sampled session on CUDA copies no vocabulary-long row to the host in its rounds, and its
  tape is the numpy backend's for the same seed.
"""

import numpy as np
import pytest

from memra.backend.numpy_ref import NumpyBackend
from memra.speculative.contract import SparseQ
from memra.speculative.sampling import SampleStreams, SamplingParams, accept_walk, filtered_probs

PARAMS = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_p=0.9),
          SamplingParams(top_k=5), SamplingParams(temperature=0.8, top_k=50, top_p=0.8),
          SamplingParams(top_k=200, min_p=0.02), SamplingParams(temperature=0.6, top_p=0.5, min_p=0.1)]


def _rows(v: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((5, v)) * 3).astype(np.float32)
    rows[1, [3, 40, 41]] = rows[1].max()                  # a three-way tie at the top
    rows[2] = np.round(rows[2])                           # ties everywhere, top-k and top-p edges included
    rows[3, :: 7] = 0.0
    rows[3, 1:: 7] = -0.0                                 # +-0 ties
    rows[4, v // 2:] = -np.inf
    return rows


@pytest.mark.parametrize("sp", PARAMS)
def test_numpy_filtered_rows_are_the_definition_row_by_row(sp):
    rows = _rows(300, 1)
    got = NumpyBackend().filtered_rows(rows, sp.temperature, sp.top_k, sp.top_p, sp.min_p)
    assert np.array_equal(got, np.stack([filtered_probs(r, sp) for r in rows]))


def _q_kinds(rng, n: int, v: int):
    cand = np.stack([rng.choice(v, 4, replace=False) for _ in range(n)])
    return [None, SparseQ(cand, rng.dirichlet(np.ones(4), n))]


@pytest.mark.parametrize("seed", range(12))
def test_the_walk_over_backend_rows_is_the_host_walk(seed):
    rng = np.random.default_rng(seed)
    p_rows = np.stack([filtered_probs(r, PARAMS[1]) for r in (rng.standard_normal((4, 50)) * 2)])
    for q in _q_kinds(rng, 3, 50):
        drafts = [int(np.argmax(p_rows[0]))] + rng.integers(0, 50, 2).tolist()  # one likely accept, then guesses
        walks = [accept_walk(p_rows, drafts, q, SampleStreams(NumpyBackend(), seed), be) for be in (None, NumpyBackend())]
        assert walks[0] == walks[1]


# ---- CUDA ---------------------------------------------------------------------------------------

def _cuda():
    from tests.gpu import cupy_or_skip

    cp = cupy_or_skip()
    from memra.backend.cuda.backend import CudaBackend

    return cp, CudaBackend()


def same_law(got: np.ndarray, want: np.ndarray) -> bool:
    """The same kept set (a zero is a zero on both sides) and the same probabilities within
    float64 rounding of the device's exp and sums."""
    return bool(np.array_equal(got > 0, want > 0) and np.allclose(got, want, rtol=1e-12, atol=0))


@pytest.mark.gpu
@pytest.mark.parametrize("v", [300, 154880])
@pytest.mark.parametrize("sp", PARAMS)
def test_cuda_filtered_rows_are_the_definition(sp, v):
    cp, be = _cuda()
    rows = _rows(v, 2)
    rows[0, 5] = np.nan  # a NaN row: filtered by the host definition
    want = np.stack([filtered_probs(r, sp) for r in rows])
    got = cp.asnumpy(be.filtered_rows(cp.asarray(rows), sp.temperature, sp.top_k, sp.top_p, sp.min_p))
    assert np.array_equal(got[0], want[0], equal_nan=True)
    for r in range(1, len(rows)):
        assert same_law(got[r], want[r]), (r, sp)


@pytest.mark.gpu
def test_red_arm_ties_broken_the_other_way_keep_another_set():
    cp, be = _cuda()
    row = np.zeros(300, np.float32)
    row[[10, 20, 30]] = 5.0  # top-2 of a three-way tie: 10 and 20 by the definition
    want = filtered_probs(row, SamplingParams(top_k=2))
    got = cp.asnumpy(be.filtered_rows(cp.asarray(row), 1.0, 2, 1.0, 0.0))
    flipped = filtered_probs(row[::-1].copy(), SamplingParams(top_k=2))[::-1]  # ties to the higher index
    assert same_law(got, want) and not same_law(flipped, want)


@pytest.fixture(scope="module")
def small(fixture_dir, tmp_path_factory):
    from memra.config import preset
    from memra.drafters.dflash2 import write_fixture_drafter

    drafter = write_fixture_drafter(tmp_path_factory.mktemp("dflash2"), preset("small"), seed=0,
                                    target_layer_ids=(0, 2, 4))
    return fixture_dir("small", seed=13), {"path": drafter}


def _tape(path, backend, draft, options, monkeypatch=None):
    from memra import load_model
    from memra.generate import generate

    model = load_model(path, backend=backend)
    copied = []
    if monkeypatch is not None:
        to_host = model.be.to_host
        monkeypatch.setattr(model.be, "to_host", lambda a: copied.append(np.size(a)) or to_host(a))
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    out = generate(model, list(range(3, 15)), 24, draft=draft, num_draft_tokens=3, sampling=sp,
                   draft_options=options if draft == "dflash2" else None).tokens
    return out, copied, model.cfg.vocab_size


@pytest.mark.gpu
@pytest.mark.parametrize("draft", [None, "dflash2"])
def test_a_sampled_session_keeps_its_rows_on_the_device(small, monkeypatch, draft):
    _cuda()
    path, options = small
    out, copied, vocab = _tape(path, "cuda", draft, options, monkeypatch)
    assert copied[0] == vocab and all(n < vocab for n in copied[1:])  # the prime's last row, then none
    assert out == _tape(path, "numpy", draft, options)[0]


@pytest.mark.gpu
def test_sampled_native_mtp_drafts_filter_on_the_device_and_keep_the_tape(small):
    _cuda()
    path, options = small
    assert _tape(path, "cuda", "native-mtp", options)[0] == _tape(path, "numpy", "native-mtp", options)[0]
