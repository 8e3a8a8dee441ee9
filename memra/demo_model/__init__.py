"""The demo model memra ships: a small glm5_next (every layer kind, an MTP head) and a DFlash2
drafter, trained on CPython's standard library (README: the model card; training/: how).

    from memra import demo_model
    model = load_model(demo_model.TARGET)               # HF layout: config, weights, tokenizer
    draft_options = {"path": demo_model.DFLASH2}         # for draft="dflash2"
"""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(_HERE, "target")
DFLASH2 = os.path.join(_HERE, "dflash2")
PROMPT = "import os\n\n\ndef read_lines(path):\n    "
