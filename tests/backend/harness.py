"""The one harness of the CUDA op tests: each kernel file's table of cases, checked by the same gates.

`tests/backend/test_cuda_X.py` tests `memra/backend/cuda/X.py` (which launches `kernels_cu/X.cu`):
it holds the family's table of `Case`s and the tests that fit no table, and subclasses `OpGates`
for the generic ones (ggml's one harness, fla's kernel-beside-reference; DESIGN.md sections 2, 10):

* numpy gate: the GPU op matches its NumpyBackend twin within the case's (rtol, atol); integer
  outputs and (0, 0) tolerances bit for bit; bf16 weights (uint16 bits) go to the device as they
  are and to the reference widened;
* row gate: for t = 1..15, row r of a t-row GPU call is bit-identical (as bytes) to row r alone;
  for a stateful op (`Case.state`), a t-row call equals t successive one-row calls, outputs and
  final state, and the state really moved;
* red arms: a mutant (`RedArm`) fails the row gate for some t while the real op passes on the very
  same inputs, and a one-ulp change of one row alone is caught (`OpGates.ulp_cases`).

    case = table(TOL)
    CASES = [case("rmsnorm", make_norm((128,)), lambda be, r, s: be.rmsnorm(r["x"], s["w"], 1e-5))]

    class TestNormOps(OpGates):
        ops, tol, cases, ulp_cases = NormOps, TOL, CASES, ("rmsnorm",)

Imported only by the gpu-marked modules, after their `cupy_or_skip()`.
"""

from __future__ import annotations

import functools
import inspect
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tests.gpu import cupy_or_skip

cp = cupy_or_skip()

from memra.backend.numpy_ref import NumpyBackend  # noqa: E402
from memra.limits import VERIFY_CAP  # noqa: E402
from memra.safetensors_io import bf16_to_f32  # noqa: E402
from tests.backend.inputs import mismatched_rows  # noqa: E402

T_MAX = VERIFY_CAP  # the exact-class row cap (K <= 14)
NUMPY, ROWS = "numpy", "rows"  # the gates a case can take


@dataclass(frozen=True)
class Case:
    """One row of a family's table. `make(rng, t)` -> (rows, shared): dicts of numpy inputs, rows
    with a leading t axis; `call(be, rows, shared)` -> an array or a tuple of arrays with a
    leading t axis, on either backend."""

    name: str
    op: str
    make: Callable
    call: Callable
    tol: tuple[float, float]  # (rtol, atol) against NumpyBackend; (0, 0): bit-equal
    gates: frozenset = frozenset({NUMPY, ROWS})
    ts: tuple[int, ...] = (1, 7, T_MAX)  # the row counts the numpy gate draws
    state: str | None = None  # the shared input the op advances in place (a ring, the KDA state)
    host: frozenset = frozenset()  # inputs the GPU call takes as host arrays (token ids, positions)


def table(tol: dict) -> Callable:
    """A family's case builder: the op is the longest key of `tol` the case name starts with, and
    the case takes that op's tolerance."""
    def case(name: str, make: Callable, call: Callable, **kw) -> Case:
        op = next(op for op in sorted(tol, key=len, reverse=True) if name == op or name.startswith(op + "_"))
        return Case(name, op, make, call, tol[op], **kw)
    return case


@dataclass(frozen=True)
class RedArm:
    """A mutation the row gate must catch: `mutant()` (a backend with the case's op) fails it for
    some t on the case's row-gate inputs, while `green()` (default: the family's ops) passes them."""

    name: str
    case: Case
    mutant: Callable
    green: Callable | None = None


# ---- running a case ------------------------------------------------------------------------------

def draw(case: Case, gate: str, t: int) -> tuple[dict, dict]:
    """The case's inputs for one gate and row count: a fixed seed per (case, gate, t)."""
    return case.make(np.random.default_rng([zlib.crc32(f"{gate}:{case.name}".encode()), t]), t)


def on_device(case: Case, arrays: dict) -> dict:
    return {k: cp.asarray(v) if isinstance(v, np.ndarray) and k not in case.host else v
            for k, v in arrays.items()}


def on_reference(arrays: dict) -> dict:
    """Fresh host copies (the reference advances a state in place); bf16 bits widened to float32."""
    def ref(v):
        if not isinstance(v, np.ndarray):
            return v
        return bf16_to_f32(v) if v.dtype == np.uint16 else v.copy()
    return {k: ref(v) for k, v in arrays.items()}


def to_host(out) -> tuple:
    return tuple(cp.asnumpy(o) for o in (out if isinstance(out, tuple) else (out,)))


