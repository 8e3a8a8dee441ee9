"""What the benchmark scripts share: the model under test, timing, the copy-bandwidth roof, and
the record each script prints (a card on stderr, ONE JSON line on stdout). The bytes a walk
reads are benchmarks/walk_bytes.py's.

    model = build_model("bench", "cuda")            # Glm5Model, bf16 weights, built in memory
    ms, logits = timed_call(partial(model.decode_step, tok, cache), model.be)
    emit(record_header("bench_x", sha, config, model.be) | numbers, card_lines, out_path)

Why the weights are built in memory, not written by `write_fixture` and loaded: the `bench` preset
holds ~46 GB of bf16 weights, and writing and reading them back would spend the GPU host's budget
on disk traffic. `bench_weights` returns the dict `load_checkpoint(dir, cfg, keep_bf16=True)` gives
for a bf16 `write_fixture` of the same config and seed, except that every tensor of at least
POOLED_MIN elements is a view into ONE shared pool of N(0, 1/D) bf16 values at a per-name offset
(the embedding and lm head, larger than the pool, are copied from pieces of it): timing depends
on shapes and dtypes, not values, and the pool's scale keeps every projection's output O(1).
Building takes seconds. Tensors below POOLED_MIN (norms, gates, routers, mHC, conv, the small KDA
projections) are the fixture's own, bit for bit. The model then treats them as it treats a loaded
checkpoint: projection matrices stay bf16 on the device (`be.matrix`), vectors, mHC weights,
routers and the gathered embedding table are widened to float32 (`be.weight`).

The scripts ask the backend what it can do (`be.synchronize()`, `be.device_name()`, its array
module `be.xp`), never which one it is. cupy is imported only for device arrays: CI runs the
scripts on numpy, without it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import json
import math
import sys
import time
import zlib

import numpy as np

from memra.backend import get_backend
from memra.backend.fp8 import Fp8Block, f32_to_e4m3, scale_grid
from memra.checkpoint import expected_tensors, fixture_tensor
from memra.checkpoint_fp8 import fp8_allowed
from memra.config import ModelConfig, preset
from memra.memory import config_weight_bytes
from memra.memory_plan import balanced_split
from memra.model.pipeline import StagedGlm5Model
from memra.model.stages import plan_stages
from memra.model.trunk import Glm5Model
from memra.safetensors_io import f32_to_bf16
from memra.speculative.plain import PlainSession

POOL_ELEMENTS = 1 << 26  # 64M bf16 values (128 MB) back every large tensor
POOLED_MIN = 1 << 20     # tensors with at least this many elements are pool views
WARMUP_STEPS = 2         # untimed decode steps before a timed run


# ---- the model under test ---------------------------------------------------------------------

def bench_weights(cfg: ModelConfig, seed: int = 0, pooled_min: int = POOLED_MIN, dtype: str = "bf16") -> dict:
    """Canonical name -> bf16 bits (uint16) for every tensor of `cfg` (see the module docstring).
    dtype "fp8": the FP8 release's split instead: each matrix the release stores in FP8 is an
    Fp8Block viewing one shared pool of e4m3 bytes (N(0, 1) quantized) with every block scale
    hidden_size^-0.5, the bf16 pool's spread; the rest as for bf16."""
    shapes = expected_tensors(cfg)
    pooled = {name for name, shape in shapes.items() if math.prod(shape) >= pooled_min}
    pool = _pool(cfg, seed, min(POOL_ELEMENTS, sum(math.prod(shapes[n]) for n in pooled))) if pooled else None
    out = {}
    for name, shape in shapes.items():
        if name in pooled:
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            out[name] = _pool_slice(pool, math.prod(shape), rng).reshape(shape)
        else:
            out[name] = f32_to_bf16(fixture_tensor(name, shape, cfg, seed))
    if "embed_tokens.weight" in pooled and not cfg.tie_word_embeddings:
        # the table is gathered, not projected: give it the fixture's unit scale back by moving the
        # bf16 exponent field (times a power of two: exact, and no value nears the field's ends)
        shift = round(math.log2(cfg.hidden_size) / 2)
        out["embed_tokens.weight"] = out["embed_tokens.weight"] + np.uint16(shift << 7)
    if dtype == "fp8":
        fp8 = [name for name in shapes if fp8_allowed(name, cfg)]
        pool = _fp8_pool(seed, min(POOL_ELEMENTS, sum(math.prod(shapes[n]) for n in fp8))) if fp8 else None
        scale = np.float32(cfg.hidden_size ** -0.5)
        for name in fp8:
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            data = _pool_slice(pool, math.prod(shapes[name]), rng).reshape(shapes[name])
            out[name] = Fp8Block(data, np.full(scale_grid(shapes[name]), scale, np.float32))
    return out


