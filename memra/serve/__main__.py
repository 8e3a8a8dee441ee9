"""`python -m memra.serve`: the same as `memra serve` (see memra.serve.cli)."""

import sys

from memra.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
