"""Which drafter output rows become drafts: the harvest convention of a DFlash-family checkpoint.

Both training strategies run the same block `[anchor, MASK x (b-1)]` but supervise different
rows, so the row -> position mapping belongs to the checkpoint, not to the loader:

* `dflash` (mask-fill, z-lab DFlash / SpecForge OnlineDFlashModel): row k is trained for the
  token AT anchor+k; the anchor row is untrained. Drafts = rows 1..b-1.
* `dspark` (shifted, SpecForge OnlineDSparkModel): row k is trained for anchor+k+1, every row
  supervised. Drafts = rows 0..b-1.

Harvesting with the wrong convention verifies every slot against a position its row was never
trained for: acceptance collapses while the output stays exact. So the default follows the
checkpoint's own strategy census, and an explicit override with an unknown name is refused.

    h = resolve_harvest(options.get("harvest"), cfg.strategy_dspark)
    rows = hidden[h.first_row : h.first_row + h.n_drafts(b)]
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from memra.errors import InputError


class Harvest(Enum):
    DFLASH = "dflash"
    DSPARK = "dspark"

    @property
    def first_row(self) -> int:
        """The first drafter output row used as a draft."""
        return 1 if self is Harvest.DFLASH else 0

    def n_drafts(self, block_size: int) -> int:
        """Drafts harvested per round from a `block_size`-row block."""
        return block_size - 1 if self is Harvest.DFLASH else block_size

    def trained_offset_of_row(self, row: int) -> int:
        """The position (relative to the anchor at row 0) that output row `row` was trained for."""
        return row if self is Harvest.DFLASH else row + 1


def harvest_from_name(name: str) -> Harvest | None:
    return next((h for h in Harvest if h.value == name), None)


def resolve_harvest(explicit: str | None, strategy_dspark: bool) -> Harvest:
    """An explicit name wins (unknown names are refused); None or "" follows the census."""
    if explicit is None or explicit == "":
        return Harvest.DSPARK if strategy_dspark else Harvest.DFLASH
    found = harvest_from_name(explicit) if isinstance(explicit, str) else None
    if found is None:
        raise InputError(
            f"dflash2: harvest={explicit!r} is not a harvest convention: choose 'dflash' (mask-fill, rows "
            "1..b-1) or 'dspark' (shifted, rows 0..b-1), or leave it unset to follow the checkpoint's "
            "training strategy (a wrong convention verifies every draft against a position its row was "
            "not trained for)"
        )
    return found


def accept_prefix(cand: Sequence[int], vam: Sequence[int], vt: int) -> int:
    """Accepted drafts of a round: `cand[0]` is the anchor, `cand[1:]` the drafts, `vam[j]` the
    target's argmax for anchor+j+1; at most vt-1 drafts are verified. Returns m: `cand[1..m]`
    commit and `vam[m]` is the next anchor."""
    m = 0
    while m < vt - 1 and cand[m + 1] == vam[m]:
        m += 1
    return m
