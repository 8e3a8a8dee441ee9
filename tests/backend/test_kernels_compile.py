"""Every .cu kernel family compiles with nvcc for sm_90 under the exact-class flags and the shared
constants' -D defines (CI has nvcc, no GPU), and a plain `nvcc file.cu` (no -D, no -I) builds the
very same cubin through the generated constants.cuh. NVRTC compiles the same sources at run time
on the GPU host with the same options (backend/cuda/runtime.py)."""

import shutil
import subprocess
from importlib import resources

import pytest

from memra.kernels_cu.constants import DEFINES, FLAGS

KERNELS = resources.files("memra.kernels_cu")
SOURCES = sorted(p.name for p in KERNELS.iterdir() if p.name.endswith(".cu"))
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed on this machine")


def nvcc(name: str, out, build=(*DEFINES, "-I", str(KERNELS))) -> subprocess.CompletedProcess:
    cmd = ["nvcc", *FLAGS, *build, "-arch=sm_90", "-cubin", "-o", str(out), str(KERNELS.joinpath(name))]
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
def test_a_plain_nvcc_build_is_the_same_cubin(name, tmp_path):
    """Built as a newcomer would, with no -D defines and no include path, a family compiles to
    the same machine code as the build's: the generated header carries the same table."""
    plain = nvcc(name, tmp_path / "plain.cubin", build=())
    assert plain.returncode == 0, plain.stderr
    assert nvcc(name, tmp_path / "build.cubin").returncode == 0
    assert (tmp_path / "plain.cubin").read_bytes() == (tmp_path / "build.cubin").read_bytes()
