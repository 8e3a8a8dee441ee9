"""Draft sources by name, gathered from plugins through the `memra_register_draft_sources` hook.

    list_draft_sources()                      # ['native-mtp', 'ngram', ...]
    draft_source_origins()                    # {'native-mtp': 'built-in', 'ngram': 'memra-ngram 0.1.0'}
    drafter = load_drafter("native-mtp", model, {"d2t": ids})

Plugins: memra's built-ins (memra/drafters/builtin.py) always, then the setuptools entry points
in group `memra.drafters`, filtered by MEMRA_LOAD_PLUGINS: unset = every installed plugin; a
comma-separated list = only those entry-point names; "" = none. The manager is built on first
use and cached; `reset_registry()` rebuilds it (after changing the variable). Plugins registered
on `plugin_manager()` directly (tests, embedding apps) are picked up on the next lookup.

A plugin that misbehaves is set aside on its own, so one broken plugin never takes the others
down: it fails to import, implements a hook memra does not have, its hook raises, or it registers
garbage (a name that is not a non-empty string, a class or an object without `load`, a name
already taken: the plugin gathered first keeps it, built-ins first). None of its sources is
offered; `plugin_failures()` and `--list-drafters` say why in one line; asking for one of its
sources (or for an unknown name while some plugin failed) is an InputError naming the plugin
and the fix (MEMRA_LOAD_PLUGINS).
"""

from __future__ import annotations

import importlib.metadata
import os

import pluggy

from memra.drafters import builtin, hookspecs
from memra.errors import InputError, MemraError, describe
from memra.speculative.contract import label_source

ENTRY_POINT_GROUP = "memra.drafters"
ALLOW_LIST_ENV = "MEMRA_LOAD_PLUGINS"
BUILTIN_ORIGIN = "built-in"
REASON_CHARS = 200   # a failure reason is one line of at most this many characters

_pm: pluggy.PluginManager | None = None
_load_failures: dict = {}    # plugin name -> (origin, reason): failed to import or to validate
_snapshot: tuple = ()        # the manager's (name, plugin) list the table was gathered from
_table: dict = {}            # source name -> (source, origin)
_hook_failures: dict = {}    # plugin name -> (origin, reason, names it registered before failing)


def plugin_manager() -> pluggy.PluginManager:
    """The memra plugin manager: built-ins plus the allowed entry-point plugins (built once)."""
    global _pm, _load_failures
    if _pm is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        pm.register(builtin, name="memra.builtin")
        failures = {}
        for name, origin in _allowed_entry_points():
            try:
                pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
            except Exception as exc:  # one plugin's import error must not stop the others
                failures[name] = (origin, f"failed to load: {_one_line(exc)}")
        while True:  # a plugin with a hook memra does not have is set aside, the rest are kept
            try:
                pm.check_pending()
                break
            except pluggy.PluginValidationError as exc:
                name = pm.get_name(exc.plugin)
                failures[name] = (_origin(pm, exc.plugin, _dists(pm)), f"implements a hook memra does not "
                                  f"have: {_one_line(exc)}")
                pm.unregister(exc.plugin)
        _pm, _load_failures = pm, failures
    return _pm


def reset_registry() -> None:
    """Forget the manager and the source table; the next lookup rebuilds both (re-reads the env)."""
    global _pm, _load_failures, _snapshot, _table, _hook_failures
    _pm, _load_failures, _snapshot, _table, _hook_failures = None, {}, (), {}, {}


def list_draft_sources() -> list[str]:
    """The names of the usable sources (a failed plugin's are left out)."""
    return sorted(_sources())


def draft_source_origins() -> dict[str, str]:
    """name -> where it came from: "built-in", "<distribution> <version>", or "plugin <name>";
    then one entry per failed plugin (keyed by its plugin name): "<origin>: FAILED, <reason>"."""
    out = {name: origin for name, (_, origin) in sorted(_sources().items())}
    for plugin, (origin, reason) in sorted(plugin_failures().items()):
        key = plugin if plugin not in out else f"{plugin} (plugin)"
        out[key] = f"{origin}: FAILED, {reason} (fix or uninstall it, or leave it out of {ALLOW_LIST_ENV})"
    return out


def plugin_failures() -> dict[str, tuple[str, str]]:
    """plugin name -> (origin, one-line reason) for every plugin that was set aside."""
    _sources()
    out = dict(_load_failures)
    out.update({name: (origin, reason) for name, (origin, reason, _) in _hook_failures.items()})
    return out


def load_drafter(name: str, model, options: dict | None = None):
    """Load the named source's drafter for `model` (weights once, per model)."""
    sources = _sources()
    if name not in sources:
        raise InputError(_unknown_message(name, sorted(sources)))
    source, origin = sources[name]
    label = f"draft source {name!r} ({origin})"
    try:
        drafter = source.load(model, options)
    except MemraError:
        raise  # the source's own refusal (bad options, bad files) already says what to fix
    except Exception as exc:
        raise InputError(f"{label} failed to load: {_one_line(exc)}; fix or uninstall the plugin, or leave it "
                         f"out of {ALLOW_LIST_ENV}") from exc
    missing = [attr for attr in ("begin", "tap_layers") if not hasattr(drafter, attr)]
    if missing:
        raise InputError(f"{label} loaded a drafter without {missing}: see memra.speculative.contract.Drafter")
    label_source(drafter, label)
    return drafter


