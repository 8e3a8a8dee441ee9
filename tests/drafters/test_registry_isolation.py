"""One broken plugin never takes the others down: a plugin whose hook raises, that registers
garbage, that fails to import or that implements a hook memra does not have is set aside on its
own. Built-ins and healthy plugins keep working, `--list-drafters` shows the broken one with its
one-line reason, and asking for its source names the plugin and the fix (MEMRA_LOAD_PLUGINS)."""

import sys
import textwrap

import pytest

from memra.drafters import registry
from memra.drafters.hookspecs import hookimpl
from memra.errors import InputError
from memra.generate import generate
from memra.run import main
from memra.speculative.contract import Proposal

PROMPT = [1, 2, 3, 4, 5, 6]


class EchoSource:
    """A healthy source: drafts the last emitted token k times."""

    max_k, tap_layers = 14, ()

    def load(self, model, options):
        return self

    def begin(self, start):
        return EchoState(start.anchor)


class EchoState:
    def __init__(self, last):
        self.last = last

    def propose(self, k, sampling):
        return Proposal(tokens=[self.last] * k)

    def commit(self, outcome):
        self.last = outcome.bonus


class Healthy:
    @hookimpl
    def memra_register_draft_sources(self, register):
        register("echo", EchoSource())


class RaisesAfter:
    """Registers `names` (valid), then fails with `exc`."""

    def __init__(self, exc, *names):
        self.exc, self.names = exc, names

    @hookimpl
    def memra_register_draft_sources(self, register):
        for name in self.names:
            register(name, EchoSource())
        raise self.exc


class SwallowsRefusal:
    """Registers a class, catches memra's refusal and goes on: still set aside."""

    @hookimpl
    def memra_register_draft_sources(self, register):
        try:
            register("sneaky", EchoSource)
        except InputError:
            pass
        register("sneaky-ok", EchoSource())


# ---- a hook that raises -----------------------------------------------------------------------------
def test_a_raising_hook_is_set_aside_and_everything_else_keeps_working(plugged, mini):
    plugged(RaisesAfter(RuntimeError("boom in the hook"), "half-done"), "raising-plugin")
    plugged(Healthy(), "healthy-plugin")
    origin, reason = registry.plugin_failures()["raising-plugin"]
    assert origin == "plugin raising-plugin"
    assert reason == "its memra_register_draft_sources hook raised RuntimeError: boom in the hook"
    names = registry.list_draft_sources()
    assert "native-mtp" in names and "echo" in names and "half-done" not in names
    plain = generate(mini, PROMPT, 24).tokens
    assert generate(mini, PROMPT, 24, draft="native-mtp", num_draft_tokens=3).tokens == plain
    assert generate(mini, PROMPT, 24, draft="echo", num_draft_tokens=3).tokens == plain


def test_asking_for_a_set_aside_source_names_the_plugin_and_the_fix(plugged, mini):
    plugged(RaisesAfter(ValueError("bad config"), "half-done"), "raising-plugin")
    with pytest.raises(InputError) as err:
        registry.load_drafter("half-done", mini)
    msg = str(err.value)
    assert "'half-done' is unavailable: its plugin raising-plugin (plugin raising-plugin)" in msg
    assert "ValueError: bad config" in msg and registry.ALLOW_LIST_ENV in msg and "\n" not in msg


def test_an_unknown_name_while_a_plugin_failed_mentions_the_failure(plugged, mini):
    plugged(RaisesAfter(KeyError("nothing registered")), "empty-plugin")
    with pytest.raises(InputError, match=r"unknown draft source 'nope'.*1 plugin\(s\) failed and may provide it: "
                                         r"empty-plugin \(its memra_register_draft_sources hook raised KeyError"):
        registry.load_drafter("nope", mini)


def test_a_plugin_that_swallows_the_refusal_is_still_set_aside(plugged):
    plugged(SwallowsRefusal(), "sneaky-plugin")
    _, reason = registry.plugin_failures()["sneaky-plugin"]
    assert "an instance, not a class" in reason
    assert "sneaky-ok" not in registry.list_draft_sources()


def test_a_long_multiline_failure_is_one_clipped_line(plugged):
    plugged(RaisesAfter(RuntimeError("line one\nline two " + "x" * 500)), "noisy-plugin")
    _, reason = registry.plugin_failures()["noisy-plugin"]
    assert "\n" not in reason and len(reason) <= registry.REASON_CHARS and "line one line two" in reason


