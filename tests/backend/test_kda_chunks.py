"""The chunked delta-rule scan of a prompt (prime class), numpy twin NumpyBackend.kda_chunks:
equal to the row walk (kda_recurrence) up to float32 rounding, not bit for bit (DESIGN.md
section 2). Gate: max |chunks - walk| / rms(walk) <= CHUNK_REL for the outputs and for the final
state, on the gates a KDA layer makes (q, k L2-normalised, beta a sigmoid, g from kda_gate with
and without the lower bound), for t shorter than a chunk, not a multiple of it, dk != dv.
Red arms on the same inputs: the in-chunk solve dropped ((I + A)^-1 taken as I), and a decay
exponent off by one row (Khat_j = exp(G_last - G_{j-1}) k_j)."""

from __future__ import annotations

import numpy as np
import pytest

import memra.backend.numpy_kda as numpy_kda
from memra.backend.numpy_ref import NumpyBackend
from memra.kernels_cu.constants import KDA_CHUNK
from tests.backend.inputs import normal, uniform

F32 = np.float32
CHUNK_REL = 1e-5  # the twin reads ~3e-6 at t = 1000 (the row walk itself ~2e-6 from float64)


def _unit(a):
    return (a / np.sqrt((a * a).sum(-1, keepdims=True) + F32(1e-6))).astype(F32)


def kda_inputs(seed, t, hk, dk, dv, lower_bound=-5.0):
    """Rows as a KDA layer makes them, and a state mid-sequence."""
    rng, be = np.random.default_rng(seed), NumpyBackend()
    f = normal(rng, (t, hk, dk), 2.0)
    g = be.kda_gate(f, uniform(rng, (hk,), 0.0, np.log(16.0)), normal(rng, (hk, dk), 0.5), lower_bound)
    rows = {"q": (_unit(normal(rng, (t, hk, dk))) * F32(dk ** -0.5)).astype(F32),
            "k": _unit(normal(rng, (t, hk, dk))), "v": normal(rng, (t, hk, dv)), "g": g,
            "beta": be.sigmoid(normal(rng, (t, hk)))}
    return rows, normal(rng, (hk, dk, dv), 0.3)


def rel_error(got, want) -> float:
    return float(np.abs(got - want).max() / np.sqrt(np.mean(want.astype(np.float64) ** 2)))


def _walk_and_chunks(rows, state0):
    be = NumpyBackend()
    walk_state, chunk_state = state0.copy(), state0.copy()
    want = be.kda_recurrence(*rows.values(), walk_state)
    got = be.kda_chunks(*rows.values(), chunk_state)
    errors = rel_error(got, want), rel_error(chunk_state, walk_state)
    print(f"chunks vs walk: outputs {errors[0]:.2e}, state {errors[1]:.2e} of the rms")
    return errors


SHAPES = [(5, 2, 32, 24), (37, 3, 40, 24), (KDA_CHUNK, 1, 64, 64), (300, 2, 128, 128)]


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lb", "softplus"])
@pytest.mark.parametrize("t, hk, dk, dv", SHAPES)
def test_chunked_scan_tracks_the_row_walk(t, hk, dk, dv, lower_bound):
    rows, state0 = kda_inputs(t, t, hk, dk, dv, lower_bound)
    assert max(_walk_and_chunks(rows, state0)) <= CHUNK_REL


def _no_solve(a, beta, b, real=numpy_kda.chunk_solve):
    return real(np.zeros_like(a), beta, b)  # (I + A)^-1 taken as I


def _decay_off_by_a_row(real):
    def pieces(q, k, v, g, beta):
        p = real(q, k, v, g, beta)
        p["khat"][:, 1:] = p["khat"][:, 1:] * np.exp(g[:, 1:])  # exp(G_last - G_{j-1}) k_j
        return p
    return pieces


@pytest.mark.parametrize("mutation", ["no_solve", "decay_off_by_a_row"])
def test_red_arm_a_wrong_chunk_form_breaks_the_bound(mutation, monkeypatch):
    rows, state0 = kda_inputs(3, 37, 3, 40, 24)
    if mutation == "no_solve":
        monkeypatch.setattr(numpy_kda, "chunk_solve", _no_solve)
    else:
        monkeypatch.setattr(numpy_kda, "chunk_pieces", _decay_off_by_a_row(numpy_kda.chunk_pieces))
    assert max(_walk_and_chunks(rows, state0)) > CHUNK_REL
    monkeypatch.undo()
    assert max(_walk_and_chunks(rows, state0)) <= CHUNK_REL  # the real twin, same inputs


def test_a_prompt_longer_than_a_chunk_reads_every_row():
    """Chunks of 16 and of 1 (the row walk's grouping, solve of one row) agree within the bound."""
    rows, state0 = kda_inputs(4, 50, 2, 32, 16)
    be, one, many = NumpyBackend(), state0.copy(), state0.copy()
    a = be.kda_chunks(*rows.values(), one, chunk=1)
    b = be.kda_chunks(*rows.values(), many)
    assert rel_error(b, a) <= CHUNK_REL and rel_error(many, one) <= CHUNK_REL
