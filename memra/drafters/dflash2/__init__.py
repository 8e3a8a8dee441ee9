"""DFlash2: a block-diffusion drafter that drafts a whole block in one forward (see model.py)."""

from memra.drafters.dflash2.config import load_dflash_config
from memra.drafters.dflash2.fixture import write_fixture_drafter
from memra.drafters.dflash2.model import DflashDraft

__all__ = ["DflashDraft", "load_dflash_config", "write_fixture_drafter"]
from memra.drafters.dflash2.source import DFlash2Source  # noqa: F401  (the `dflash2` draft source)
