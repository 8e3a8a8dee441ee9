"""The memory plan on the command line: `--plan` prints it instead of generating (no tensor is read),
and a run's summary and --json record carry the plan of the model it loaded.

    python -m memra.run --plan --checkpoint DIR --max-ctx 32768 --json
    python -m memra.run --plan --preset full --weights-dtype fp8     # GLM-5-Next as released, no files
"""

from __future__ import annotations

import json

from memra.errors import MemraError
from memra.limits import spec_context

EXIT_DOES_NOT_FIT = 2


def _placement(args, cfg) -> tuple[int, tuple | None]:
    """(devices, the stages' layer ranges or None: balanced by bytes) of --gpus / --stage-layers,
    checked as a run's load_model checks them."""
    from memra.model.stages import plan_stages

    gpus = getattr(args, "gpus", None) or 1  # the pipeline's flags, where the CLI has them
    stage_layers = getattr(args, "stage_layers", None)
    if stage_layers is None:
        return gpus, None
    ranges = plan_stages(cfg.num_hidden_layers, gpus, stage_layers).ranges
    return len(ranges), ranges


def plan_command(args, out, err) -> int:
    """Print the plan of --preset or the checkpoint (or the demo model) for --max-ctx (default: the
    model's max_position_embeddings) on this backend's free memory; exit 2 when it does not fit."""
    from memra.backend import get_backend
    from memra.config import ModelConfig, load_config, preset
    from memra.memory import free_bytes
    from memra.memory_plan import plan_for_checkpoint, plan_for_config

    be = get_backend(args.backend)
    free, graphs = free_bytes(be), bool(getattr(be, "graphs", False))
    if args.preset is not None:
        cfg = ModelConfig.from_dict(preset(args.preset))
        devices, ranges = _placement(args, cfg)
        plan = plan_for_config(cfg, args.weights_dtype or "bf16", args.max_ctx, devices, free, graphs,
                               source=f"preset {args.preset}", ranges=ranges)
    else:
        from memra.cli.inputs import model_source

        path = model_source(args, err).path
        cfg = load_config(path)
        devices, ranges = _placement(args, cfg)
        plan = plan_for_checkpoint(path, cfg, args.max_ctx, devices, free, graphs, ranges)
    print(plan.describe(), file=out, flush=True)
    if args.json:
        print(json.dumps(plan.to_dict()), file=out, flush=True)
    try:
        plan.check()
    except MemraError as exc:
        print(f"memra: {exc}", file=err, flush=True)
        return EXIT_DOES_NOT_FIT
    return 0


def run_plan(path: str, model, n_prompt: int, max_new: int, draft, k: int, free) -> dict | None:
    """The plan of a loaded model at the context its run allocates, against the memory that was free
    before it loaded (None when that is unknown); a dict for the summary and the JSON record."""
    from memra.memory_plan import plan_for_checkpoint

    max_ctx = spec_context(n_prompt, max_new, k) if draft is not None else n_prompt + max_new
    placement = getattr(model, "placement", None)  # a pipeline's stages: the plan of that very split
    ranges = None if placement is None else placement.ranges
    graphs = bool(getattr(model.be, "graphs", False))
    return plan_for_checkpoint(path, model.cfg, max_ctx, free=free, graphs=graphs, ranges=ranges).to_dict()


def plan_line(plan: dict | None) -> str | None:
    """One summary line: the fullest device's bytes and what they are."""
    from memra.memory_plan import size

    if not plan:
        return None
    d = max(plan["per_device"], key=lambda d: d["total"])
    free = "" if d["free"] is None else f" of {size(d['free'])} free"
    return (f"  memory plan: {plan['dtype']} weights, max_ctx {plan['max_ctx']}, {plan['devices']} device(s); "
            f"device {d['device']} needs {size(d['total'])}{free} (weights {size(d['weights_total'])}, "
            f"cache {size(d['cache'])}, buffers {size(d['buffers'])})")