def _fp8_pool(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(b"bench fp8 pool")])
    return f32_to_e4m3(rng.standard_normal(n, dtype=np.float32))


def _pool(cfg: ModelConfig, seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(b"bench pool")])
    return f32_to_bf16(rng.standard_normal(n, dtype=np.float32) * np.float32(cfg.hidden_size ** -0.5))


def _pool_slice(pool: np.ndarray, n: int, rng) -> np.ndarray:
    """n pool values from a random offset: a view, or for a tensor larger than the pool (the
    embedding, the lm head) a copy of half-pool pieces from random offsets, so its rows do not
    repeat with the pool's period."""
    if n <= pool.size:
        start = int(rng.integers(0, pool.size - n + 1))
        return pool[start:start + n]
    piece = pool.size // 2
    starts = rng.integers(0, pool.size - piece + 1, size=-(-n // piece))
    return np.concatenate([pool[s:s + piece] for s in starts])[:n]


def build_model(preset_name: str, backend_name: str, seed: int = 0, dtype: str = "bf16", stages: int = 1,
                stage_layers=None, devices=None) -> Glm5Model:
    """A preset's Glm5Model on a backend ("numpy" | "cuda"), weights ("bf16" | "fp8") from `bench_weights`.
    stages > 1 (or a `stage_layers` split like "0-5,6-11") places the trunk as pipeline stages as
    load_model does (balanced by the release's weight bytes), stage s on GPU devices[s] (default s)."""
    cfg = ModelConfig.from_dict(preset(preset_name))
    be = get_backend(backend_name)
    plan = plan_stages(cfg.num_hidden_layers, stages, stage_layers,
                       lambda n: balanced_split(config_weight_bytes(cfg, dtype), n))
    weights = bench_weights(cfg, seed, dtype=dtype)
    if plan.count == 1:
        return Glm5Model(cfg, weights, be)
    return StagedGlm5Model(cfg, weights, be, plan, devices)


def model_from_args(args) -> Glm5Model:
    """build_model from model_args' options."""
    return build_model(args.preset, args.backend, args.seed, args.dtype, args.gpus, args.stage_layers,
                       args.stage_devices)


def random_tokens(cfg: ModelConfig, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n)


def prime_context(model: Glm5Model, n: int, room: int, seed: int):
    """A cache primed with n random tokens, with room for `room` more -> (cache, greedy next token)."""
    cache = model.new_cache(n + room)
    logits = model.prime(random_tokens(model.cfg, n, seed), cache)
    return cache, int(np.argmax(logits))


# ---- timing -----------------------------------------------------------------------------------

def timed_call(fn, be):
    """(milliseconds, result) of one fn() call on backend `be`. The clock starts with no work
    queued and stops once fn's work is done (a walk ends in a host copy of its result anyway),
    so a step's time is its device time plus the host's launch work."""
    be.synchronize()
    start = time.perf_counter()
    result = fn()
    be.synchronize()
    return (time.perf_counter() - start) * 1e3, result


def time_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median GPU milliseconds of fn() between CUDA events, over reps after `warmup` untimed
    calls: one kernel's time, without the host synchronisation timed_call pays (CUDA only)."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second, in GB/s): the roof."""
    import cupy as cp

    src = cp.ones(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    ms = time_ms(lambda: cp.copyto(dst, src), reps=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def roof_gbs(be) -> float | None:
    """The bandwidth a walk is held against: the device's copy bandwidth, or None for a backend
    whose arrays are host numpy arrays (no device memory to measure)."""
    return None if be.xp is np else copy_bandwidth_gbs()


def session_tokens(model: Glm5Model, prompt, steps: int) -> tuple[float, list[int]]:
    """Greedy decode as PlainSession delivers it, one step ahead of the host -> (ms per token,
    the tokens). WARMUP_STEPS + 1 untimed tokens first (the eager first walk and the capture),
    then `steps` timed between two returned tokens, each with the step after it in flight (max_ctx
    leaves room for it), so the span holds exactly one step per token. The tokens are the
    session's from the prompt's first on."""
    session = PlainSession(model, prompt, len(prompt) + WARMUP_STEPS + steps + 3)
    tokens = session.burst(WARMUP_STEPS + 1)
    start = time.perf_counter()
    timed = session.burst(steps)
    ms = (time.perf_counter() - start) * 1e3 / len(timed)
    assert session.ahead is not None, "session_tokens: the timed burst must end with a step in flight"
    return ms, tokens + timed


def greedy_steps(model: Glm5Model, cache, token: int, steps: int, tape: list | None = None):
    """`steps` plain greedy decode steps (decode_greedy, as PlainSession takes them), each fed the
    previous argmax -> (ms of each step, next token). With `tape`, every token fed is appended."""
    times = []
    for _ in range(steps):
        if tape is not None:
            tape.append(token)
        ms, token = timed_call(functools.partial(model.decode_greedy, token, cache), model.be)
        times.append(ms)
    return times, token


def verify_times(model: Glm5Model, cache, tokens: list[int], reps: int, host_logits: bool = False, keep: int = 1):
    """`reps` verify walks of `tokens` at cache.pos, each followed by rollback(keep) and
    rewound -> (ms of each verify, ms of each rollback). The cache ends where it started.
    The walk is verify_greedy, as a greedy round takes it (each row's argmax where the logits
    are, t ints to the host: the decode step's decode_greedy does the same for one row);
    host_logits: verify_rows instead, which copies the [t, V] float logits to the host."""
    walk = model.verify_rows if host_logits else model.verify_greedy
    verify, rollback = [], []
    for _ in range(reps):
        ms, (_, _, ckpt) = timed_call(functools.partial(walk, tokens, cache), model.be)
        verify.append(ms)
        rollback.append(timed_call(functools.partial(model.rollback, cache, ckpt, keep), model.be)[0])
        model.rewind(cache, ckpt)
    return verify, rollback


@contextlib.contextmanager
def counted_launches():
    """Count memra kernel launches by "family.kernel", by wrapping `launch` where each
    memra.backend.cuda.* module imported it. Yields None on a backend without kernels. CuPy's own
    elementwise and copy kernels do not go through `launch` and are not counted."""
    runtime = sys.modules.get("memra.backend.cuda.runtime")
    if runtime is None:
        yield None
        return
    inner, counts = runtime.launch, collections.Counter()

    def counting(family, name, *args, **kwargs):
        counts[f"{family}.{name}"] += 1
        return inner(family, name, *args, **kwargs)

    modules = [m for n, m in list(sys.modules.items())
               if n.startswith("memra.backend.cuda.") and getattr(m, "launch", None) is inner]
    for m in modules:
        m.launch = counting
    try:
        yield counts
    finally:
        for m in modules:
            m.launch = inner


@contextlib.contextmanager
def routed_experts(be):
    """Record, per moe_route call (one per MoE layer walked), how many distinct routed experts its
    rows picked: the expert weights the walk reads (a stacked shared expert, id E, is not one of
    them: it is read on every walk, counted with the trunk). Wraps the backend instance's method only."""
    inner, picked = be.moe_route, []

    def recording(x, w_gate, *args, **kwargs):
        idx, wts = inner(x, w_gate, *args, **kwargs)
        ids = be.to_host(idx)
        picked.append(int(np.unique(ids[ids < w_gate.shape[0]]).size))
        return idx, wts

    be.moe_route = recording
    try:
        yield picked
    finally:
        del be.moe_route  # the class method shows through again


# ---- rates -------------------------------------------------------------------------------------

def gbs(nbytes: int, ms: float) -> float:
    """Achieved GB/s for nbytes moved in ms milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9


def bandwidth_fraction(nbytes: int, ms: float, roof_gbs: float | None) -> float | None:
    return None if roof_gbs is None else gbs(nbytes, ms) / roof_gbs


# ---- the command line and the record ----------------------------------------------------------

def int_list(text: str) -> list[int]:
    """"512,4096" or "1-15" or "1-4,8" -> the integers, in order."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def model_args(doc: str) -> argparse.ArgumentParser:
    """The options every model benchmark takes; a script adds its own."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--preset", default="bench", help="config preset (bench, bench-dense, bench-xl, small, mini)")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "numpy"))
    ap.add_argument("--git-sha", required=True, help="the commit measured (recorded in the JSON)")
    ap.add_argument("--out", help="also write the JSON record here")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps")
    ap.add_argument("--context", type=int, default=512, help="tokens primed before decode / verify")
    ap.add_argument("--seed", type=int, default=0, help="weights and prompt tokens")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"),
                    help="weights: bf16, or the FP8 release's split (e4m3 + 128x128 block scales)")
    ap.add_argument("--gpus", type=int, default=1,
                    help="pipeline stages, balanced by weight bytes, stage s on GPU s (numpy: in this process)")
    ap.add_argument("--stage-layers", help="the pipeline split by hand, like 0-5,6-11")
    ap.add_argument("--stage-devices", type=int_list,
                    help="the GPU of each stage, like 0,0: every stage on GPU 0 measures the split's own cost")
    return ap


def model_config(args, model: Glm5Model, **extra) -> dict:
    """The `config` of a model benchmark's record: the options and the full model config."""
    staged = getattr(model, "placement", None)
    stages = {} if staged is None else {"stage_layers": staged.describe(), "stage_devices": list(model.lanes.devices)}
    return {"preset": args.preset, "backend": args.backend, "seed": args.seed, "context": args.context,
            "steps": args.steps, **stages, **extra,
            "weights": f"{getattr(args, 'dtype', 'bf16')}, built in memory (benchmarks/common.py)",
            "model": model.cfg.to_dict()}


def record_header(bench: str, git_sha: str, config: dict, be) -> dict:
    """The head of every record: what ran, where (backend `be`'s device), when, on which commit."""
    return {"bench": bench, "git_sha": git_sha, "date": datetime.date.today().isoformat(),
            "device": be.device_name(), "config": config}


def placement(config: dict) -> str:
    """" stages 0-5,6-11 on GPUs 0,1" for a record's config that ran staged, else ""."""
    split, gpus = config.get("stage_layers"), config.get("stage_devices") or []
    if split is None:
        return ""
    return f" stages {split}" + ("" if None in gpus else f" on GPUs {','.join(map(str, gpus))}")


def card_head(record: dict) -> str:
    """"bench_x PRESET[ stages ...] on DEVICE": a card's first words."""
    return f"{record['bench']} {record['config']['preset']}{placement(record['config'])} on {record['device']}"


def emit(record: dict, card_lines: list[str], out_path: str | None = None) -> None:
    """The readable card on stderr, then the record as ONE JSON line on stdout (and in out_path)."""
    for line in card_lines:
        print(line, file=sys.stderr)
    line = json.dumps(record)
    if out_path:
        with open(out_path, "w") as f:
            f.write(line + "\n")
    print(line)
