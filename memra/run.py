"""`python -m memra.run` (also installed as `memra`): generate text from a glm5_next checkpoint.

    python -m memra.run                                   # the demo model, speculative (native-mtp, K=4)
    python -m memra.run --checkpoint DIR --prompt "Hello" --max-new-tokens 64 --backend cuda
    python -m memra.run --checkpoint DIR --prompt-ids 1,2,3 --draft none --json
    python -m memra.run --list-drafters

The command itself lives in memra/cli/ (flags: args.py, inputs: inputs.py, printing: output.py).
"""

from __future__ import annotations

import sys

from memra.cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
