"""Which kernels a decode step and a verify walk launch (GPU host only).

The exact class runs on memra's own kernels (DESIGN.md section 2). So every kernel that a decode
step or a verify walk launches must be a function of one of memra's RawModules (a family of
memra/kernels_cu/*.cu), or a plain copy: CuPy's `cupy_copy__T_T`, `out0 = in0` with the same
dtype in and out (memcpys and memsets are not kernels at all). Anything else (a CuPy ufunc such
as `x * s` on device arrays, `cupy_multiply__...`, a reduction, a cuBLAS gemm) does arithmetic
memra does not own, and fails the census by name.

How the census sees every kernel: CUPTI's kernel activity records, read through torch.profiler
(Kineto), which the GPU host has. CUPTI records every kernel the process launches, whatever
launched it. CuPy 14 cannot list kernels itself: `cupyx.profiler.benchmark` only times,
`cupy.cuda.profiler` only starts and stops an external profiler, and wrapping
`ElementwiseKernel` / `ReductionKernel` / `RawKernel.__call__` misses the ufuncs (`cp.multiply`
launches from Cython, past any Python wrapper). ncu sees everything too, but it replays each
kernel, which takes minutes; nsys is not on the host. The walks run eagerly (graphs off), so each
launch is its own record, not a node of a replayed graph. The census is checked for completeness:
CUPTI's memra kernels must equal, name for name and count for count, what memra's
`runtime.launch` asked for, so a profiler that missed launches fails the test instead of
passing it.

Red arms: put back the CuPy expressions the model used (`x * np.float32(f)` for be.scale, the
indexer weight scale; `a + b` for be.add, the MoE routed + shared sum where the
shared expert runs as a separate MLP: on a model loaded that way, as memra stacks a shared expert
with the routed ones whenever their shapes match). The census then fails with exactly one
foreign kernel per call site and walk, while the real ops pass on the same model and inputs.

Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/model/test_launch_census.py
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

# torch warns that a profile keeps only its own cycle's events: one cycle is all a census takes
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")]
cp = cupy_or_skip()
profiler = pytest.importorskip("torch.profiler", reason="the census reads CUPTI through torch.profiler")

from memra import load_model  # noqa: E402
from memra.backend.cuda import runtime  # noqa: E402
from memra.backend.cuda.graphs import WalkGraphs  # noqa: E402
from memra.config import KDA  # noqa: E402
from memra.model import moe  # noqa: E402
from memra.model.moe import Moe  # noqa: E402

FAMILIES = sorted(p.name[:-3] for p in runtime.kernel_dir().iterdir() if p.name.endswith(".cu"))
PLAIN_COPY = re.compile(r"cupy_copy__(\w+)_\1")  # the same dtype in and out: bits moved, no cast
PROMPT, VERIFY_T = 20, 15  # past the kpool dense threshold of both fixtures; the row cap


@dataclass
class Census:
    memra: Counter     # kernels of memra's RawModules, by name
    copies: Counter    # CuPy's plain copies
    foreign: Counter   # everything else: must stay empty
    launched: Counter  # what memra's runtime.launch asked for, by name


def defined_by_memra(name: str) -> bool:
    """Whether `name` is a kernel of one of memra's RawModules (runtime.module, one per family)."""
    for family in FAMILIES:
        try:
            runtime.module(family).module.get_function(name)
            return True
        except cp.cuda.driver.CUDADriverError:  # not a function of this family
            continue
    return False


def take_census(run, trace_path) -> Census:
    """Run `run()` under CUPTI and sort every kernel it launched."""
    launched = Counter()
    real_kernel = runtime.kernel

    def counting(family, name):  # runtime.launch looks `kernel` up once per launch
        launched[name] += 1
        return real_kernel(family, name)

    cp.cuda.Device().synchronize()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(runtime, "kernel", counting)
        with profiler.profile(activities=[profiler.ProfilerActivity.CUDA]) as prof:
            run()
            cp.cuda.Device().synchronize()
    prof.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    seen = Counter(e["name"] for e in events if e.get("cat") == "kernel")
    census = Census(Counter(), Counter(), Counter(), launched)
    for name, n in seen.items():
        kind = "memra" if defined_by_memra(name) else "copies" if PLAIN_COPY.fullmatch(name) else "foreign"
        getattr(census, kind)[name] = n
    return census


