"""CuPy's kernel cache on the GPU: a kernel compiled through runtime.source_module reads the header
its source includes as it is now, after the header changed between two compiles of the same source
(tests/backend/test_kernel_cache_key.py has the CPU side). Red arm: the same source compiled by
CuPy without the digest keeps the cubin of the old header.
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_kernel_cache.py
"""

from __future__ import annotations

import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda import runtime  # noqa: E402

SOURCE = '#include "probe.cuh"\nextern "C" __global__ void probe_value(int* out) { out[0] = PROBE_VALUE; }\n'


def values_across_a_header_edit(monkeypatch, tmp_path, compile) -> list[int]:
    """What the kernel writes when compiled by `compile` with PROBE_VALUE 1, then again with 2."""
    values = []
    with monkeypatch.context() as m:
        m.setattr(runtime, "kernel_dir", lambda: tmp_path)
        for v in (1, 2):
            (tmp_path / "probe.cuh").write_text(f"#define PROBE_VALUE {v}\n")
            out = cp.zeros(1, cp.int32)
            compile(SOURCE).get_function("probe_value")((1,), (1,), (out,))
            values.append(int(out.get()[0]))
    return values


def test_a_changed_header_compiles_anew(monkeypatch, tmp_path):
    assert values_across_a_header_edit(monkeypatch, tmp_path, runtime.source_module) == [1, 2]


def test_red_arm_cupys_key_alone_keeps_the_old_headers_cubin(monkeypatch, tmp_path):
    def bare(src: str):
        mod = cp.RawModule(code=src, options=runtime.OPTIONS + ("-I" + str(tmp_path),))
        mod.compile()
        return mod
    assert values_across_a_header_edit(monkeypatch, tmp_path, bare) == [1, 1]
