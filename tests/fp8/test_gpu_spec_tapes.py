"""An FP8 target on the CUDA backend (GPU host only): the byte-identity gates of the bf16 path.

For the FP8 fixtures of `mini` and `small` (write_fixture(..., dtype="fp8"): the release's split):
W: verify_rows of t = 1..15 rows equal the plain decode chain bit for bit; E: greedy speculative
tapes through native-mtp (K = 1..7, 14) and dflash2 (K = 1..7) equal the plain tape; and the CUDA
logits match the numpy FP8 model within the peer bound of tests/fp8/test_peer.py's kind.
Run: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/fp8/test_gpu_spec_tapes.py
"""

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra import load_model  # noqa: E402
from memra.backend.cuda.fp8 import DeviceFp8  # noqa: E402
from memra.config import preset  # noqa: E402
from memra.drafters.dflash2 import write_fixture_drafter  # noqa: E402
from memra.generate import generate  # noqa: E402

MODELS = (("mini", 0, (0, 2)), ("small", 13, (0, 2, 4)))
PLEN, N = 28, 24
REL_TOL = 1e-4  # CUDA tensor-core order vs the numpy twin's BLAS order, through the whole model


@pytest.fixture(scope="module", params=MODELS, ids=[m[0] for m in MODELS])
def setup(request, fixture_dir, tmp_path_factory):
    name, seed, taps = request.param
    path = fixture_dir(name, seed=seed, dtype="fp8")
    model = load_model(path, backend="cuda")
    assert any(isinstance(v, DeviceFp8) for v in vars(model.layers[1].mixer).values())  # FP8 really loaded
    drafter = write_fixture_drafter(tmp_path_factory.mktemp(f"dflash2-fp8-{name}"), preset(name), seed=0,
                                    target_layer_ids=taps)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, model.cfg.vocab_size, PLEN)]
    return model, path, drafter, prompt, generate(model, prompt, N).tokens


def _primed(model, prompt):
    cache = model.new_cache(96)
    model.prime(prompt, cache)
    return cache


@pytest.mark.parametrize("t", range(1, 16))
def test_fp8_verify_rows_equal_the_plain_decode_chain(setup, t):
    model, _, _, prompt, _ = setup
    rows = [int(v) for v in np.random.default_rng(100 + t).integers(0, model.cfg.vocab_size, t)]
    logits, _, _ = model.verify_rows(rows, _primed(model, prompt))
    plain = _primed(model, prompt)
    for r in range(t):
        assert np.array_equal(logits[r], model.decode_step(rows[r], plain)), f"row {r} of t={t}"


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 14])
def test_fp8_native_mtp_tape_equals_the_plain_tape(setup, k):
    model, _, _, prompt, plain = setup
    assert generate(model, prompt, N, draft="native-mtp", num_draft_tokens=k).tokens == plain


@pytest.mark.parametrize("k", range(1, 8))
def test_fp8_dflash2_tape_equals_the_plain_tape(setup, k):
    model, _, drafter, prompt, plain = setup
    got = generate(model, prompt, N, draft="dflash2", num_draft_tokens=k, draft_options={"path": drafter})
    assert got.tokens == plain


def test_fp8_cuda_logits_match_the_numpy_fp8_model(setup):
    model, path, _, prompt, _ = setup
    ref = load_model(path, backend="numpy")
    got = model.prime(prompt, model.new_cache(64))
    want = ref.prime(prompt, ref.new_cache(64))
    assert np.abs(got - want).max() <= REL_TOL * np.abs(want).max()
