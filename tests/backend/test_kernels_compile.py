"""Every .cu kernel family compiles with nvcc for sm_90 under the exact-class flags (CI has nvcc,
no GPU). NVRTC compiles the same sources at run time on the GPU host."""

import shutil
import subprocess
from importlib import resources

import pytest

KERNELS = resources.files("memra.kernels_cu")
SOURCES = sorted(p.name for p in KERNELS.iterdir() if p.name.endswith(".cu"))


def test_kernel_sources_ship_with_the_package():
    names = {p.name for p in KERNELS.iterdir()}
    assert "common.cuh" in names


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed on this machine")
@pytest.mark.parametrize("name", SOURCES)
def test_kernel_family_compiles_for_sm90(name, tmp_path):
    src = KERNELS.joinpath(name)
    cmd = ["nvcc", "--std=c++17", "--fmad=false", "-arch=sm_90", "-I", str(KERNELS),
           "-cubin", "-o", str(tmp_path / "k.cubin"), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "use_fast_math" not in src.read_text()
