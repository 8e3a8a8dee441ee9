"""memra: speculative decoding for GLM-5-Next-class hybrid models, exact by construction.

    from memra import load_model
    model = load_model("path/to/checkpoint", backend="auto")
    cache = model.new_cache(4096)
    logits = model.prime(prompt_ids, cache)

Draft-source plugins decorate their hook with `@memra.hookimpl` (docs/plugins.md).
"""

from __future__ import annotations

import os

from memra import errors
from memra.config import ModelConfig, load_config, preset
from memra.drafters.hookspecs import hookimpl
from memra.errors import MemraError
from memra.generate import GenerateResult, generate
from memra.speculative.sampling import SamplingParams

__all__ = ["load_config", "load_model", "load_ranked", "generate", "GenerateResult", "SamplingParams", "preset",
           "ModelConfig", "MemraError", "errors", "hookimpl"]


def load_model(path: str | os.PathLike, backend: str = "auto", stages: int = 1, stage_layers=None,
               devices=None):
    """Load a glm5_next checkpoint directory onto a backend ("numpy" | "cuda" | "auto").

    stages > 1 (or an explicit `stage_layers` split like "0-3,4-7") places the trunk as a
    pipeline of contiguous layer ranges, by default balanced by weight bytes, stage s on local
    GPU `devices[s]` (default: GPU s); the outputs are the one-stage model's, bit for bit
    (docs/pipeline.md). One stage is the plain model."""
    from memra.backend import get_backend
    from memra.checkpoint import load_checkpoint
    from memra.memory_plan import balanced_split, check_device_fits, checkpoint_weight_bytes
    from memra.model.stages import plan_stages, stage_devices
    from memra.model.trunk import Glm5Model

    if not isinstance(path, (str, os.PathLike)):
        raise errors.InputError(f"load_model: path must be a checkpoint directory (a str or os.PathLike), got "
                                f"{type(path).__name__} {path!r:.40}")
    be = get_backend(backend)
    cfg = load_config(path)
    by_bytes = lambda n: balanced_split(checkpoint_weight_bytes(path, cfg), n)  # noqa: E731  the memory plan's split
    plan = plan_stages(cfg.num_hidden_layers, stages, stage_layers, by_bytes)  # refuses a bad split before loading
    stage_devices(devices, plan.count)
    check_device_fits(path, cfg, be, ranges=plan.ranges)  # the memory plan of this split, before any tensor is read
    weights = load_checkpoint(path, cfg, keep_bf16=True)
    if plan.count == 1:
        return Glm5Model(cfg, weights, be)
    from memra.model.pipeline import StagedGlm5Model

    return StagedGlm5Model(cfg, weights, be, plan, devices)


def load_ranked(path: str | os.PathLike, backend: str = "cuda", environ=None):
    """This process's rank of a model split over processes, one GPU each, as a launcher started
    them (torchrun or SLURM: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): rank r
    holds stage r of WORLD_SIZE stages balanced by weight bytes, on GPU LOCAL_RANK, and the ranks
    exchange boundaries and commands over NCCL (cupyx.distributed). The last rank drives: run
    generate() there and close() at the end; every other rank calls serve() (docs/pipeline.md).
    Each rank reads only its own stage's tensors (memra.model.ranks.stage_tensors)."""
    from memra.backend import get_backend
    from memra.checkpoint import load_checkpoint
    from memra.memory_plan import balanced_split, checkpoint_weight_bytes
    from memra.model.comms import NcclComm, launcher_env
    from memra.model.ranks import RankedGlm5Model, stage_tensors
    from memra.model.stages import plan_stages

    env = launcher_env(environ)
    be = get_backend(backend)
    cuda = getattr(be.xp, "cuda", None)
    if cuda is None:
        raise errors.InputError("load_ranked carries the stage boundaries over NCCL and needs backend='cuda'; on "
                                "numpy the stages run in one process: load_model(path, stages=N)")
    cfg = load_config(path)
    plan = plan_stages(cfg.num_hidden_layers, env["world"], None,
                       lambda n: balanced_split(checkpoint_weight_bytes(path, cfg), n))
    weights = load_checkpoint(path, cfg, keep_bf16=True, only=stage_tensors(cfg, plan, env["rank"]))
    cuda.Device(env["local"]).use()
    comm = NcclComm(env["rank"], env["world"], env["host"], env["port"])
    return RankedGlm5Model(cfg, weights, be, plan, env["rank"], comm, device=env["local"])
