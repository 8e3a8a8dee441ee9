"""DFlash2 block-diffusion drafters, which draft a whole block in one forward (see model.py);
DFlash v1 / DSpark checkpoints load through the same code by tensor census (see weights.py)."""

from memra.drafters.dflash2.config import load_dflash_config
from memra.drafters.dflash2.fixture import write_fixture_drafter
from memra.drafters.dflash2.model import DflashDraft

__all__ = ["DflashDraft", "load_dflash_config", "write_fixture_drafter"]
from memra.drafters.dflash2.source import DFlash2Source  # noqa: F401  (the `dflash2` draft source)
