"""Draft sources by name. Built-ins: `native-mtp` (the checkpoint's NextN block)."""

from __future__ import annotations

from memra.drafters.native_mtp import NativeMtpSource
from memra.errors import InputError

_SOURCES = {NativeMtpSource.name: NativeMtpSource}


def source_names() -> list[str]:
    return sorted(_SOURCES)


def load_drafter(name: str, model, options: dict | None = None):
    """Load the named source's drafter for `model` (weights once, per model)."""
    if name not in _SOURCES:
        raise InputError(f"unknown draft source {name!r}: choose one of {source_names()}")
    return _SOURCES[name]().load(model, options)
