"""memra's built-in draft sources, registered through the public plugin hook like any plugin.

Each entry is (source name, "module:Class"); the class is instantiated with no arguments and
its module imported only when the registry is first built.
"""

from __future__ import annotations

import importlib

from memra.drafters.hookspecs import hookimpl

BUILTIN_SOURCES = (
    ("dflash2", "memra.drafters.dflash2:DFlash2Source"),
    ("native-mtp", "memra.drafters.native_mtp:NativeMtpSource"),
)


@hookimpl
def memra_register_draft_sources(register):
    for name, target in BUILTIN_SOURCES:
        module, _, attr = target.partition(":")
        register(name, getattr(importlib.import_module(module), attr)())
