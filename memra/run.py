"""`python -m memra.run` (also installed as `memra`): generate text from a glm5_next checkpoint.

    python -m memra.run                                   # the demo model, speculative (native-mtp, K=4)
    python -m memra.run --checkpoint DIR --prompt "Hello" --max-new-tokens 64 --backend cuda
    python -m memra.run --checkpoint DIR --prompt-ids 1,2,3 --draft none --json
    python -m memra.run --list-drafters
    memra serve --checkpoint DIR                          # the OpenAI-compatible server (docs/serve.md)

The command itself lives in memra/cli/ (flags: args.py, inputs: inputs.py, printing: output.py).
"""

from __future__ import annotations

import sys

from memra.cli.main import main as _generate_main

__all__ = ["main"]


def main(argv=None) -> int:
    """`memra serve ...` starts the server (memra.serve.cli); anything else is the generation command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from memra.serve.cli import main as serve_main

        return serve_main(argv[1:])
    return _generate_main(argv)


if __name__ == "__main__":
    sys.exit(main())