def assert_matches_numpy(ops, case: Case, t: int) -> None:
    """The numpy gate: every output (and the advanced state) within the case's tolerance."""
    rows, shared = draw(case, NUMPY, t)
    dev_shared, ref_shared = on_device(case, shared), on_reference(shared)
    got = to_host(case.call(ops, on_device(case, rows), dev_shared))
    want = to_host(case.call(NumpyBackend(), on_reference(rows), ref_shared))
    assert len(got) == len(want)
    pairs = list(zip(got, want))
    if case.state:
        pairs.append((cp.asnumpy(dev_shared[case.state]), ref_shared[case.state]))
    rtol, atol = case.tol
    for g, w in pairs:
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        if w.dtype.kind in "iub" or rtol == atol == 0:
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def t_rows_and_alone(ops, case: Case, rows: dict, shared: dict):
    """(outputs of one t-row call, outputs of each row alone, the two final states or None). A
    stateful op's rows alone run in order as t one-row calls on their own copy of the state."""
    dev_rows = on_device(case, rows)
    full_shared = on_device(case, shared)
    alone_shared = on_device(case, shared) if case.state else full_shared
    t = len(next(iter(rows.values())))
    full = to_host(case.call(ops, dev_rows, full_shared))
    assert all(o.shape[0] == t for o in full), [o.shape for o in full]
    alone = [to_host(case.call(ops, {k: v[r:r + 1] for k, v in dev_rows.items()}, alone_shared))
             for r in range(t)]
    states = None
    if case.state:
        states = (cp.asnumpy(full_shared[case.state]), cp.asnumpy(alone_shared[case.state]))
    return full, alone, states


def findings(full: tuple, alone: list, states) -> list[tuple]:
    """What the row gate reports: (row, output index) pairs that differ from the row alone, plus
    ("state", None) where a stateful op's two final states differ."""
    bad = mismatched_rows(full, alone)
    if states is not None and states[0].tobytes() != states[1].tobytes():
        bad.append(("state", None))
    return bad


def row_mismatches(ops, case: Case, rows: dict, shared: dict) -> list[tuple]:
    return findings(*t_rows_and_alone(ops, case, rows, shared))


# ---- the red arms' mutation: a dot product whose split count the caller picks -------------------

_DOT_SPLIT = r"""
extern "C" __global__ void dot_split(const float* x, const float* w, float* y, int n_in, int n_out,
                                     int splits, int interleaved) {
    // y[r, o] = w[o] . x[r], one thread per (row, output): the in-axis is cut into `splits`
    // partial sums (interleaved: k = s, s + splits, ...; else contiguous chunks), added in order
    const int r = blockIdx.y, o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= n_out) return;
    const float* xr = x + (long long)r * n_in;
    const float* wo = w + (long long)o * n_in;
    const int chunk = (n_in + splits - 1) / splits;
    float total = 0.0f;
    for (int s = 0; s < splits; ++s) {
        float part = 0.0f;
        if (interleaved) {
            for (int k = s; k < n_in; k += splits) part = part + xr[k] * wo[k];
        } else {
            for (int k = s * chunk; k < min((s + 1) * chunk, n_in); ++k) part = part + xr[k] * wo[k];
        }
        total = total + part;
    }
    y[(long long)r * n_out + o] = total;
}
"""


@functools.cache
def _dot_split_kernel():
    return cp.RawKernel(_DOT_SPLIT, "dot_split", options=("--std=c++17", "--fmad=false"))


