"""The ppN gate on the numpy reference (CI): the small model split 2 and 3 ways, every stage in
this process, against the unsplit model (the battery: tests/pipeline/gate.py)."""

from .gate import PpnGate


class TestPpnGateNumpy(PpnGate):
    backend = "numpy"
