"""The benchmarks' FP8 variant (benchmarks/common.py --dtype fp8): the release's FP8 matrices are
e4m3 pool views with block scales, everything else is the bf16 build's, and the model runs."""

import numpy as np

from benchmarks.common import bench_weights, build_model, model_args
from memra.backend.fp8 import Fp8Block, dequantize
from memra.checkpoint_fp8 import fp8_allowed
from memra.config import ModelConfig, preset

SMALL = ModelConfig.from_dict(preset("small"))


def test_fp8_bench_weights_follow_the_release_split_and_keep_the_bf16_spread():
    bf16, fp8 = bench_weights(SMALL, 3, pooled_min=1), bench_weights(SMALL, 3, pooled_min=1, dtype="fp8")
    assert bf16.keys() == fp8.keys()
    for name, w in fp8.items():
        if fp8_allowed(name, SMALL):
            assert isinstance(w, Fp8Block) and w.shape == bf16[name].shape
            std = float(dequantize(w).std())
            assert 0.5 < std * SMALL.hidden_size ** 0.5 < 2.0, (name, std)
        else:
            assert w is bf16[name] or np.array_equal(w, bf16[name]), name


def test_fp8_bench_model_decodes_on_numpy():
    model = build_model("small", "numpy", seed=1, dtype="fp8")
    cache = model.new_cache(16)
    logits = model.prime([1, 2, 3], cache)
    assert np.isfinite(logits).all() and np.isfinite(model.decode_step(int(np.argmax(logits)), cache)).all()
    assert model_args("x\n").parse_args(["--git-sha", "a", "--dtype", "fp8"]).dtype == "fp8"