def split_dot(x, w, splits: int, interleaved: bool = True):
    """x [t, in] @ w [out, in].T with each dot cut into `splits` partial sums: tied to t, it is the
    split COUNT the exact class forbids; a fixed number keeps every row's order its own."""
    x, w = cp.ascontiguousarray(x, cp.float32), cp.ascontiguousarray(w, cp.float32)
    (t, n_in), n_out = x.shape, w.shape[0]
    y = cp.empty((t, n_out), cp.float32)
    _dot_split_kernel()(((n_out + 127) // 128, t), (128,),
                        (x, w, y, np.int32(n_in), np.int32(n_out), np.int32(splits), np.int32(interleaved)))
    return y


class SplitDot:
    """A one-op backend, `dot(x, w)`, whose split count is `splits_for_t(rows of the call)`."""

    def __init__(self, splits_for_t: Callable[[int], int], interleaved: bool = True):
        self.splits_for_t, self.interleaved = splits_for_t, interleaved

    def dot(self, x, w):
        return split_dot(x, w, self.splits_for_t(x.shape[0]), self.interleaved)


def dot_case(name: str, n_in: int, n_out: int) -> Case:
    """A row-gate-only case for `SplitDot` (no numpy twin): x [t, n_in], w [n_out, n_in]."""
    def make(rng, t):
        x = rng.standard_normal((t, n_in)).astype(np.float32)
        return {"x": x}, {"w": (rng.standard_normal((n_out, n_in)) * n_in ** -0.5).astype(np.float32)}
    return Case(name, "dot", make, lambda be, r, s: be.dot(r["x"], s["w"]), (0.0, 0.0), frozenset({ROWS}))


def assert_same_signature(ours, twin) -> None:
    """Same parameter names and defaults, in order (annotations may differ)."""
    sig = [(p.name, p.default) for p in inspect.signature(ours).parameters.values()]
    assert sig == [(p.name, p.default) for p in inspect.signature(twin).parameters.values()], (ours, twin)


# ---- the generic tests ---------------------------------------------------------------------------

def _gate(name: str):
    def mark(test):
        test.gate = name
        return test
    return mark


class OpGates:
    """The generic tests of one kernel file; its test module subclasses this as `Test<Family>Ops`
    and sets the class attributes below."""

    ops: type  # the family's mixin, e.g. NormOps
    tol: dict  # op -> (rtol, atol): every op the table covers
    cases: list  # the table
    untabled: tuple = ()  # ops with no row table (plane writes): tested by their own functions
    red_arms: tuple = ()  # RedArm mutations the row gate must catch
    ulp_cases: tuple = ()  # case names whose one-ulp red arm runs

    def pytest_generate_tests(self, metafunc):
        gate = getattr(metafunc.function, "gate", None)
        if gate in (NUMPY, ROWS):
            pairs = [(c, t) for c in self.cases if gate in c.gates
                     for t in (c.ts if gate == NUMPY else range(1, T_MAX + 1))]
            metafunc.parametrize("case, t", pairs, ids=[f"{c.name}-t{t}" for c, t in pairs])
        elif gate == "red":
            metafunc.parametrize("arm", self.red_arms, ids=[a.name for a in self.red_arms])
        elif gate == "ulp":
            metafunc.parametrize("case", [self._case(n) for n in self.ulp_cases], ids=list(self.ulp_cases))

    def _case(self, name: str) -> Case:
        return next(c for c in self.cases if c.name == name)

    def test_table_covers_every_op_with_the_numpy_twin_signature(self):
        ops = {n for n in dir(self.ops) if not n.startswith("_")}
        assert {c.op for c in self.cases} == set(self.tol) == ops - set(self.untabled)
        assert set(self.untabled) <= ops
        for op in ops:
            assert_same_signature(getattr(self.ops, op), getattr(NumpyBackend, op))
        assert len({c.name for c in self.cases}) == len(self.cases)

    @_gate(NUMPY)
    def test_op_matches_numpy_within_its_tolerance(self, case, t):
        assert_matches_numpy(self.ops(), case, t)

    @_gate(ROWS)
    def test_row_of_a_t_row_call_is_bit_identical_to_the_row_alone(self, case, t):
        """Stateful ops: the t-row call equals t one-row calls, outputs and final state."""
        rows, shared = draw(case, ROWS, t)
        full, alone, states = t_rows_and_alone(self.ops(), case, rows, shared)
        assert findings(full, alone, states) == []
        if case.state and shared[case.state].size:  # the K = 1 conv has an empty ring
            assert not np.array_equal(states[0], shared[case.state])  # the state really moved

    @_gate("red")
    def test_red_arm_mutant_fails_the_row_gate_where_the_real_op_passes(self, arm):
        inputs = {t: draw(arm.case, ROWS, t) for t in range(1, T_MAX + 1)}
        mutant = arm.mutant()
        failing = [t for t, (rows, shared) in inputs.items() if row_mismatches(mutant, arm.case, rows, shared)]
        assert failing, f"{arm.name}: the mutant matched the rows alone bit for bit for every t"
        assert 1 not in failing  # one row against itself: the gate compares like with like
        green = arm.green() if arm.green else self.ops()
        for t in failing:  # green arm beside it: the very same inputs
            assert row_mismatches(green, arm.case, *inputs[t]) == [], t

    @_gate("ulp")
    def test_red_arm_one_ulp_change_in_one_row_alone_is_caught(self, case):
        rows, shared = draw(case, ROWS, T_MAX)
        full, alone, _ = t_rows_and_alone(self.ops(), case, rows, shared)
        assert mismatched_rows(full, alone) == []
        flat = alone[9][0].reshape(-1)  # a view: the bump lands in alone[9]
        i = flat.size // 2
        flat[i] = np.nextafter(flat[i], np.inf) if flat.dtype.kind == "f" else flat[i] + 1
        assert mismatched_rows(full, alone) == [(9, 0)]


def mutated_launch(monkeypatch, tmp_path, header: str, exact: str, broken: str, family: str):
    """A launch(family, name, ...) of the family's kernels compiled from a copy of kernels_cu in
    tmp_path whose `header` has `exact` replaced by `broken` (a red arm's mutant kernel)."""
    from memra.backend.cuda import runtime

    for src in runtime.kernel_dir().iterdir():
        if src.name.endswith((".cu", ".cuh")):
            (tmp_path / src.name).write_text(src.read_text())
    text = (tmp_path / header).read_text()
    assert exact in text, f"{header} changed: update the mutation"
    (tmp_path / header).write_text(text.replace(exact, broken))
    with monkeypatch.context() as m:
        m.setattr(runtime, "kernel_dir", lambda: tmp_path)
        mutated = getattr(runtime.module, "__wrapped__", runtime.module)(family)

    def launch(fam, name, grid, block, args, shared_mem=0):
        assert fam == family, fam
        mutated.get_function(name)(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)
    return launch
