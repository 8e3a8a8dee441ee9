"""The ppN gate (seeds/002): a trunk split into N stages keeps every byte-identity contract.

Backend-agnostic battery; a test module subclasses PpnGate and names the backend and where the
stages go (numpy: one process; CUDA: every stage on GPU 0 with its own stream, or one GPU per
stage). Truth is the UNSPLIT model on the same backend, itself anchored to the plain decode
chain by tests/speculative (the seed's truth chain, closed by composition).

Arms: W0 plain decode under the split == unsplit; W1 verify rows (full logits, collapsed rows,
taps) == the unsplit plain chain; A accept-j-then-continue, every j in 0..K, with every stage's
planes equal to the never-drafted cache; E greedy tapes K = 1..7 for native-mtp and dflash2,
forced full accept, a forced-rejection sweep over every j. Red arms, each through the owning
stage: R1 stale KDA state, R2 unclamped pool keys, R3 rollback disabled, and R0 a boundary that
loses the lowest bit of its values (the transport really carries the walk). Non-vacuity is asserted, not assumed:
the stage count in force, no empty stage, KDA and MLA layers separated by a cut (every stage of
these splits owns both), every stage's runner and the transport used on every walk, a shared
indexer selection crossing a cut (3 stages), dflash2 taps made on earlier stages.
"""

from __future__ import annotations

import numpy as np
import pytest

import memra
from memra.config import KDA
from memra.drafters.dflash2 import write_fixture_drafter
from memra.drafters.registry import load_drafter
from memra.errors import MemraError, ResidencyError
from memra.generate import generate
from memra.config import preset
from memra.model.pipeline import StagedGlm5Model
from memra.speculative.session import GateInstruments
from tests.speculative.battery import Oracle, host, live_state, open_session, round_log, run_bursts, state_diff

PRESET, SEED = "small", 13
# small: layers K M M(shared) K K M. 2 stages: K M M | K K M; 3 stages: K M | M(shared) K | K M,
# which puts the shared indexer layer 2 on another stage than its source, layer 1.
SPLITS = {2: "0-2,3-5", 3: "0-1,2-3,4-5"}
K = 7                      # drafts per round in W1/A: t = 8 rows
PLEN = 24                  # past the kpool dense threshold (11): the indexer runs sparse
N_TAPE = 20
MAX_CTX = 128
CONT = [3, 1, 4, 1, 5, 9]  # the continuation after a rollback (> P = 4: crosses a pool boundary)


def tokens(model, n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, model.cfg.vocab_size, n)]


def primed(model, prompt):
    cache = model.new_cache(MAX_CTX)
    model.prime(prompt, cache)
    return cache


def bits(model, a):
    return np.asarray(host(model, a)).copy()


