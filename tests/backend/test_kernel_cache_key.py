"""CuPy's kernel cache (~/.cupy/kernel_cache) keys a compile by the source text and options only,
not by the headers the source includes. runtime.source_module therefore hands NVRTC each source
closed by a digest of the kernels_cu headers (memra.kernels_cu.with_header_digest): an upgrade or an
edit that changes only a header compiles anew instead of loading the old headers' cubin.
tests/backend/test_kernels_compile.py shows the closing comment leaves every cubin as it is."""

from importlib import resources

import pytest

from memra.kernels_cu import with_header_digest

KERNELS = resources.files("memra.kernels_cu")
FAMILIES = sorted(p.name for p in KERNELS.iterdir() if p.name.endswith(".cu"))
HEADERS = sorted(p.name for p in KERNELS.iterdir() if p.name.endswith(".cuh"))


def bare(src: str, include_dir) -> str:
    """What CuPy's key holds without the digest: the source text alone."""
    return src


def kernels_copy(tmp_path):
    for p in KERNELS.iterdir():
        if p.name.endswith((".cu", ".cuh")):
            (tmp_path / p.name).write_bytes(p.read_bytes())
    return tmp_path


def families_missing_a_header_edit(tmp_path, keyed, header: str) -> list[str]:
    """The families whose compiled source stays the same when one byte of `header` changes."""
    before = {f: keyed((tmp_path / f).read_text(), tmp_path) for f in FAMILIES}
    text = (tmp_path / header).read_bytes()
    (tmp_path / header).write_bytes(text[:-1] + bytes([text[-1] ^ 1]))
    return [f for f in FAMILIES if keyed((tmp_path / f).read_text(), tmp_path) == before[f]]


@pytest.mark.parametrize("header", HEADERS)
def test_a_header_edit_changes_what_every_family_compiles(tmp_path, header):
    assert families_missing_a_header_edit(kernels_copy(tmp_path), with_header_digest, header) == []


def test_red_arm_the_bare_source_misses_a_header_edit(tmp_path):
    assert families_missing_a_header_edit(kernels_copy(tmp_path), bare, "exact_mma.cuh") == FAMILIES


def test_the_same_headers_give_the_same_source_and_only_a_closing_comment_is_added(tmp_path):
    """The cache still hits from one process to the next, and the family's own lines come first,
    untouched (no line number moves)."""
    copy = kernels_copy(tmp_path)
    for f in FAMILIES:
        src = KERNELS.joinpath(f).read_text()
        keyed = with_header_digest(src, KERNELS)
        assert keyed == with_header_digest(src, copy)
        tail = keyed[len(src):]
        assert keyed.startswith(src) and tail.startswith("\n// ") and tail.count("\n") == 2, tail
