"""Ranks over NCCL (memra.load_ranked): one process per GPU, as torchrun starts them; skips below
2 GPUs (NCCL takes one rank per device). The driver's prime logits, plain tape and native-mtp
tape must equal the unsplit model's on the same backend, bit for bit. The numpy gate of the same
protocol (threads) is tests/pipeline/test_ranks.py.
"""

import multiprocessing
import socket

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

import memra  # noqa: E402
from memra.generate import generate  # noqa: E402
from tests.pipeline.gate import PLEN, PRESET, SEED, tokens  # noqa: E402

N_TOKENS = 24
WAIT_S = 300


def _gpus() -> int:
    return cp.cuda.runtime.getDeviceCount()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, ckpt: str, prompt: list, results) -> None:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    try:
        model = memra.load_ranked(ckpt, backend="cuda", environ=env)
        if not model.driver:
            model.serve()
            results.put((rank, "served", model.walked))
            return
        try:
            logits = np.asarray(model.prime(prompt, model.new_cache(128)))
            plain = generate(model, prompt, N_TOKENS).tokens
            spec = generate(model, prompt, N_TOKENS, draft="native-mtp", num_draft_tokens=4).tokens
        finally:
            model.close()
        results.put((rank, "drove", (logits, plain, spec, model.walked)))
    except BaseException as exc:  # noqa: BLE001  the parent reports it
        results.put((rank, "failed", f"{type(exc).__name__}: {exc}"))


@pytest.mark.skipif(_gpus() < 2, reason="NCCL ranks need one GPU each: >= 2 GPUs")
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_over_nccl_give_the_unsplit_bits(fixture_dir, world):
    if world > _gpus():
        pytest.skip(f"{world} ranks need {world} GPUs")
    ckpt = str(fixture_dir(PRESET, seed=SEED))
    ref = memra.load_model(ckpt, backend="cuda")
    prompt = tokens(ref, PLEN, 7)
    want_logits = np.asarray(ref.prime(prompt, ref.new_cache(128)))
    want_tape = generate(ref, prompt, N_TOKENS).tokens
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, ckpt, prompt, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict((rank, (what, value)) for rank, what, value in (results.get(timeout=WAIT_S) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert all(what != "failed" for what, _ in got.values()), got
    logits, plain, spec, walked = got[world - 1][1]
    assert np.array_equal(logits, want_logits)
    assert plain == want_tape and spec == want_tape
    assert all(got[r][1] == walked for r in range(world - 1)), "every rank walks every walk"
