"""Draft sources by name, gathered from plugins through the `memra_register_draft_sources` hook.

    list_draft_sources()                      # ['native-mtp', 'ngram', ...]
    draft_source_origins()                    # {'native-mtp': 'built-in', 'ngram': 'memra-ngram 0.1.0'}
    drafter = load_drafter("native-mtp", model, {"d2t": ids})

Plugins: memra's built-ins (memra/drafters/builtin.py) always, then the setuptools entry points
in group `memra.drafters`, filtered by MEMRA_LOAD_PLUGINS: unset = every installed plugin; a
comma-separated list = only those entry-point names; "" = none. The manager is built on first
use and cached; `reset_registry()` rebuilds it (after changing the variable). Plugins registered
on `plugin_manager()` directly (tests, embedding apps) are picked up on the next lookup.
"""

from __future__ import annotations

import importlib.metadata
import os

import pluggy

from memra.drafters import builtin, hookspecs
from memra.errors import InputError

ENTRY_POINT_GROUP = "memra.drafters"
ALLOW_LIST_ENV = "MEMRA_LOAD_PLUGINS"
BUILTIN_ORIGIN = "built-in"

_pm: pluggy.PluginManager | None = None
_snapshot: tuple = ()        # the manager's (name, plugin) list the table was gathered from
_table: dict = {}            # source name -> (source, origin)


def plugin_manager() -> pluggy.PluginManager:
    """The memra plugin manager: built-ins plus the allowed entry-point plugins (built once)."""
    global _pm
    if _pm is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        pm.register(builtin, name="memra.builtin")
        for name in _allowed_entry_points():
            try:
                pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
            except Exception as exc:
                raise InputError(f"the draft-source plugin {name!r} (entry point group {ENTRY_POINT_GROUP}) "
                                 f"failed to load: {exc}; fix or uninstall it, or leave it out of "
                                 f"{ALLOW_LIST_ENV}") from exc
        try:
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise InputError(f"a draft-source plugin implements a hook memra does not have: {exc}") from exc
        _pm = pm
    return _pm


def reset_registry() -> None:
    """Forget the manager and the source table; the next lookup rebuilds both (re-reads the env)."""
    global _pm, _snapshot, _table
    _pm, _snapshot, _table = None, (), {}


def list_draft_sources() -> list[str]:
    return sorted(_sources())


def draft_source_origins() -> dict[str, str]:
    """name -> where it came from: "built-in", "<distribution> <version>", or "plugin <name>"."""
    return {name: origin for name, (_, origin) in sorted(_sources().items())}


def load_drafter(name: str, model, options: dict | None = None):
    """Load the named source's drafter for `model` (weights once, per model)."""
    sources = _sources()
    if name not in sources:
        limit = os.environ.get(ALLOW_LIST_ENV)
        hint = "" if limit is None else f" (third-party plugins are limited by {ALLOW_LIST_ENV}={limit!r})"
        raise InputError(f"unknown draft source {name!r}: choose one of {sorted(sources)}{hint}")
    source, origin = sources[name]
    drafter = source.load(model, options)
    missing = [attr for attr in ("begin", "tap_layers") if not hasattr(drafter, attr)]
    if missing:
        raise InputError(f"draft source {name!r} ({origin}) loaded a drafter without {missing}: "
                         "see memra.speculative.contract.Drafter")
    return drafter


def _allowed_entry_points() -> list[str]:
    installed = sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})
    allow = os.environ.get(ALLOW_LIST_ENV)
    if allow is None:
        return installed
    wanted = {name.strip() for name in allow.split(",") if name.strip()}
    return [name for name in installed if name in wanted]


def _sources() -> dict:
    """The source table, gathered again whenever the manager's plugin list has changed."""
    global _snapshot, _table
    pm = plugin_manager()
    snapshot = tuple(pm.list_name_plugin())
    if snapshot != _snapshot:
        _table, _snapshot = _gather(pm), snapshot
    return _table


def _gather(pm: pluggy.PluginManager) -> dict:
    """Call each plugin's hook on its own, so every source is tagged with the plugin it came from."""
    table: dict = {}
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    plugins = [plugin for _, plugin in pm.list_name_plugin() if plugin is not None]
    for plugin in plugins:
        origin = _origin(pm, plugin, dists)

        def register(name, source, origin=origin):
            if not isinstance(name, str) or not name:
                raise InputError(f"{origin} registered a draft source under {name!r}: names are non-empty strings")
            if isinstance(source, type) or not callable(getattr(source, "load", None)):
                raise InputError(f"{origin} registered draft source {name!r} as {source!r}: register an object "
                                 "with load(model, options) (an instance, not a class)")
            if name in table:
                raise InputError(f"draft source {name!r} is registered twice: by {table[name][1]} and by {origin}; "
                                 f"uninstall one, or leave one out of {ALLOW_LIST_ENV}")
            table[name] = (source, origin)

        others = [p for p in plugins if p is not plugin]
        pm.subset_hook_caller("memra_register_draft_sources", remove_plugins=others)(register=register)
    return table


def _origin(pm: pluggy.PluginManager, plugin, dists: dict) -> str:
    if plugin is builtin:
        return BUILTIN_ORIGIN
    dist = dists.get(id(plugin))
    if dist is not None:
        return f"{dist.project_name} {dist.version}"
    return f"plugin {pm.get_name(plugin)}"
