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

__all__ = ["load_config", "load_model", "generate", "GenerateResult", "SamplingParams", "preset", "ModelConfig", "MemraError",
           "errors", "hookimpl"]


def load_model(path: str | os.PathLike, backend: str = "auto"):
    """Load a glm5_next checkpoint directory onto a backend ("numpy" | "cuda" | "auto")."""
    from memra.backend import get_backend
    from memra.checkpoint import load_checkpoint
    from memra.model.trunk import Glm5Model

    if not isinstance(path, (str, os.PathLike)):
        raise errors.InputError(f"load_model: path must be a checkpoint directory (a str or os.PathLike), got "
                                f"{type(path).__name__} {path!r:.40}")
    be = get_backend(backend)
    cfg = load_config(path)
    return Glm5Model(cfg, load_checkpoint(path, cfg, keep_bf16=True), be)
