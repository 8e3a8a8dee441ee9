"""Shared pieces of the DFlash2 network tests: fixture drafters, checkpoint rewrites, context rows."""

import os

import numpy as np

from memra.config import preset
from memra.drafters.dflash2 import write_fixture_drafter
from memra.safetensors_io import bf16_to_f32, read_safetensors, write_safetensors

F32 = np.float32
TRUNKS = (("mini", 0), ("small", 13))            # (preset, fixture seed) the source tests run on
TAPS = {"mini": (0, 2), "small": (0, 2, 4)}     # room for the +1 tap shift in both trunks


def drafter_maker(model, tmp_path_factory, prefix: str, seed: int, variants: dict, **common):
    """make(variant, **extra) -> a fixture drafter dir for `model`'s trunk, written once per key."""
    made = {}

    def make(variant: str = "dflash", **extra) -> str:
        key = (variant, tuple(sorted(extra.items())))
        if key not in made:
            shape = {"target_layer_ids": TAPS[model.preset_name], **common, **variants[variant], **extra}
            made[key] = write_fixture_drafter(tmp_path_factory.mktemp(f"{prefix}-{variant}"),
                                              preset(model.preset_name), seed=seed, **shape)
        return made[key]

    return make


def drafter(tmp_path, name="d", target_name="small", **shape):
    return write_fixture_drafter(tmp_path / name, preset(target_name), **shape)


def rewrite(dir, edit):
    """Apply edit(tensors) to a fixture's safetensors (as float32)."""
    path = os.path.join(dir, "model.safetensors")
    tensors = {n: (bf16_to_f32(a) if d == "BF16" else a) for n, (d, _, a) in read_safetensors(path).items()}
    edit(tensors)
    write_safetensors(path, tensors, dtype="float32")


def ctx_rows(draft, n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (n, draft.cfg.hidden_size)).astype(F32)


def primed(draft, n_ctx=9, seed=1):
    kv = draft.new_kv(64)
    draft.ingest(kv, ctx_rows(draft, n_ctx, seed))
    return kv
