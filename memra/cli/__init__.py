"""The `memra` command line (`python -m memra.run`): see memra/cli/main.py and the README."""
