"""The draft-source registry: built-ins and plugins through one hook, MEMRA_LOAD_PLUGINS, refusals,
and a source the core never saw (registered on the plugin manager, not installed) keeping the tape."""

import importlib.metadata
import re

import pytest

import memra
from memra.drafters import builtin, registry
from memra.drafters.hookspecs import hookimpl
from memra.drafters.native_mtp import NativeMtpSource
from memra.errors import InputError
from memra.generate import generate
from memra.run import main
from memra.speculative.contract import Proposal

NGRAM_INSTALLED = any(ep.name == "ngram" for ep in importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP))
needs_ngram = pytest.mark.skipif(not NGRAM_INSTALLED, reason="pip install -e plugins/memra-ngram first")
NGRAM = {"ngram"} if NGRAM_INSTALLED else set()


# ---- the hook ------------------------------------------------------------------------------------------
def test_hook_memra_register_draft_sources_registers_the_builtins(fresh):
    seen = []
    builtin.memra_register_draft_sources(register=lambda name, source: seen.append((name, source)))
    assert [name for name, _ in seen] == [name for name, _ in builtin.BUILTIN_SOURCES]
    assert isinstance(dict(seen)["native-mtp"], NativeMtpSource)
    impls = registry.plugin_manager().hook.memra_register_draft_sources.get_hookimpls()
    assert builtin in [impl.plugin for impl in impls]
    assert registry.draft_source_origins()["native-mtp"] == "built-in"


def test_hookimpl_is_exported_from_memra():
    assert memra.hookimpl is hookimpl


def test_list_and_origins_agree(fresh):
    names = registry.list_draft_sources()
    assert names == sorted(names) and "native-mtp" in names
    assert list(registry.draft_source_origins()) == names


def test_unknown_source_error_lists_the_available_names(fresh, mini):
    with pytest.raises(InputError, match=r"unknown draft source 'nope'.*'native-mtp'"):
        registry.load_drafter("nope", mini)


# ---- refusals ------------------------------------------------------------------------------------------
class Registers:
    """A plugin whose hook registers the given (name, source) pairs."""

    def __init__(self, *pairs):
        self.pairs = pairs

    @hookimpl
    def memra_register_draft_sources(self, register):
        for name, source in self.pairs:
            register(name, source)


def test_a_duplicate_name_sets_the_later_plugin_aside_and_the_builtin_keeps_it(plugged, mini):
    plugged(Registers(("native-mtp", NativeMtpSource()), ("extra", ConstantSource())), "dup-plugin")
    origin, reason = registry.plugin_failures()["dup-plugin"]
    assert origin == "plugin dup-plugin"
    assert reason == "draft source 'native-mtp' is registered twice: by built-in and by plugin dup-plugin"
    assert registry.draft_source_origins()["native-mtp"] == "built-in"
    assert "extra" not in registry.list_draft_sources()   # the plugin is set aside whole
    assert registry.load_drafter("native-mtp", mini).max_k == NativeMtpSource().load(mini, None).max_k


@pytest.mark.parametrize("name, source, message", [
    ("", NativeMtpSource(), "names are non-empty strings"),
    (7, NativeMtpSource(), "names are non-empty strings"),
    ("cls", NativeMtpSource, "an instance, not a class"),
    ("no-load", object(), "load\\(model, options\\)"),
    *[(name, NativeMtpSource(), "which --draft and --drafts cannot name")
      for name in ("none", "None", " ", "a,b", "x:y")],
])
def test_malformed_registrations_set_the_plugin_aside(plugged, name, source, message):
    plugged(Registers((name, source)), "bad-plugin")
    origin, reason = registry.plugin_failures()["bad-plugin"]
    assert origin == "plugin bad-plugin" and re.search(message, reason)
    assert set(registry.list_draft_sources()) == {n for n, _ in builtin.BUILTIN_SOURCES} | NGRAM


def test_a_drafter_without_the_interface_is_refused(plugged, mini):
    class Hollow:
        def load(self, model, options):
            return object()

    plugged(Registers(("hollow", Hollow())), "hollow-plugin")
    with pytest.raises(InputError, match=r"'hollow' \(plugin hollow-plugin\).*without \['begin', 'tap_layers'\]"):
        registry.load_drafter("hollow", mini)


# ---- MEMRA_LOAD_PLUGINS --------------------------------------------------------------------------------
@needs_ngram
def test_unset_allow_list_loads_every_installed_plugin(fresh):
    assert registry.draft_source_origins()["ngram"].startswith("memra-ngram ")


@needs_ngram
@pytest.mark.parametrize("allow", ["", "someone-else", " , "])
def test_allow_list_without_ngram_hides_it_and_asking_is_a_clear_error(fresh, mini, allow):
    fresh.setenv(registry.ALLOW_LIST_ENV, allow)
    registry.reset_registry()
    assert registry.list_draft_sources() == sorted(name for name, _ in builtin.BUILTIN_SOURCES)
    with pytest.raises(InputError, match=rf"unknown draft source 'ngram'.*MEMRA_LOAD_PLUGINS={allow!r}"):
        registry.load_drafter("ngram", mini)


@needs_ngram
@pytest.mark.parametrize("allow", ["ngram", "other, ngram"])
def test_allow_list_naming_ngram_loads_it(fresh, allow):
    fresh.setenv(registry.ALLOW_LIST_ENV, allow)
    registry.reset_registry()
    assert "ngram" in registry.list_draft_sources() and "native-mtp" in registry.list_draft_sources()


# ---- a source the core never saw -----------------------------------------------------------------------
class ConstantSource:
    """Always drafts `token` k times: the core must keep the plain tape with it, unchanged."""

    max_k, tap_layers = 14, ()

    def __init__(self, token=0):
        self.token = token

    def load(self, model, options):
        return ConstantSource(**(options or {}))

    def begin(self, start):
        return self

    def propose(self, k, sampling):
        return Proposal(tokens=[self.token] * k)

    def commit(self, outcome):
        pass


@pytest.mark.parametrize("k", [1, 5, 14])
def test_a_plugin_registered_on_the_manager_keeps_the_plain_tape(plugged, mini, k):
    plugged(Registers(("constant", ConstantSource())), "constant-plugin")
    assert registry.draft_source_origins()["constant"] == "plugin constant-plugin"
    prompt = [1, 2, 3, 4, 5, 6]
    plain = generate(mini, prompt, 40)
    token = max(set(plain.tokens), key=plain.tokens.count)   # so rounds both accept and reject
    spec = generate(mini, prompt, 40, draft="constant", num_draft_tokens=k, draft_options={"token": token})
    assert spec.tokens == plain.tokens
    assert 0 < spec.stats["num_accepted_tokens"] < spec.stats["num_draft_tokens"]


# ---- the CLI -------------------------------------------------------------------------------------------
def test_list_drafters_prints_each_source_and_its_origin_without_a_model(fresh, tmp_path, capsys):
    assert main(["--list-drafters", "--model", str(tmp_path / "no-such-model")]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = dict(line.split(None, 1) for line in lines)
    assert table == registry.draft_source_origins() and table["native-mtp"] == "built-in"


def test_list_drafters_shows_a_set_aside_plugin_with_its_reason(plugged, capsys):
    plugged(Registers(("native-mtp", NativeMtpSource())), "dup-plugin")
    assert main(["--list-drafters"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = dict(line.split(None, 1) for line in lines)
    assert table["native-mtp"] == "built-in"
    assert table["dup-plugin"].startswith("plugin dup-plugin: FAILED, draft source 'native-mtp' is registered twice")
    assert registry.ALLOW_LIST_ENV in table["dup-plugin"]
