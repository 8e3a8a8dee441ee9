"""The KDA family on the GPU (KdaOps, backend/cuda/kda.py -> kernels_cu/kda.cu): the causal short
conv with its ring, the per-channel decay gate, the delta-rule recurrence with its state.

The table (mini, small, dk = 128 with Hk = 2, odd sizes) runs through the shared gates of
tests/backend/harness.py; short_conv and kda_recurrence are stateful, so their row gate is: a
t-row call equals t successive one-row calls, outputs and final ring / state. Red arms: a stale
state or ring (the op forgets to carry it between calls) fails that gate, and a one-ulp change
of one row is caught. The rest pins the wrapper's rules for in-place state and strided inputs.
Run on the GPU host: PYTHONPATH=$PWD python3 -m pytest -m gpu tests/backend/test_cuda_kda.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

from memra.backend.cuda.kda import KdaOps  # noqa: E402
from tests.backend.harness import OpGates, RedArm, draw, on_device, table  # noqa: E402
from tests.backend.inputs import normal, uniform  # noqa: E402

F32 = np.float32

# op -> (rtol, atol) against NumpyBackend: CUDA expf / log1pf (a few ulp) and the fixed GPU
# reduction orders (warp butterfly) against numpy's.
TOL = {
    "short_conv": (1e-5, 1e-6),   # K-tap sum in the reference's order; SiLU's expf
    "kda_gate": (1e-5, 1e-6),     # expf(a_log) times z, then sigmoid or softplus
    "kda_recurrence": (1e-4, 1e-6),  # 15 rows of dk-reductions through the carried state
}


def _kda_gate(hk, dk, lower_bound):
    def make(rng, t):
        shared = {"a_log": uniform(rng, (hk,), 0.0, np.log(16.0)), "dt_bias": normal(rng, (hk, dk), 0.5)}
        return {"f": normal(rng, (t, hk, dk), 2.0)}, shared
    return make, lambda be, r, s: be.kda_gate(r["f"], s["a_log"], s["dt_bias"], lower_bound)


def _short_conv(c, k):
    def make(rng, t):  # the ring starts with history, as mid-sequence
        return {"x": normal(rng, (t, c))}, {"w": normal(rng, (c, k), 0.5), "ring": normal(rng, (k - 1, c))}
    return make, lambda be, r, s: be.short_conv(r["x"], s["ring"], s["w"])


def _unit(a):
    return (a / np.sqrt((a * a).sum(-1, keepdims=True) + F32(1e-6))).astype(F32)


def _kda_recurrence(hk, dk, dv):
    def make(rng, t):  # q, k as the mixer makes them: L2-normalised, q scaled by dk^-0.5
        rows = {"q": (_unit(normal(rng, (t, hk, dk))) * F32(dk ** -0.5)).astype(F32),
                "k": _unit(normal(rng, (t, hk, dk))), "v": normal(rng, (t, hk, dv)),
                "g": uniform(rng, (t, hk, dk), -5.0, -0.01), "beta": uniform(rng, (t, hk), 0.05, 0.95)}
        return rows, {"state": normal(rng, (hk, dk, dv), 0.3)}
    return make, lambda be, r, s: be.kda_recurrence(r["q"], r["k"], r["v"], r["g"], r["beta"], s["state"])


case = table(TOL)
RING, STATE = {"state": "ring"}, {"state": "state"}
CASES = [
    case("kda_gate_lb_mini", *_kda_gate(1, 128, -5.0)),
    case("kda_gate_lb_small", *_kda_gate(2, 32, -5.0)),
    case("kda_gate_softplus_small", *_kda_gate(2, 32, None)),
    case("kda_gate_softplus_odd", *_kda_gate(3, 33, None)),
    case("short_conv_mini", *_short_conv(3 * 128, 4), **RING),
    case("short_conv_small", *_short_conv(3 * 64, 4), **RING),
    case("short_conv_odd", *_short_conv(101, 3), **RING),
    case("short_conv_k1", *_short_conv(40, 1), **RING),
    case("kda_recurrence_mini", *_kda_recurrence(1, 128, 128), **STATE),
    case("kda_recurrence_small", *_kda_recurrence(2, 32, 32), **STATE),
    case("kda_recurrence_dk128_h2", *_kda_recurrence(2, 128, 128), **STATE),
    case("kda_recurrence_odd", *_kda_recurrence(3, 40, 24), **STATE),
    case("kda_recurrence_dk160", *_kda_recurrence(1, 160, 40), **STATE),  # past 4 slots: the wide kernel
    # dv not a multiple of WARPS_PER_BLOCK: the last block's spare warps hold no column
    case("kda_recurrence_dk256_dv20", *_kda_recurrence(2, 256, 20), **STATE),
    case("kda_recurrence_dv13", *_kda_recurrence(1, 64, 13), **STATE),
]


class _StaleState(KdaOps):
    """The mutations: the recurrence and the conv run on a copy, so the state never carries over."""

    def kda_recurrence(self, q, k, v, g, beta, state):
        return super().kda_recurrence(q, k, v, g, beta, state.copy())

    def short_conv(self, x, ring, w):
        return super().short_conv(x, ring.copy(), w)


def _case(name):
    return next(c for c in CASES if c.name == name)


class TestKdaOps(OpGates):
    ops, tol, cases = KdaOps, TOL, CASES
    untabled = ("kda_replay",)  # a rollback's walk, bits against the walk's: tests/backend/test_kda_snapshots.py
    red_arms = (RedArm("kda_recurrence_stale_state", _case("kda_recurrence_small"), _StaleState),
                RedArm("short_conv_stale_ring", _case("short_conv_small"), _StaleState))
    ulp_cases = ("kda_recurrence_small", "short_conv_odd", "kda_gate_lb_small")


# ---- the wrappers guard their in-place state and copy strided inputs ----------------------------

def test_in_place_state_must_be_contiguous_float32():
    c = _case("kda_recurrence_small")
    rows, shared = draw(c, "refusal", 2)
    ops, rows = KdaOps(), on_device(c, rows)
    state0 = shared["state"]
    with pytest.raises(AssertionError, match="state"):
        c.call(ops, rows, {"state": cp.asarray(state0, dtype=cp.float64)})
    strided = cp.asarray(np.ascontiguousarray(state0.transpose(0, 2, 1))).transpose(0, 2, 1)
    with pytest.raises(AssertionError, match="state"):
        c.call(ops, rows, {"state": strided})
    with pytest.raises(AssertionError, match="x"):
        ops.short_conv(np.zeros((1, 4), F32), cp.zeros((3, 4), cp.float32), cp.zeros((4, 4), cp.float32))


def test_strided_read_only_inputs_are_accepted():
    """v arrives as a view sliced out of the conv output; the wrapper copies it to C order."""
    rows, shared = draw(_case("kda_recurrence_small"), "strided", 3)
    ops, dev = KdaOps(), on_device(_case("kda_recurrence_small"), rows)
    wide = cp.concatenate([dev["v"], dev["v"]], axis=2)[:, :, :32]
    assert not wide.flags.c_contiguous
    a = ops.kda_recurrence(dev["q"], dev["k"], wide, dev["g"], dev["beta"], cp.asarray(shared["state"]))
    b = ops.kda_recurrence(dev["q"], dev["k"], dev["v"], dev["g"], dev["beta"], cp.asarray(shared["state"]))
    assert cp.array_equal(a, b)


def _launch_recurrence(name, rows, state, dv):
    """One raw launch of a kda_recurrence kernel (nothing recorded) -> (out, state after)."""
    from memra.backend.cuda.runtime import BLOCK, blocks_of, i32, launch
    from memra.kernels_cu.constants import KDA_COLS

    (t, hk, dk), state = rows["q"].shape, cp.asarray(state)
    out = cp.empty((t, hk, dv), cp.float32)
    launch("kda", name, (hk, blocks_of(dv, KDA_COLS)), (BLOCK,),
           (*(cp.asarray(rows[n]) for n in ("q", "k", "v", "g", "beta")), state, out,
            i32(t), i32(hk), i32(dk), i32(dv)))
    return cp.asnumpy(out), cp.asnumpy(state)


@pytest.mark.parametrize("dk, dv", [(128, 128), (40, 24), (40, 20)])
def test_every_recurrence_kernel_does_the_same_arithmetic(dk, dv):
    """dk <= 128 takes kda_recurrence_k16 (16 keys a thread): the kernel for KDA_MAX_DK, whose
    second 16-key block of every thread is idle there, gives the same bytes, outputs and state, over a verify walk's VERIFY_CAP rows (a longer
    prompt takes the chunked scan: test_cuda_kda_chunks.py)."""
    from memra.limits import VERIFY_CAP

    rows, shared = _kda_recurrence(2, dk, dv)[0](np.random.default_rng(dk), VERIFY_CAP)
    want = _launch_recurrence("kda_recurrence_k32", rows, shared["state"], dv)
    assert not np.array_equal(want[1], shared["state"])  # the state moved
    state = cp.asarray(shared["state"])
    got = KdaOps().kda_recurrence(*(cp.asarray(rows[n]) for n in ("q", "k", "v", "g", "beta")), state)
    assert cp.asnumpy(got).tobytes() == want[0].tobytes()
    assert cp.asnumpy(state).tobytes() == want[1].tobytes()
    k16 = _launch_recurrence("kda_recurrence_k16", rows, shared["state"], dv)
    assert k16[0].tobytes() == want[0].tobytes() and k16[1].tobytes() == want[1].tobytes()


@pytest.mark.parametrize("k", [4, 1, 3, 7])
def test_a_prompts_short_conv_spans_do_the_row_walks_arithmetic(k):
    """short_conv over a prompt's rows runs spans of rows in parallel (the ring only read, then
    refilled from the last rows): outputs and ring as bytes equal the walk's kernel (short_conv).
    k = 4 takes the kernel's 4-tap unrolling, other k the KDA_MAX_CONV one; 150 rows end a span
    inside a batch of rows."""
    from memra.kernels_cu.constants import KDA_CONV_LANES
    from memra.backend.cuda.runtime import BLOCK, i32, launch

    rows, shared = _short_conv(101, k)[0](np.random.default_rng(3), 150)
    x, w = cp.asarray(rows["x"]), cp.asarray(shared["w"])
    ring = cp.asarray(shared["ring"])
    got = KdaOps().short_conv(x, ring, w)
    walk_ring, want = cp.asarray(shared["ring"]), cp.empty_like(x)
    launch("kda", "short_conv", ((101 + KDA_CONV_LANES - 1) // KDA_CONV_LANES,), (BLOCK,),
           (x, walk_ring, w, want, i32(150), i32(101), i32(k), i32(101), np.uint64(0), np.int64(0)))
    assert cp.asnumpy(got).tobytes() == cp.asnumpy(want).tobytes()
    assert cp.asnumpy(ring).tobytes() == cp.asnumpy(walk_ring).tobytes()


@pytest.mark.parametrize("hk,dk,lower_bound", [(3, 32, -5.0), (3, 32, None), (2, 33, None)])
def test_a_prompts_gate_rows_are_the_rows_gated_alone(hk, dk, lower_bound):
    """A prompt's kda_gate makes four channels a thread where dk allows (dk = 33: one): each row's
    bytes equal that row gated alone (a decode walk's launch, a channel a thread)."""
    rows, shared = _kda_gate(hk, dk, lower_bound)[0](np.random.default_rng(dk), 40)
    f, a_log, dt_bias = (cp.asarray(a) for a in (rows["f"], shared["a_log"], shared["dt_bias"]))
    ops = KdaOps()
    whole = cp.asnumpy(ops.kda_gate(f, a_log, dt_bias, lower_bound))
    alone = np.concatenate([cp.asnumpy(ops.kda_gate(f[r:r + 1], a_log, dt_bias, lower_bound)) for r in range(40)])
    assert whole.tobytes() == alone.tobytes()
    assert not np.array_equal(whole, np.roll(alone, 1, axis=0))  # the rows differ: a shift is caught


@pytest.mark.parametrize("t", [1, 7, 40])
def test_short_conv_in_groups_lays_each_groups_rows_side_by_side(t):
    """groups=3 (KDA's q, k, v) returns [3, t, C / 3]: the bytes of the [t, C] result's column
    groups, row walk (t <= VERIFY_CAP) and prompt spans alike, and the ring moves the same."""
    rows, shared = _short_conv(3 * 64, 4)[0](np.random.default_rng(t), t)
    x, w = cp.asarray(rows["x"]), cp.asarray(shared["w"])
    ring, ring3 = cp.asarray(shared["ring"]), cp.asarray(shared["ring"])
    flat = cp.asnumpy(KdaOps().short_conv(x, ring, w))
    grouped = cp.asnumpy(KdaOps().short_conv(x, ring3, w, groups=3))
    assert grouped.shape == (3, t, 64)
    assert grouped.tobytes() == np.ascontiguousarray(flat.reshape(t, 3, 64).transpose(1, 0, 2)).tobytes()
    assert t == 1 or grouped.tobytes() != flat.tobytes()  # red arm: [t, C] bytes are another layout
    assert cp.asnumpy(ring).tobytes() == cp.asnumpy(ring3).tobytes()
