"""docs/serve.md stays true: every flag its table names exists, every metric it names is exported,
and its Python example compiles."""

import re
from pathlib import Path

import pytest

from memra.serve.cli import build_parser

pytest.importorskip("prometheus_client")

DOC = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text()


def test_every_flag_in_the_doc_is_a_flag_of_memra_serve():
    flags = set(re.findall(r"`(--[a-z-]+)", DOC))
    known = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert flags and flags <= known, flags - known


def test_every_metric_in_the_doc_is_exported():
    from memra.serve.metrics import ServeMetrics

    metrics = ServeMetrics()
    metrics.accepted_per_pos.labels(position="0").inc(0)
    metrics.requests.labels(endpoint="completions", outcome="stop").inc(0)
    exported = metrics.exposition().decode()
    for name in set(re.findall(r"memra:[a-z_]+", DOC)):
        assert name in exported, name


def test_the_python_example_compiles():
    (block,) = re.findall(r"```python\n(.*?)```", DOC, flags=re.DOTALL)
    compile(block, "docs/serve.md", "exec")
