"""benchmarks/kernel_profile.py's bookkeeping, on CPU: the busy time of overlapping kernel spans
and the naming of a kernel by the module that launched it."""

from benchmarks.kernel_profile import busy_us, _family, _own_us


def test_busy_time_counts_overlaps_once_and_gaps_never():
    assert busy_us([(0, 10), (5, 15), (20, 30)]) == 25
    assert busy_us([(20, 30), (0, 10)]) == 20          # any order
    assert busy_us([(0, 30), (5, 10)]) == 30           # a span inside another adds nothing
    assert busy_us([]) == 0


def test_a_memra_kernel_is_named_by_its_module_and_anything_else_as_itself():
    owner = {"linear_bf16_n1": "dense"}
    assert _family("linear_bf16_n1", owner) == "dense.linear_bf16_n1"
    assert _family("Memset (Device)", owner) == "Memset (Device)"


def test_a_kernel_that_started_early_owns_only_the_time_past_its_predecessor():
    # the second kernel launched at 4 (programmatic dependent launch) and waited until 10
    assert _own_us([(0, 10), (4, 15), (15, 18)]) == [10, 5, 3]
    assert _own_us([(4, 15), (0, 10)]) == [5, 10]        # any order: owned by start time
    assert _own_us([(0, 30), (5, 10)]) == [30, 0]        # inside another: owns nothing
    assert _own_us([(0, 10), (12, 20)]) == [10, 8]       # no overlap: the whole span


def test_own_times_add_up_to_the_busy_time():
    spans = [(0, 10), (4, 15), (15, 18), (20, 25), (21, 22)]
    assert sum(_own_us(spans)) == busy_us(spans)
