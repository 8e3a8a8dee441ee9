"""The ppN gate on the CUDA backend (GPU host only), against the unsplit model on the same GPU.

* one GPU: every stage on GPU 0, each with its own stream and its own captured graphs; the
  boundary is a hand-off ordered by events. This exercises the whole split walk, the transport
  seam, the per-stage streams and the per-stage rollback.
* several GPUs (skips below 2): stage boundaries cross devices (device-to-device copies). The
  last stage sits on GPU 0, where the unsplit reference and the draft sources run, so the
  reference and the split model share one current device; the first stage(s) go to GPU 1.. .
"""

import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from .gate import PpnGate  # noqa: E402


def _gpus() -> int:
    return cp.cuda.runtime.getDeviceCount()


class TestPpnGateOneGpu(PpnGate):
    backend = "cuda"

    @staticmethod
    def devices(n):
        return [0] * n

    def test_each_stage_has_its_own_stream_on_gpu_0(self, staged):
        lanes = staged.lanes
        assert lanes.devices == (0,) * staged.placement.count
        assert len({s.ptr for s in lanes.streams}) == staged.placement.count
        assert cp.cuda.get_current_stream().ptr not in {s.ptr for s in lanes.streams}


@pytest.mark.skipif(_gpus() < 2, reason="the cross-device ppN arms need >= 2 GPUs")
class TestPpnGateMultiGpu(PpnGate):
    backend = "cuda"

    @staticmethod
    def devices(n):
        # stage s -> GPU n-1-s (capped by the GPUs there are): the last stage on GPU 0
        return [min(n - 1 - s, _gpus() - 1) for s in range(n)]

    def test_the_stages_really_span_devices(self, staged):
        devices = staged.lanes.devices
        assert devices[-1] == 0 and len(set(devices)) >= 2, devices
        assert staged.first_embed.device.id == devices[0] != staged.embed_table.device.id