def _unknown_message(name: str, available: list[str]) -> str:
    for plugin, (origin, reason, names) in _hook_failures.items():
        if name in names:
            return (f"draft source {name!r} is unavailable: its plugin {plugin} ({origin}) {reason}; fix or "
                    f"uninstall it, or leave it out of {ALLOW_LIST_ENV}")
    msg = f"unknown draft source {name!r}: choose one of {available}"
    failed = plugin_failures()
    if failed:
        first = ", ".join(f"{plugin} ({reason})" for plugin, (_, reason) in sorted(failed.items())[:2])
        msg += (f"; {len(failed)} plugin(s) failed and may provide it: {first}; fix or uninstall them, or leave "
                f"them out of {ALLOW_LIST_ENV}")
    limit = os.environ.get(ALLOW_LIST_ENV)
    if limit is not None:
        msg += f" (third-party plugins are limited by {ALLOW_LIST_ENV}={limit!r})"
    return msg


def _allowed_entry_points() -> list[tuple[str, str]]:
    """(entry-point name, origin) of the plugins to load, in name order."""
    origins = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        origins.setdefault(ep.name, f"{dist.name} {dist.version}" if dist is not None else f"entry point {ep.name}")
    allow = os.environ.get(ALLOW_LIST_ENV)
    wanted = None if allow is None else {name.strip() for name in allow.split(",") if name.strip()}
    return [(name, origins[name]) for name in sorted(origins) if wanted is None or name in wanted]


def _sources() -> dict:
    """The source table, gathered again whenever the manager's plugin list has changed."""
    global _snapshot, _table, _hook_failures
    pm = plugin_manager()
    snapshot = tuple(pm.list_name_plugin())
    if snapshot != _snapshot:
        (_table, _hook_failures), _snapshot = _gather(pm), snapshot
    return _table


def _gather(pm: pluggy.PluginManager) -> tuple[dict, dict]:
    """Call each plugin's hook on its own, so every source is tagged with the plugin it came
    from and a plugin that fails is set aside whole: (table, failures)."""
    table: dict = {}
    failures: dict = {}
    dists = _dists(pm)
    plugins = [plugin for _, plugin in pm.list_name_plugin() if plugin is not None]
    for plugin in plugins:
        origin = _origin(pm, plugin, dists)
        staged: dict = {}
        problems: list[str] = []   # kept here too, in case the plugin catches register's refusal

        def register(name, source, origin=origin, staged=staged, problems=problems):
            if not isinstance(name, str) or not name:
                problems.append(f"registered a draft source under {name!r}: names are non-empty strings")
            elif not _usable_name(name):
                problems.append(f"registered a draft source under {name!r}, which --draft and --drafts cannot name: "
                                "use letters, digits, '-', '_' and '.' (and not 'none', which means plain decoding)")
            elif isinstance(source, type) or not callable(getattr(source, "load", None)):
                problems.append(f"registered draft source {name!r} as {_short(source)}: register an object with "
                                "load(model, options) (an instance, not a class)")
            elif name in table or name in staged:
                first = table[name][1] if name in table else origin
                problems.append(f"draft source {name!r} is registered twice: by {first} and by {origin}")
            else:
                staged[name] = (source, origin)
                return
            raise InputError(f"{origin}: {problems[-1]}")

        others = [p for p in plugins if p is not plugin]
        try:
            pm.subset_hook_caller("memra_register_draft_sources", remove_plugins=others)(register=register)
        except Exception as exc:
            if not problems:
                problems.append(f"its memra_register_draft_sources hook raised {_one_line(exc)}")
        if problems:
            failures[pm.get_name(plugin)] = (origin, _clip(problems[0]), set(staged))
        else:
            table.update(staged)
    return table, failures


def _usable_name(name: str) -> bool:
    """A name every front door can pass: no space, ',' or ':' (the server's lists and SOURCE:KEY=VALUE
    options split on them), and not a spelling of 'none' (plain decoding)."""
    return name.lower() != "none" and all(c.isalnum() or c in "-_." for c in name)


def _dists(pm: pluggy.PluginManager) -> dict:
    return {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}


def _origin(pm: pluggy.PluginManager, plugin, dists: dict) -> str:
    if plugin is builtin:
        return BUILTIN_ORIGIN
    dist = dists.get(id(plugin))
    if dist is not None:
        return f"{dist.project_name} {dist.version}"
    return f"plugin {pm.get_name(plugin)}"


def _one_line(exc: BaseException) -> str:
    return _clip(describe(exc))


def _clip(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."


def _short(x) -> str:
    return _clip(repr(x))[:60]
