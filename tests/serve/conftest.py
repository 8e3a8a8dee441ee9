"""Fixtures of the server tests: the `small` checkpoint (byte-level vocab, so text round-trips),
a DFlash2 drafter for it, and the oracle draft source registered for one module at a time."""

import pytest

from memra.config import preset


@pytest.fixture(scope="session")
def small_dir(fixture_dir):
    return fixture_dir("small")


@pytest.fixture(scope="session")
def drafter_dir(tmp_path_factory):
    from memra.drafters.dflash2 import write_fixture_drafter

    return write_fixture_drafter(tmp_path_factory.mktemp("dflash2"), preset("small"))


@pytest.fixture(scope="module")
def oracle_tapes():
    """Registers the `oracle` draft source for this module; fill the returned dict (prompt tuple ->
    plain greedy tokens) before its requests run."""
    from memra.drafters import registry
    from tests.serve.helpers import OraclePlugin, OracleSource

    tapes = {}
    registry.reset_registry()
    registry.plugin_manager().register(OraclePlugin(OracleSource(tapes, preset("small")["vocab_size"])),
                                       name="memra-test-oracle")
    yield tapes
    registry.reset_registry()
