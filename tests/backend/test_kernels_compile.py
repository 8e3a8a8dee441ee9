"""Every .cu kernel family compiles with nvcc for sm_90 under the exact-class flags and the shared
constants' -D defines (CI has nvcc, no GPU). NVRTC compiles the same sources at run time on the
GPU host with the same options (backend/cuda/runtime.py)."""

import shutil
import subprocess
from importlib import resources

import pytest

from memra.kernels_cu.constants import DEFINES, FLAGS

KERNELS = resources.files("memra.kernels_cu")
SOURCES = sorted(p.name for p in KERNELS.iterdir() if p.name.endswith(".cu"))
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed on this machine")


def nvcc(name: str, out, defines=DEFINES) -> subprocess.CompletedProcess:
    cmd = ["nvcc", *FLAGS, *defines, "-arch=sm_90", "-I", str(KERNELS), "-cubin", "-o", str(out),
           str(KERNELS.joinpath(name))]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_kernel_sources_ship_with_the_package():
    names = {p.name for p in KERNELS.iterdir()}
    assert {"common.cuh", "exact_mma.cuh", "constants.py"} <= names


@needs_nvcc
@pytest.mark.parametrize("name", SOURCES)
def test_kernel_family_compiles_for_sm90(name, tmp_path):
    proc = nvcc(name, tmp_path / "k.cubin")
    assert proc.returncode == 0, proc.stderr
    assert "use_fast_math" not in KERNELS.joinpath(name).read_text()


@needs_nvcc
@pytest.mark.parametrize("name", SOURCES)
def test_a_family_built_without_the_defines_stops_at_its_error(name, tmp_path):
    """Red arm of the one above: the constants come only from the build, so leaving the -D
    defines out fails loudly, naming where they come from, instead of compiling other sizes."""
    proc = nvcc(name, tmp_path / "k.cubin", defines=())
    assert proc.returncode != 0
    assert "must come from the build (-D" in proc.stderr