class PpnGate:
    """Subclass as Test...: set `backend` and `devices(n)` (None: the backend's default)."""

    backend = "numpy"

    @staticmethod
    def devices(n):
        return None

    # ---- fixtures ----------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    def ckpt_dir(self, fixture_dir):
        return fixture_dir(PRESET, seed=SEED)

    @pytest.fixture(scope="class")
    def ref(self, ckpt_dir):
        return memra.load_model(ckpt_dir, backend=self.backend)

    @pytest.fixture(scope="class", params=sorted(SPLITS), ids=lambda n: f"pp{n}")
    def staged(self, request, ckpt_dir):
        n = request.param
        return memra.load_model(ckpt_dir, backend=self.backend, stage_layers=SPLITS[n], devices=self.devices(n))

    @pytest.fixture(scope="class")
    def prompt(self, ref):
        return tokens(ref, PLEN, 7)

    @pytest.fixture(scope="class")
    def rows(self, ref):
        return tokens(ref, K + 1, 50)

    @pytest.fixture(scope="class")
    def tape(self, ref, prompt):
        return generate(ref, prompt, 2 * N_TAPE + 2 * K + 2).tokens  # room for a last, overshooting round

    @pytest.fixture(scope="class")
    def dflash2_dir(self, tmp_path_factory):
        return write_fixture_drafter(tmp_path_factory.mktemp("dflash2"), preset(PRESET))

    # ---- non-vacuity -------------------------------------------------------------------------
    def test_the_split_is_in_force(self, staged):
        n = staged.placement.count
        assert isinstance(staged, StagedGlm5Model) and staged.placement.describe() == SPLITS[n]
        assert len(staged.stage_layers) == n and all(staged.stage_layers), "a stage owns no layer"
        assert [[layer.index for layer in part] for part in staged.stage_layers] == \
            [list(staged.placement.layers(s)) for s in range(n)]
        kinds = [{layer.kind == KDA for layer in part} for part in staged.stage_layers]
        assert all(k == {True, False} for k in kinds), f"every stage must own KDA and MLA state: {kinds}"
        cache = staged.new_cache(MAX_CTX)
        assert len(cache.walks.stages) == n
        if n == 3:  # the shared indexer layer 2 reads layer 1's selection across cut 0
            assert staged.selections_in[1] == (1,) and staged.selections_out[0] == (1,)

    def test_every_stage_and_cut_carries_every_walk(self, staged, prompt, rows):
        n, calls = staged.placement.count, []
        cache = staged.new_cache(MAX_CTX)
        for s, runner in enumerate(cache.walks.stages):
            run = runner.run
            runner.run = lambda *a, s=s, run=run: (calls.append(("walk", s)), run(*a))[1]
        send = staged.transport.send
        staged.transport.send = lambda s, b: (calls.append(("send", s)), send(s, b))[1]
        try:
            staged.prime(prompt, cache)
            staged.verify_rows(rows, cache)
        finally:
            staged.transport.send = send
        one = [("walk", 0)] + [x for s in range(1, n) for x in (("send", s - 1), ("walk", s))]
        assert calls == one + one

    # ---- W0 / W1 -----------------------------------------------------------------------------
    def test_w0_plain_decode_under_the_split_is_the_unsplit_chain(self, ref, staged, prompt, rows):
        a, b = ref.new_cache(MAX_CTX), staged.new_cache(MAX_CTX)
        assert np.array_equal(bits(ref, ref.prime(prompt, a)), bits(staged, staged.prime(prompt, b)))
        for r, tok in enumerate(rows):
            assert np.array_equal(bits(ref, ref.decode_step(tok, a)), bits(staged, staged.decode_step(tok, b))), r

    def test_w1_verify_rows_under_the_split_are_the_unsplit_plain_chain(self, ref, staged, prompt, rows):
        taps = (0, 2, 5)  # made on stage 0, on stage 0/1, on the last stage
        chain = primed(ref, prompt)
        plain = [bits(ref, ref.decode_step(tok, chain)) for tok in rows]
        _, want_collapsed, want_ckpt = ref.verify_rows(rows, primed(ref, prompt), taps)
        logits, collapsed, ckpt = staged.verify_rows(rows, primed(staged, prompt), taps)
        for r in range(len(rows)):
            assert np.array_equal(bits(staged, logits[r]), plain[r]), f"row {r}"
        assert np.array_equal(bits(staged, collapsed), bits(ref, want_collapsed))
        for layer in taps:
            assert np.array_equal(bits(staged, ckpt.taps[layer]), bits(ref, want_ckpt.taps[layer])), layer

    # ---- A -----------------------------------------------------------------------------------
    @pytest.mark.parametrize("j", range(K + 1))
    def test_a_accept_j_then_continue_is_the_never_drafted_chain(self, ref, staged, prompt, rows, j):
        cache = primed(staged, prompt)
        _, _, ckpt = staged.verify_rows(rows, cache)
        staged.rollback(cache, ckpt, j + 1)
        assert cache.pos == PLEN + j + 1
        never = primed(ref, prompt)
        for tok in rows[:j + 1]:
            ref.decode_step(tok, never)
        assert state_diff(live_state(staged, cache), live_state(ref, never)) == []
        for tok in CONT:
            assert np.array_equal(bits(staged, staged.decode_step(tok, cache)), bits(ref, ref.decode_step(tok, never)))

    # ---- E -----------------------------------------------------------------------------------
    @pytest.mark.parametrize("k", range(1, K + 1))
    def test_e_native_mtp_tapes_equal_the_unsplit_plain_tape(self, staged, prompt, tape, k):
        out = generate(staged, prompt, N_TAPE, draft="native-mtp", num_draft_tokens=k)
        assert out.tokens == tape[:N_TAPE]

    @pytest.mark.parametrize("k", range(1, K + 1))
    def test_e_dflash2_tapes_equal_the_unsplit_plain_tape(self, staged, prompt, tape, dflash2_dir, k):
        drafter = load_drafter("dflash2", staged, {"path": dflash2_dir})
        assert any(staged.placement.stage_of(t) < staged.placement.count - 1 for t in drafter.tap_layers)
        out = generate(staged, prompt, N_TAPE, draft="dflash2", num_draft_tokens=k,
                       draft_options={"path": dflash2_dir})
        assert out.tokens == tape[:N_TAPE]

    @pytest.mark.parametrize("k", [3, K])
    def test_e_forced_full_accept_keeps_the_tape(self, staged, prompt, tape, k):
        session = open_session(staged, prompt, MAX_CTX, oracle=Oracle(tape, staged.cfg.vocab_size))
        log = round_log(session)
        out = run_bursts(session, N_TAPE, k)
        assert out == tape[:len(out)] and len(out) >= N_TAPE
        assert log and all(entry == (k, k) for entry in log)

    def test_e_forced_rejection_sweep_keeps_the_tape(self, staged, prompt, tape):
        session = open_session(staged, prompt, MAX_CTX,
                               oracle=Oracle(tape, staged.cfg.vocab_size, reject_at=lambda r: r % (K + 1)))
        log = round_log(session)
        out = run_bursts(session, 2 * N_TAPE, K)
        assert out == tape[:len(out)] and len(out) >= 2 * N_TAPE - K
        assert {accepted for _, accepted in log} >= set(range(K + 1)), f"not every keep cycled: {log}"

    # ---- red arms ----------------------------------------------------------------------------
    def test_r0_red_a_boundary_that_loses_its_lowest_bits_breaks_w0(self, ref, staged, prompt):
        send = staged.transport.send

        def flip(s, boundary):
            xp = staged.be.xp
            # the lowest mantissa bit of every value: one flipped LSB alone (row 0, first value) was
            # absorbed before the last row's logits on the H200 at 3 stages, so it proved nothing
            view = boundary.streams.reshape(-1).view(xp.uint32)
            boundary.streams = (view ^ xp.uint32(1)).view(xp.float32).reshape(boundary.streams.shape)
            send(s, boundary)

        staged.transport.send = flip
        try:
            got = bits(staged, staged.prime(prompt, staged.new_cache(MAX_CTX)))
        finally:
            staged.transport.send = send
        assert not np.array_equal(got, bits(ref, ref.prime(prompt, ref.new_cache(MAX_CTX))))

    @pytest.mark.parametrize("owner", ["each", "all"])
    def test_r1_red_stale_kda_state_through_the_owning_stage_diverges(self, ref, staged, prompt, rows, owner):
        """Post-row-K KDA state reinstated after a partial rollback, on one stage at a time
        (every stage's own rollback matters) or on all of them."""
        keep = 3
        never = primed(ref, prompt)
        for tok in rows[:keep]:
            ref.decode_step(tok, never)
        want = [bits(ref, ref.decode_step(tok, never)) for tok in CONT]
        groups = [[s] for s in range(staged.placement.count)] if owner == "each" else [range(staged.placement.count)]
        for group in groups:
            cache = primed(staged, prompt)
            _, _, ckpt = staged.verify_rows(rows, cache)
            stale = {}
            for s in group:
                with staged.on_stage(s):
                    for layer in staged.stage_layers[s]:
                        if layer.kind == KDA:
                            st = cache.kda[layer.index]
                            stale[layer.index] = (s, st.ring.copy(), st.state.copy())
            assert stale, f"stages {list(group)} own no KDA layer: this red arm would be vacuous"
            staged.rollback(cache, ckpt, keep)
            for i, (s, ring, state) in stale.items():
                with staged.on_stage(s):
                    cache.kda[i].ring[...], cache.kda[i].state[...] = ring, state
            got = [bits(staged, staged.decode_step(tok, cache)) for tok in CONT]
            assert any(not np.array_equal(g, w) for g, w in zip(got, want)), f"stale KDA on {list(group)} passed"

    def test_r2_red_unclamped_pool_keys_on_every_stage_trip_the_wire(self, staged, prompt, rows):
        """On each stage that owns an indexer plane (a shared indexer layer has none)."""
        indexed = lambda s: [layer.index for layer in staged.stage_layers[s]  # noqa: E731
                             if layer.kind != KDA and layer.mixer.indexer is not None]
        stages = [s for s in range(staged.placement.count) if indexed(s)]
        assert stages[0] == 0 and stages[-1] == staged.placement.count - 1, stages
        for s in stages:
            cache = primed(staged, prompt)
            _, _, ckpt = staged.verify_rows(rows, cache)
            owned = indexed(s)
            ready = {i: cache.mla[i].pools_ready for i in owned}
            staged.rollback(cache, ckpt, 1)
            moved = [i for i in owned if ready[i] > cache.mla[i].pools_ready]
            assert moved, f"the walk and rollback moved no pool count on stage {s}: vacuous"
            cache.mla[moved[0]].pools_ready = ready[moved[0]]
            with pytest.raises(ResidencyError, match="index_pools_ready"):
                staged.decode_step(CONT[0], cache)

    def test_r3_red_rollback_disabled_breaks_the_tape_or_fails_loudly(self, staged, prompt, tape):
        session = open_session(staged, prompt, MAX_CTX, instruments=GateInstruments(disable_rollback=True),
                               oracle=Oracle(tape, staged.cfg.vocab_size, reject_at=lambda r: 1))
        try:
            out = run_bursts(session, N_TAPE, K)
        except MemraError:
            return
        assert out != tape[:len(out)]
