"""Fixtures of the draft-source tests."""

import pytest

from memra import load_model
from memra.drafters import registry

from .dflash2_helpers import TRUNKS


@pytest.fixture(scope="module")
def target(fixture_dir):
    """The `small` target on numpy: what the DFlash2 network tests draft for."""
    return load_model(fixture_dir("small"), backend="numpy")


@pytest.fixture
def fresh(monkeypatch):
    """A registry rebuilt from scratch, with MEMRA_LOAD_PLUGINS unset unless the test sets it."""
    monkeypatch.delenv(registry.ALLOW_LIST_ENV, raising=False)
    registry.reset_registry()
    yield monkeypatch
    registry.reset_registry()


@pytest.fixture
def plugged(fresh):
    """register(plugin, name): put a plugin object on the live manager; removed afterwards."""
    added = []

    def register(plugin, name):
        registry.plugin_manager().register(plugin, name=name)
        added.append(name)

    yield register
    for name in added:
        registry.plugin_manager().unregister(name=name)


@pytest.fixture(scope="module", params=TRUNKS, ids=[name for name, _ in TRUNKS])
def trunk(request, fixture_dir):
    """Each of the `mini` and `small` targets on numpy, tagged with its preset name (the DFlash
    source tests run on both trunks)."""
    name, seed = request.param
    m = load_model(fixture_dir(name, seed=seed), backend="numpy")
    m.preset_name = name
    return m


@pytest.fixture(scope="module")
def mini(fixture_dir):
    """The `mini` target on numpy: what the registry tests draft for."""
    return load_model(fixture_dir("mini"), backend="numpy")
