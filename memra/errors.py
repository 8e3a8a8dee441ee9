"""Every refusal memra makes is one of these exceptions.

Each message names the bound that was crossed and how to fix it, so a caller (or the CLI, which
prints the message without a traceback) can act on it. Catch `MemraError` to catch them all.
"""


class MemraError(Exception):
    """Base of every error memra raises on purpose."""


class ConfigError(MemraError):
    """config.json is missing, malformed, inconsistent or asks for something unsupported."""


class CheckpointError(MemraError):
    """A checkpoint file is unreadable, corrupt, or breaks the tensor contract."""


class InputError(MemraError):
    """A caller passed a bad argument (token id outside the vocab, empty prompt, bad option)."""


class ContextOverflowError(MemraError):
    """A step would write past the cache's max_ctx."""


class ResidencyError(MemraError):
    """A cache plane was read past what its committed length justifies (the residency tripwire)."""


class BackendError(MemraError):
    """The compute backend cannot run what was asked: it is unavailable on this machine, or a rank
    of a model split over processes failed (memra.model.ranks)."""


def describe(exc: BaseException) -> str:
    """`Type: message` of an exception someone else raised (a plugin's), even one whose own
    __str__ fails."""
    try:
        text = str(exc)
    except Exception:
        text = "(its message could not be read)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
