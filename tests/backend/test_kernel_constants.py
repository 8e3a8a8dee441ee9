"""A constant the kernels and the wrappers share has one home, memra/kernels_cu/constants.py: it
reaches the .cu files as a -D define and through constants.cuh, generated from the same table.
CPU-only: it reads the sources as text."""

import ast
import re
from importlib import resources
from pathlib import Path

import memra
from memra.kernels_cu import constants
from memra.kernels_cu.constants import DEFINES, KERNEL_CONSTANTS

KERNELS = resources.files("memra.kernels_cu")
SOURCES = {p.name: p.read_text() for p in KERNELS.iterdir() if p.name.endswith((".cu", ".cuh"))}
WRITTEN = {name: text for name, text in SOURCES.items() if name != constants.HEADER}  # by hand
NAMES = set(KERNEL_CONSTANTS)
PACKAGE = Path(memra.__file__).parent


def code_of(text: str) -> str:
    """The source without comments, continued lines joined."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return text.replace("\\\n", " ")


def hard_coded(text: str) -> list[str]:
    """Table names the source defines itself: #define NAME, or a constexpr / const NAME = ..."""
    code = code_of(text)
    found = re.findall(r"^\s*#\s*define\s+(\w+)", code, re.M)
    found += re.findall(r"\b(?:constexpr|const)\b[\w\s:<>*&]*?\b(\w+)\s*(?:=|\{|\[)", code)
    return sorted(NAMES.intersection(found))


def used(text: str) -> set[str]:
    """Table names the code reads."""
    return NAMES.intersection(re.findall(r"\b\w+\b", code_of(text)))


def included(name: str) -> set[str]:
    """The headers a source includes, transitively."""
    seen, todo = set(), [name]
    while todo:
        for header in re.findall(r'#include\s+"([^"]+)"', SOURCES[todo.pop()]):
            if header not in seen:
                seen.add(header)
                todo.append(header)
    return seen


def test_no_kernel_source_defines_a_shared_constant():
    offenders = {name: hard_coded(text) for name, text in WRITTEN.items()}
    offenders = {name: found for name, found in offenders.items() if found}
    assert not offenders, (f"{offenders}: these come from memra/kernels_cu/constants.py (-D defines and "
                           "the generated constants.cuh); delete the definitions from the kernel sources")


def test_a_planted_define_or_constexpr_is_named():
    """Red arm of the gate above, on the real sources: each spelling of a hard-coded constant is
    caught and named; a comment mentioning one is not."""
    dense = SOURCES["dense.cu"]
    assert hard_coded(dense + "\n#define BF16_OUTS 32\n") == ["BF16_OUTS"]
    assert hard_coded(dense + "\n#  define SPLIT_KC (2048)\n") == ["SPLIT_KC"]
    assert hard_coded(dense + "\nstatic constexpr int MEMRA_BLOCK = 256;\n") == ["MEMRA_BLOCK"]
    assert hard_coded(dense + "\n__device__ const int KDA_MAX_DK{256};\n") == ["KDA_MAX_DK"]
    assert hard_coded(dense + "\n// #define BF16_OUTS 32 was the old home\n") == []


def test_every_shared_constant_is_read_by_a_kernel():
    unread = NAMES - set().union(*(used(text) for text in WRITTEN.values()))
    assert not unread, f"{sorted(unread)}: no kernel reads them; keep them beside their only user in Python"


def test_every_source_that_reads_a_shared_constant_includes_the_generated_header():
    """So a plain `nvcc file.cu` (no -D) builds the table's sizes, not an undefined name."""
    for name, text in WRITTEN.items():
        if used(text) and name != "common.cuh":
            assert constants.HEADER in included(name), f"{name} reads {sorted(used(text))} without constants.cuh"


def test_the_generated_header_is_the_table():
    on_disk = SOURCES[constants.HEADER]
    assert on_disk == constants.header_text(), (
        "memra/kernels_cu/constants.cuh is stale: python -m memra.kernels_cu.constants > "
        "memra/kernels_cu/constants.cuh")
    # red arm: a header left behind by a change to the table is told apart
    stale = on_disk.replace(f"#define SPLIT_KC {constants.SPLIT_KC}", "#define SPLIT_KC 1024")
    assert stale != constants.header_text()


def test_the_defines_are_the_table():
    assert DEFINES == tuple(f"-D{name}={value}" for name, value in KERNEL_CONSTANTS.items())
    assert all(isinstance(v, int) and not isinstance(v, bool) for v in KERNEL_CONSTANTS.values())
    assert constants.HC_CHUNK == 8 * constants.MEMRA_BLOCK  # hyper.cu static_asserts the same
    assert constants.WARPS_PER_BLOCK * 32 == constants.MEMRA_BLOCK


def module_assignments(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_python_defines_each_shared_constant_once():
    """The wrappers import the table's names; none restates one (the mirror this replaces)."""
    shared = NAMES | {n for n in module_assignments(Path(constants.__file__)) if n.isupper()}
    homes: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in module_assignments(path) & shared:
            homes.setdefault(name, []).append(str(path.relative_to(PACKAGE)))
    restated = {name: where for name, where in homes.items() if len(where) > 1}
    assert not restated, f"{restated}: import these from memra/kernels_cu/constants.py (or memra/limits.py)"