@pytest.fixture(scope="module", params=[("mini", 0, "float32"), ("small", 13, "bfloat16")])
def model(request, fixture_dir):
    name, seed, dtype = request.param
    return load_model(fixture_dir(name, seed=seed, dtype=dtype), backend="cuda")


@pytest.fixture(scope="module")
def separate_shared(fixture_dir):
    """mini with each shared expert loaded as a separate MLP, added to the routed sum by be.add."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(moe, "_alike", lambda a, b: False)
        model = load_model(fixture_dir("mini", seed=0, dtype="float32"), backend="cuda")
    assert _sites(model)["add"] > 0
    return model


def _sites(model) -> dict[str, int]:
    """Call sites per walk: be.scale (each own indexer's weights; a KDA q's scale rides in its
    l2norm), be.add (each MoE whose shared expert is a separate MLP)."""
    layers = model.layers
    indexers = sum(layer.kind != KDA and layer.mixer.indexer is not None for layer in layers)
    return {"scale": indexers,
            "add": sum(isinstance(layer.ffn, Moe) and layer.ffn.shared is not None for layer in layers)}


def _ready_cache(model):
    """An eager cache (graphs off) past its prompt, one decode step and one verify walk, so every
    kernel is compiled and loaded before the census."""
    rng = np.random.default_rng(3)
    cache = model.new_cache(96)
    cache.walks = WalkGraphs(enabled=False)
    model.prime(rng.integers(0, model.cfg.vocab_size, PROMPT), cache)
    model.decode_step(1, cache)
    _, _, ckpt = model.verify_rows(rng.integers(0, model.cfg.vocab_size, VERIFY_T), cache)
    model.rollback(cache, ckpt, 1)
    return cache


PHASES = {
    "decode_step": lambda model, cache: model.decode_step(2, cache),
    "verify_walk": lambda model, cache: model.verify_rows(np.arange(VERIFY_T) % model.cfg.vocab_size, cache),
}


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_decode_step_and_verify_walk_launch_only_memra_kernels_and_plain_copies(model, phase, tmp_path):
    cache = _ready_cache(model)
    census = take_census(lambda: PHASES[phase](model, cache), tmp_path / "trace.json")
    assert census.foreign == Counter(), (
        f"{phase} launched kernels that are neither memra's nor plain copies: {dict(census.foreign)}")
    # complete: CUPTI saw each launch memra made, and nothing of memra's that it did not make
    assert census.launched and census.memra == census.launched
    sites = _sites(model)
    assert census.memra["scale_kernel"] == sites["scale"] and census.memra["add_kernel"] == sites["add"]


@pytest.mark.parametrize("op, put_back, ufunc", [
    ("scale", lambda x, factor: x * np.float32(factor), "cupy_multiply"),
    ("add", lambda a, b: a + b, "cupy_add"),
])
def test_red_arm_cupy_arithmetic_put_back_fails_the_census(model, separate_shared, op, put_back, ufunc, tmp_path,
                                                           monkeypatch):
    model = separate_shared if op == "add" else model
    walks = lambda cache: [PHASES[phase](model, cache) for phase in sorted(PHASES)]
    green_cache, red_cache = _ready_cache(model), _ready_cache(model)
    green = take_census(lambda: walks(green_cache), tmp_path / "green.json")
    assert green.foreign == Counter()  # green arm beside it: the same steps on the same model
    monkeypatch.setattr(model.be, op, put_back)
    red = take_census(lambda: walks(red_cache), tmp_path / "red.json")
    assert red.foreign, f"putting back the CuPy {op} left the census clean"
    assert all(name.startswith(ufunc + "__") for name in red.foreign), dict(red.foreign)
    assert sum(red.foreign.values()) == len(PHASES) * _sites(model)[op]  # every call site, every walk