def test_a_source_whose_load_raises_is_refused_naming_it(plugged, mini):
    class Exploding:
        def load(self, model, options):
            raise ZeroDivisionError("load blew up")

    plugged(type("P", (), {"memra_register_draft_sources": hookimpl(
        lambda self, register: register("exploding", Exploding()))})(), "exploding-plugin")
    with pytest.raises(InputError, match=r"draft source 'exploding' \(plugin exploding-plugin\) failed to load: "
                                         r"ZeroDivisionError: load blew up"):
        registry.load_drafter("exploding", mini)
    assert registry.load_drafter("native-mtp", mini) is not None


def test_list_drafters_lists_the_healthy_and_the_broken(plugged, capsys):
    plugged(RaisesAfter(RuntimeError("boom")), "raising-plugin")
    plugged(Healthy(), "healthy-plugin")
    assert main(["--list-drafters"]) == 0
    table = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert table["native-mtp"] == "built-in" and table["echo"] == "plugin healthy-plugin"
    assert table["raising-plugin"] == ("plugin raising-plugin: FAILED, its memra_register_draft_sources hook raised "
                                       "RuntimeError: boom (fix or uninstall it, or leave it out of "
                                       "MEMRA_LOAD_PLUGINS)")


# ---- installed plugins that fail to import or implement an unknown hook -------------------------------
PACKAGES = {
    # distribution, entry-point name, module, source
    "exploding": ("memra-iso-exploding", "memra_iso_exploding", 'raise RuntimeError("exploded at import")\n'),
    "misspelt": ("memra-iso-misspelt", "memra_iso_misspelt", """
        import memra

        @memra.hookimpl
        def memra_register_draft_source(register):   # one letter short of the real hook
            pass
    """),
    "healthy": ("memra-iso-healthy", "memra_iso_healthy", """
        import memra
        from tests.drafters.test_registry_isolation import EchoSource

        @memra.hookimpl
        def memra_register_draft_sources(register):
            register("healthy-echo", EchoSource())
    """),
}


@pytest.fixture
def installed(fresh, tmp_path):
    """Three fake installed plugins on sys.path (dist-info with entry points, and their modules)."""
    for ep_name, (dist, module, source) in PACKAGES.items():
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{ep_name} = {module}\n")
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    fresh.syspath_prepend(str(tmp_path))
    registry.reset_registry()
    yield fresh
    for _, module, _ in PACKAGES.values():
        sys.modules.pop(module, None)


def test_a_plugin_that_fails_to_import_is_set_aside(installed, mini):
    failures = registry.plugin_failures()
    assert failures["exploding"] == ("memra-iso-exploding 0.1", "failed to load: RuntimeError: exploded at import")
    assert registry.draft_source_origins()["healthy-echo"] == "memra-iso-healthy 0.1"
    plain = generate(mini, PROMPT, 16).tokens
    assert generate(mini, PROMPT, 16, draft="healthy-echo", num_draft_tokens=2).tokens == plain
    with pytest.raises(InputError, match=r"unknown draft source 'exploding'.*exploding \(failed to load: "
                                         r"RuntimeError: exploded at import\).*MEMRA_LOAD_PLUGINS"):
        registry.load_drafter("exploding", mini)


def test_a_plugin_with_a_hook_memra_does_not_have_is_set_aside(installed):
    origin, reason = registry.plugin_failures()["misspelt"]
    assert origin == "memra-iso-misspelt 0.1"
    assert reason.startswith("implements a hook memra does not have: ") and "memra_register_draft_source" in reason
    assert "healthy-echo" in registry.list_draft_sources() and "native-mtp" in registry.list_draft_sources()


def test_leaving_the_broken_ones_out_of_the_allow_list_clears_them(installed):
    installed.setenv(registry.ALLOW_LIST_ENV, "healthy")
    registry.reset_registry()
    assert registry.plugin_failures() == {}
    assert "healthy-echo" in registry.list_draft_sources()


def test_list_drafters_with_a_plugin_that_fails_to_import_exits_0(installed, capsys):
    assert main(["--list-drafters"]) == 0
    table = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert table["exploding"].startswith("memra-iso-exploding 0.1: FAILED, failed to load: RuntimeError")
    assert table["healthy-echo"] == "memra-iso-healthy 0.1" and table["native-mtp"] == "built-in"
