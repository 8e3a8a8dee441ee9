"""The served model, resolved once at startup the way `python -m memra.run` resolves it.

    engine = Engine(EngineOptions(checkpoint=None, backend="numpy"))   # None: the demo model
    engine.name, engine.tokenizer, engine.eos, engine.default_draft, engine.drafter("native-mtp")
    engine = Engine(EngineOptions(draft="native-mtp"), model=model)    # a model already in memory

The checkpoint (or the demo model memra ships), its tokenizer, EOS ids and
generation_config.json come from memra.cli.inputs. Every registered draft source is loaded here
once (weights once per model; each request opens its own state on it); a source that cannot load
(dflash2 without --draft-option dflash2:path=DIR) is listed as unavailable with the reason, and a
request naming it gets that reason back. A source the operator asked for by name must load.

`model=` serves a model already in memory (benchmarks/bench_serve.py: the `bench` preset's ~46 GB
of weights are built in memory, never written to disk); options.backend is then unused (the
model has its own). The tokenizer, chat template and generation_config.json still come from
options.checkpoint when one is given; without one there are none (the demo is not used): requests
send token ids, EOS is the model config's, and the name is options.served_model_name or
IN_MEMORY_NAME.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

from memra.cli import inputs
from memra.errors import InputError, MemraError
from memra.limits import MAX_K, spec_context
from memra.serve.chat import ChatTemplate
from memra.serve.protocol import ApiError, Job

DEMO_NAME = "memra-demo"
IN_MEMORY_NAME = "memra-in-memory"   # a model= engine without a checkpoint or a served name
WARMUP_PROMPT = 64   # long enough to reach the sparse (kpool) attention path


@dataclass
class EngineOptions:
    checkpoint: str | None = None
    backend: str = "auto"
    stages: int = 1                          # pipeline stages (memra.load_model): --gpus
    stage_layers: str | None = None          # an explicit split: --stage-layers
    max_ctx: int | None = None
    draft: str | None = None                 # None: the CLI's default; "none": plain decoding
    num_draft_tokens: int = 4
    draft_options: dict = field(default_factory=dict)  # source -> {key: value}
    drafts: tuple[str, ...] | None = None    # the sources offered (None: every registered one)
    served_model_name: str | None = None
    default_max_tokens: int = 256


class Engine:
    def __init__(self, options: EngineOptions, err=sys.stderr, model=None):
        from memra import load_model
        from memra.tokenizer import load_tokenizer

        if model is None or options.checkpoint is not None:
            self.source = inputs.model_source(SimpleNamespace(checkpoint=options.checkpoint), err)
        else:  # a model in memory and no checkpoint: no tokenizer, no generation config, no demo
            self.source = inputs.Source(None, False, {})
        self.model = model if model is not None else load_model(self.source.path, backend=options.backend,
                                                                stages=options.stages,
                                                                stage_layers=options.stage_layers)
        cfg = self.model.cfg
        self.vocab_size = cfg.vocab_size
        limit = cfg.max_position_embeddings
        if options.max_ctx is not None and not 2 <= options.max_ctx <= limit:
            raise InputError(f"--max-ctx {options.max_ctx} is outside 2..{limit} (the model's "
                             f"max_position_embeddings): give at most {limit}")
        self.max_ctx = options.max_ctx or limit
        path = self.source.path
        self.tokenizer = load_tokenizer(path, cfg.vocab_size) if path is not None else None
        self.chat = ChatTemplate.load(path) if path is not None else ChatTemplate()
        self.eos = inputs.eos_ids(SimpleNamespace(ignore_eos=False, eos=None), self.source, cfg)
        self.default_draft, self.draft_why = inputs.draft_choice(SimpleNamespace(draft=options.draft),
                                                                 self.source, cfg)
        for note in inputs.unapplied_generation(self.source):
            print(f"memra serve: {note}", file=err)
        self.default_k = options.num_draft_tokens
        least = spec_context(2, 1, self.default_k)  # a 2-token prompt and one token, speculatively
        if self.default_draft is not None and self.max_ctx < least:
            raise InputError(f"--max-ctx {self.max_ctx} cannot hold a speculative round of the default draft source "
                             f"{self.default_draft!r} at K={self.default_k} (it needs at least {least} positions): "
                             f"give --max-ctx {least} or more, or --draft none")
        self.default_max_tokens = options.default_max_tokens
        self.drafters, self.unavailable = _load_drafters(self.model, options, self.default_draft, self.source)
        name = options.served_model_name
        self.name = name or (DEMO_NAME if self.source.demo else IN_MEMORY_NAME if path is None
                             else os.path.basename(os.path.normpath(path)))

    def drafter(self, name: str):
        """The loaded drafter of a source, or a 400 naming why it is not offered."""
        if name in self.drafters:
            return self.drafters[name]
        offered = sorted(self.drafters)
        if name in self.unavailable:
            raise ApiError(400, f"draft source {name!r} is not available on this server ({self.unavailable[name]}); "
                                f"available: {offered} or null", "draft")
        raise ApiError(400, f"unknown draft source {name!r}: choose one of {offered}, or null for plain decoding",
                       "draft")

    def describe(self) -> str:
        draft = f"draft {self.default_draft} (K={self.default_k})" if self.default_draft else "plain decoding"
        where = (f"the demo model at {self.source.path}" if self.source.demo else self.source.path
                 or "a model in memory")
        return (f"{self.name}: {where}, {self.model.be.name} backend, context {self.max_ctx}, default {draft}; "
                f"draft sources {sorted(self.drafters) or 'none'}, chat template {self.chat.name}")

    def warm_up(self) -> None:
        """One short run per draft source (and plain), so first requests do not pay one-time costs
        (kernel compilation on CUDA)."""
        from memra.serve.runs import open_run

        n = max(2, min(WARMUP_PROMPT, self.max_ctx - spec_context(0, 2, MAX_K)))
        prompt = [i % self.vocab_size for i in range(n)]
        for name in [None, *sorted(self.drafters)]:
            k = 1 if name is None else min(self.default_k, getattr(self.drafters[name], "max_k", self.default_k))
            run = open_run(self.model, Job(prompt=prompt, max_tokens=2, draft=name, num_draft_tokens=k),
                           self.drafters.get(name))
            run.step(2)
            run.close()


def _load_drafters(model, options: EngineOptions, default: str | None, source) -> tuple[dict, dict]:
    from memra.drafters.registry import list_draft_sources, load_drafter

    registered = list_draft_sources()
    wanted = set(options.draft_options) | ({default} if default else set())
    offered = registered if options.drafts is None else list(options.drafts)
    unknown = sorted((wanted | set(offered)) - set(registered))
    if unknown:
        raise InputError(f"unknown draft source {unknown[0]!r}: choose one of {registered} (see "
                         "python -m memra.run --list-drafters)")
    missing = sorted(wanted - set(offered))
    if missing:
        raise InputError(f"draft source {missing[0]!r} is configured but left out of --drafts: add it there")
    loaded, unavailable = {}, {}
    for name in offered:
        try:
            loaded[name] = load_drafter(name, model,
                                        inputs.source_draft_options(name, options.draft_options.get(name), source))
        except MemraError as exc:
            if name in wanted:
                raise InputError(f"draft source {name!r} failed to load: {exc}") from None
            unavailable[name] = f"{exc}; start the server with --draft-option {name}:KEY=VALUE"
    return loaded, unavailable
