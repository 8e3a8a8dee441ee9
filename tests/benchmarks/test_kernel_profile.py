"""benchmarks/kernel_profile.py's bookkeeping, on CPU: the busy time of overlapping kernel spans
and the naming of a kernel by the module that launched it."""

from benchmarks.kernel_profile import _busy_us, _family


def test_busy_time_counts_overlaps_once_and_gaps_never():
    assert _busy_us([(0, 10), (5, 15), (20, 30)]) == 25
    assert _busy_us([(20, 30), (0, 10)]) == 20          # any order
    assert _busy_us([(0, 30), (5, 10)]) == 30           # a span inside another adds nothing
    assert _busy_us([]) == 0


def test_a_memra_kernel_is_named_by_its_module_and_anything_else_as_itself():
    owner = {"linear_bf16_n1": "dense"}
    assert _family("linear_bf16_n1", owner) == "dense.linear_bf16_n1"
    assert _family("Memset (Device)", owner) == "Memset (Device)"
