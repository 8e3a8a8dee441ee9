"""Every .cu kernel family compiles with nvcc for sm_90 under the exact-class flags and the shared
constants' -D defines (CI has nvcc, no GPU), and a plain `nvcc file.cu` (no -D, no -I) builds the
very same cubin through the generated constants.cuh. NVRTC compiles the same sources at run time
on the GPU host with the same options (backend/cuda/runtime.py), each closed by a comment naming
its headers' digest (CuPy's cache key), which leaves the cubin as it is."""

import functools
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import pytest

from memra.kernels_cu import with_header_digest
from memra.kernels_cu.constants import DEFINES, FLAGS

KERNELS = resources.files("memra.kernels_cu")
SOURCES = sorted(p.name for p in KERNELS.iterdir() if p.name.endswith(".cu"))
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed on this machine")


BUILD = (*DEFINES, "-I", str(KERNELS))


def nvcc(source, out, build=BUILD) -> list[str]:
    return ["nvcc", *FLAGS, *build, "-arch=sm_90", "-cubin", "-o", str(out), str(source)]


@functools.cache
def cubins(name: str) -> dict:
    """A family's cubin as the build makes it ("build": the -D defines and the include path), as a
    plain `nvcc file.cu` does ("plain") and as the runtime hands it over, closed by its headers'
    digest ("keyed"): compiled side by side and once for the tests below (nvcc is most of their time)."""
    with tempfile.TemporaryDirectory() as d:
        keyed = Path(d) / name
        keyed.write_text(with_header_digest(KERNELS.joinpath(name).read_text(), KERNELS))
        kinds = {"build": (KERNELS.joinpath(name), BUILD), "plain": (KERNELS.joinpath(name), ()),
                 "keyed": (keyed, BUILD)}
        runs = {kind: subprocess.Popen(nvcc(source, Path(d) / f"{kind}.cubin", build), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
                for kind, (source, build) in kinds.items()}
        out = {}
        for kind, proc in runs.items():
            _, err = proc.communicate()
            assert proc.returncode == 0, f"the {kind} build of {name}: {err}"
            out[kind] = (Path(d) / f"{kind}.cubin").read_bytes()
        return out


def test_kernel_sources_ship_with_the_package():
    names = {p.name for p in KERNELS.iterdir()}
    assert {"common.cuh", "exact_mma.cuh", "constants.py"} <= names


@needs_nvcc
@pytest.mark.parametrize("name", SOURCES)
def test_kernel_family_compiles_for_sm90(name):
    assert cubins(name)["build"]
    assert "use_fast_math" not in KERNELS.joinpath(name).read_text()


@needs_nvcc
@pytest.mark.parametrize("name", SOURCES)
def test_a_plain_nvcc_build_is_the_same_cubin(name):
    """Built as a newcomer would, with no -D defines and no include path, a family compiles to
    the same machine code as the build's: the generated header carries the same table."""
    built = cubins(name)
    assert built["plain"] == built["build"]


@needs_nvcc
@pytest.mark.parametrize("name", SOURCES)
def test_the_header_digest_leaves_the_cubin_as_it_is(name):
    built = cubins(name)
    assert built["keyed"] == built["build"]
