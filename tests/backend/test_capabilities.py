"""A layer asks the backend what it can do, never which one it is.

The capabilities are documented on NumpyBackend (the interface reference) and answered by
CudaBackend too; no module of memra or of the benchmarks branches on a backend's name (only
memra.backend.get_backend maps a name to a backend).
"""

import re
from pathlib import Path

import numpy as np
import pytest

from memra.backend.numpy_ref import NumpyBackend

ROOT = Path(__file__).resolve().parents[2]
CAPABILITIES = ("xp", "compiles_on_first_use", "device_name", "synchronize")
NAME_CHECK = re.compile(r"""(\.name|\bbackend)\s*[!=]=\s*["'](cuda|numpy)["']""")


def test_numpy_backend_answers_every_capability():
    be = NumpyBackend()
    assert be.xp is np and be.compiles_on_first_use is False
    assert be.device_name() == "cpu"
    assert be.synchronize() is None


def test_every_capability_is_documented_on_the_reference():
    """A method by its docstring; an attribute by a comment on its line or the line above."""
    lines = (ROOT / "memra/backend/numpy_ref.py").read_text().splitlines()
    for name in CAPABILITIES:
        value = getattr(NumpyBackend, name)
        if callable(value) and not isinstance(value, type(np)):
            assert value.__doc__, name
            continue
        at = next(i for i, line in enumerate(lines) if line.startswith(f"    {name} = "))
        assert "#" in lines[at] or lines[at - 1].strip().startswith("#"), name


def test_no_layer_branches_on_the_backend_name():
    hits = []
    for path in sorted((ROOT / "memra").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py")):
        if path == ROOT / "memra/backend/__init__.py":  # get_backend: the one place a name picks a backend
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if NAME_CHECK.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert hits == []


def test_the_name_check_pattern_sees_the_old_branches():
    """Red arm: the spellings that were replaced are still caught."""
    for line in ('if be.name == "cuda":', "if backend.name != 'cuda':", 'cuda = args.backend == "cuda"',
                 'if job.model.be.name == "numpy":'):
        assert NAME_CHECK.search(line), line


@pytest.mark.gpu
def test_cuda_backend_answers_every_capability():
    from tests.gpu import cupy_or_skip

    cp = cupy_or_skip()
    from memra.backend.cuda import CudaBackend

    be = CudaBackend()
    assert all(name in vars(CudaBackend) for name in CAPABILITIES)
    assert be.xp is cp and be.compiles_on_first_use is True
    name = be.device_name()
    assert isinstance(name, str) and name and name != "cpu"
    a = be.zeros((4,)) + 1
    be.synchronize()
    assert float(a.sum()) == 4.0
