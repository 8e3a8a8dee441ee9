"""The plugin hooks memra calls (pluggy project "memra"; entry-point group "memra.drafters").

A plugin is a module (or object) with `@memra.hookimpl` functions named after these specs.
memra's own draft sources register through the same hook (memra/drafters/builtin.py), so a
third-party source gets exactly what a built-in gets. docs/plugins.md has the tutorial.
"""

from __future__ import annotations

import pluggy

PROJECT = "memra"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def memra_register_draft_sources(register):
    """Register draft sources by calling `register(name, source)` once per source.

    :param register: `register(name: str, source)`. `name` is what users pass as
        `generate(..., draft=name)` and `python -m memra.run --draft name`; it must be unique
        across every loaded plugin. `source` is an object (not a class) with
        `load(model, options: dict | None) -> drafter`, called once per model; the drafter
        follows `memra.speculative.contract.Drafter` (`max_k`, `tap_layers`, `begin(start) -> state`).
        A bad registration raises `InputError` at the call. If the hook raises, or registers
        anything bad, the whole plugin is set aside (none of its sources is offered) while
        built-ins and other plugins keep working; `--list-drafters` shows why.
    """
