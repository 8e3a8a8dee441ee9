"""Every memra kernel opens with `after_predecessor()` (common.cuh). A walk's captured launches
carry programmatic dependent launch (runtime.dependent_launches), so a kernel that read or wrote
memory before that wait could run beside its predecessor and see, or clobber, half-written data. CPU-only: it reads the
sources as text; tests/backend/test_cuda_dependent_launch.py shows on the GPU that the wait is
needed and that it holds."""

import re

from tests.backend.test_kernel_constants import SOURCES, code_of

GUARD = "after_predecessor();"


def kernels_without_guard(text: str) -> list[str]:
    """The __global__ functions whose body does not begin with the guard."""
    code = code_of(text)
    missing = []
    for m in re.finditer(r"\b__global__\b", code):
        body = code.index("{", m.end())  # a kernel's parameters hold no brace
        name = next(n for n in re.findall(r"([\w#]+)\s*\(", code[m.end():body]) if n != "__launch_bounds__")
        if not code[body + 1:].lstrip().startswith(GUARD):
            missing.append(name)
    return missing


def test_every_kernel_waits_for_its_predecessor_first():
    found = {name: len(re.findall(r"\b__global__\b", code_of(text))) for name, text in SOURCES.items()}
    assert sum(found.values()) >= 60, found  # every kernel is checked (66 when written)
    missing = {name: kernels_without_guard(text) for name, text in SOURCES.items()}
    assert {name: kernels for name, kernels in missing.items() if kernels} == {}


def test_red_arm_a_kernel_that_reads_before_the_wait_is_caught():
    guarded = SOURCES["norm.cu"]
    mutated = guarded.replace(GUARD, "const int early = threadIdx.x; " + GUARD, 1)
    assert mutated != guarded
    assert kernels_without_guard(guarded) == []
    assert len(kernels_without_guard(mutated)) == 1


def test_red_arm_a_macro_made_kernel_without_the_guard_is_caught():
    macro = ('#define MAKE(N) extern "C" __global__ void __launch_bounds__(256, 2) k##N(float* y) { \\\n'
             '        y[0] = N;                                                                 \\\n    }\n')
    assert kernels_without_guard(macro) == ["k##N"]
