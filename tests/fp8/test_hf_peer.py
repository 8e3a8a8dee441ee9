"""Peer gate (CPU): memra on an FP8 checkpoint gives the logits transformers gives on it.

Without a GPU, transformers 5.23.0 loads the FP8 release format by dequantizing every e4m3 matrix
(e4m3 * weight_scale_inv, here in float32) and keeps the BF16 tensors, which hf_peer widens to
float32 exactly: the peer is the dequantized float32 model in transformers' own code. memra's
numpy backend runs the FP8 exact class (docs/fp8.md), which differs from it in summation order
only. Compared as in tests/model/test_hf_peer.py: per row, max|memra - HF| <= REL_TOL * max|HF|,
memra's prime + decode chain against HF's uncached forward, on an 8-token prompt (dense) and a
64-token one (the kpool selection decides what is attended; the fixture seeds below have no
pool-score tie at the budget boundary, asserted). Red arm: HF with one FP8 matrix's block scales
dropped (the raw e4m3 values) misses the bound.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
pytest.importorskip("accelerate")  # transformers loads FP8 checkpoints through it

from memra import load_model  # noqa: E402
from memra.checkpoint import write_fixture  # noqa: E402
from memra.config import ModelConfig, preset  # noqa: E402
from tests.model.hf_peer import HFPeer, _file_tensors, _read, indexer_margins  # noqa: E402

REL_TOL = 1e-4     # tests/model/test_hf_peer.py's bound; observed 2e-6 to 6e-6
MARGIN_REL = 1e-4  # required gap between the G-th and (G+1)-th best pool score
# fixture seed (dtype fp8) with no boundary tie; mini's exact 0.0 ties are aligned as in the bf16 gate
CASES = {"mini": dict(seed=0, align_ties=True), "small": dict(seed=2, align_ties=False)}
LENGTHS = {8: 3, 64: 37}  # prompt length -> rows primed before decoding the rest
SCALED = "model.layers.1.self_attn.q_b_proj.weight"  # an FP8 matrix of every preset's first DSA layer


class Case:
    def __init__(self, name: str, root):
        self.cfg = ModelConfig.from_dict(preset(name))
        self.align_ties = CASES[name]["align_ties"]
        self.dir = write_fixture(root / name, preset(name), seed=CASES[name]["seed"], dtype="fp8")
        self.peer = HFPeer.load(self.dir)
        self.model = load_model(self.dir, backend="numpy")

    def ids(self, length: int) -> np.ndarray:
        return np.random.default_rng(0).integers(0, self.cfg.vocab_size, length)

    def hf_rows(self, length: int) -> np.ndarray:
        """HF's uncached logits for the rows memra's chain returns, after asserting no tie."""
        with self.peer.capture_indexer(align_ties=self.align_ties) as caps:
            full = self.peer.full_logits(self.ids(length))
        budget = self.cfg.index_topk // self.cfg.index_kpool
        problems = [p for m in indexer_margins(caps, budget, MARGIN_REL, allow_zero_ties=self.align_ties)
                    for p in m.problems]
        assert not problems, f"the pool ranking is tied at the budget boundary: pick another seed. {problems[:2]}"
        return full[LENGTHS[length] - 1:]

    def memra_rows(self, length: int) -> np.ndarray:
        ids, n = self.ids(length), LENGTHS[length]
        cache = self.model.new_cache(length)
        return np.stack([self.model.prime(ids[:n], cache)]
                        + [self.model.decode_step(int(t), cache) for t in ids[n:]])


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory.mktemp("fp8_hf_peer"))


def rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_hf_holds_each_fp8_matrix_dequantized(case):
    files = _file_tensors(case.dir)
    raw, scale = _read(files, SCALED).float(), _read(files, SCALED + "_scale_inv")
    blocks = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: raw.shape[0], : raw.shape[1]]
    held = case.peer.model.get_parameter(SCALED.removeprefix("model."))
    assert torch.equal(held.detach(), raw * blocks)


@pytest.mark.parametrize("length", sorted(LENGTHS))
def test_fp8_logits_match_transformers(case, length):
    rel = rel_diff(case.memra_rows(length), case.hf_rows(length))
    assert rel <= REL_TOL, f"{length}-token prompt: memra vs HF rel diff {rel:.3g} (tolerance {REL_TOL:g})"


def test_red_arm_hf_without_one_matrix_scales_misses_the_bound(case):
    files = _file_tensors(case.dir)
    held = case.peer.model.get_parameter(SCALED.removeprefix("model."))
    kept = held.detach().clone()
    try:
        with torch.no_grad():
            held.copy_(_read(files, SCALED).float())  # the raw e4m3 values: scales dropped
        rel = rel_diff(case.memra_rows(64), case.hf_rows(64))
    finally:
        with torch.no_grad():
            held.copy_(kept)
    assert rel > REL_TOL
