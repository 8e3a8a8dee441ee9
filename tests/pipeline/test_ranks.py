"""The trunk's stages as ranks (memra/model/ranks.py, comms.py): rank r holds and runs stage r, the last
rank drives; here the ranks are threads of this process on numpy (ThreadComm), as CI runs them.
The truth is the unsplit model on the same backend (tests/pipeline/gate.py's anchors).

Arms: non-vacuity (each rank holds exactly its stage, every follower walks every walk the driver
walks, dropped caches are freed on the followers), W0 plain decode, W1 verify rows with taps made
on earlier ranks, A accept-j-then-continue for every j, E native-mtp and dflash2 greedy tapes and
a forced-rejection sweep. Red arms: a boundary that loses its lowest bits on the wire (R0), and a
follower that ignores the driver's rollback (its KDA state and latent planes stay post-row-K).
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import memra
from memra.backend.numpy_ref import NumpyBackend
from memra.checkpoint import load_checkpoint
from memra.drafters.dflash2 import write_fixture_drafter
from memra.generate import generate
from memra.model.comms import ThreadComm, launcher_env
from memra.model.ranks import RankedGlm5Model, stage_tensors
from memra.model.stages import plan_stages
from memra.errors import BackendError, InputError
from memra.presets import preset
from tests.pipeline.gate import CONT, K, MAX_CTX, N_TAPE, PLEN, PRESET, SEED, SPLITS, bits, primed, tokens
from tests.speculative.battery import Oracle, open_session, round_log, run_bursts


class Ranks:
    """A ranked group on threads: the followers serve() in daemon threads; `driver` is the last."""

    def __init__(self, ckpt_dir, split: str, classes: dict | None = None, timeout: float = 60.0):
        cfg = memra.load_config(ckpt_dir)
        plan = plan_stages(cfg.num_hidden_layers, stage_layers=split)
        comms = ThreadComm.group(plan.count, timeout=timeout)
        last = plan.count - 1
        # each rank reads only its own stage's tensors, as load_ranked does
        weights = [load_checkpoint(ckpt_dir, cfg, keep_bf16=True, only=stage_tensors(cfg, plan, r))
                   for r in range(plan.count)]
        kind = {**(classes or {}), last: RankedGlm5Model}  # rank -> a test's stand-in; the driver is real
        self.models = [kind.get(r, RankedGlm5Model)(cfg, weights[r], NumpyBackend(), plan, r, comms[r])
                       for r in range(plan.count)]
        self.driver, self.errors = self.models[-1], []
        self.threads = [threading.Thread(target=self._serve, args=(m,), daemon=True) for m in self.models[:-1]]
        for t in self.threads:
            t.start()

    def _serve(self, model) -> None:
        try:
            model.serve()
        except BaseException as exc:  # noqa: BLE001  reported by close()
            self.errors.append(exc)

    def close(self) -> list:
        """Stop the followers -> the errors they raised (a healthy group raises none)."""
        self.driver.close()
        for t in self.threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self.threads)
        return self.errors


@pytest.fixture(scope="module")
def ckpt_dir(fixture_dir):
    return fixture_dir(PRESET, seed=SEED)


@pytest.fixture(scope="module")
def ref(ckpt_dir):
    return memra.load_model(ckpt_dir, backend="numpy")


@pytest.fixture(scope="module", params=sorted(SPLITS), ids=lambda n: f"ranks{n}")
def ranks(request, ckpt_dir):
    group = Ranks(ckpt_dir, SPLITS[request.param])
    yield group
    assert group.close() == []


@pytest.fixture(scope="module")
def prompt(ref):
    return tokens(ref, PLEN, 7)


@pytest.fixture(scope="module")
def rows(ref):
    return tokens(ref, K + 1, 50)


@pytest.fixture(scope="module")
def tape(ref, prompt):
    return generate(ref, prompt, 2 * N_TAPE + 2 * K + 2).tokens


# ---- non-vacuity ---------------------------------------------------------------------------------
def test_each_rank_holds_its_stage_and_walks_every_walk(ranks, prompt, rows):
    plan = ranks.driver.placement
    assert plan.describe() == SPLITS[plan.count] and len(ranks.models) == plan.count
    for r, m in enumerate(ranks.models):
        assert [layer.index for layer in m.layers] == list(plan.layers(r))
        assert (m.lm_head is not None) == (r == plan.count - 1) and (m.first_embed is not None) == (r == 0)
    if plan.count == 3:  # the shared indexer layer 2 reads layer 1's selection across the first cut
        assert ranks.models[1].selections_in[1] == (1,) and ranks.models[0].selections_out[0] == (1,)
    before = [m.walked for m in ranks.models]
    cache = primed(ranks.driver, prompt)
    ranks.driver.verify_rows(rows, cache)
    walked = [m.walked - b for m, b in zip(ranks.models, before)]
    assert walked[-1] >= 2 and len(set(walked)) == 1, walked


def test_caches_the_driver_drops_are_freed_on_the_followers(ranks, prompt):
    cache = primed(ranks.driver, prompt)
    cid = cache.rank_id
    primed(ranks.driver, prompt)  # a walk after the drop carries the free
    assert all(cid in m.caches for m in ranks.models[:-1])
    del cache
    gc.collect()
    primed(ranks.driver, prompt)
    assert all(cid not in m.caches for m in ranks.models[:-1])


def test_each_rank_reads_only_its_stages_tensors_and_together_they_read_the_checkpoint(ckpt_dir):
    cfg = memra.load_config(ckpt_dir)
    full = load_checkpoint(ckpt_dir, cfg, keep_bf16=True)
    for split in SPLITS.values():
        plan = plan_stages(cfg.num_hidden_layers, stage_layers=split)
        parts = [load_checkpoint(ckpt_dir, cfg, keep_bf16=True, only=stage_tensors(cfg, plan, r))
                 for r in range(plan.count)]
        assert set().union(*parts) == set(full)
        shared = set(parts[0]) & set(parts[-1])
        assert shared == {"embed_tokens.weight"}  # the first rank embeds; the last embeds drafts
        assert all(np.array_equal(part[name], full[name]) for part in parts for name in part)
        mtp = f"layers.{cfg.num_hidden_layers}."
        assert any(name.startswith(mtp) for name in parts[-1]) and "lm_head.weight" in parts[-1]


# ---- W0 / W1 / A --------------------------------------------------------------------------------
def test_w0_plain_decode_over_ranks_is_the_unsplit_chain(ref, ranks, prompt, rows):
    a, b = ref.new_cache(MAX_CTX), ranks.driver.new_cache(MAX_CTX)
    assert np.array_equal(bits(ref, ref.prime(prompt, a)), bits(ranks.driver, ranks.driver.prime(prompt, b)))
    for r, tok in enumerate(rows):
        assert np.array_equal(bits(ref, ref.decode_step(tok, a)), ranks.driver.decode_step(tok, b)), r


def test_w1_verify_rows_over_ranks_are_the_unsplit_plain_chain(ref, ranks, prompt, rows):
    taps = (0, 2, 5)  # made on the first rank, on the first or a middle one, on the last
    chain = primed(ref, prompt)
    plain = [bits(ref, ref.decode_step(tok, chain)) for tok in rows]
    _, want_collapsed, want_ckpt = ref.verify_rows(rows, primed(ref, prompt), taps)
    logits, collapsed, ckpt = ranks.driver.verify_rows(rows, primed(ranks.driver, prompt), taps)
    for r in range(len(rows)):
        assert np.array_equal(logits[r], plain[r]), f"row {r}"
    assert np.array_equal(collapsed, want_collapsed)
    for layer in taps:
        assert np.array_equal(ckpt.taps[layer], want_ckpt.taps[layer]), layer


@pytest.mark.parametrize("j", range(K + 1))
def test_a_accept_j_then_continue_is_the_never_drafted_chain(ref, ranks, prompt, rows, j):
    driver = ranks.driver
    cache = primed(driver, prompt)
    _, _, ckpt = driver.verify_rows(rows, cache)
    driver.rollback(cache, ckpt, j + 1)
    never = primed(ref, prompt)
    for tok in rows[:j + 1]:
        ref.decode_step(tok, never)
    for tok in CONT:
        assert np.array_equal(driver.decode_step(tok, cache), ref.decode_step(tok, never))


def test_a_rewind_puts_every_rank_back(ref, ranks, prompt, rows):
    driver = ranks.driver
    cache = primed(driver, prompt)
    _, _, ckpt = driver.verify_rows(rows, cache)
    driver.rewind(cache, ckpt)
    never = primed(ref, prompt)
    for tok in CONT:
        assert np.array_equal(driver.decode_step(tok, cache), ref.decode_step(tok, never))


def test_one_rank_is_the_whole_model(ref, ckpt_dir, prompt, rows):
    group = Ranks(ckpt_dir, "0-5")
    try:
        a, b = ref.new_cache(MAX_CTX), group.driver.new_cache(MAX_CTX)
        assert np.array_equal(ref.prime(prompt, a), group.driver.prime(prompt, b))
        assert all(np.array_equal(ref.decode_step(t, a), group.driver.decode_step(t, b)) for t in rows)
    finally:
        assert group.close() == [] and group.threads == []


# ---- E -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 4, K])
def test_e_native_mtp_tapes_over_ranks_equal_the_unsplit_plain_tape(ranks, prompt, tape, k):
    assert generate(ranks.driver, prompt, N_TAPE, draft="native-mtp", num_draft_tokens=k).tokens == tape[:N_TAPE]


@pytest.mark.parametrize("k", [2, K])
def test_e_dflash2_tapes_over_ranks_equal_the_unsplit_plain_tape(ranks, prompt, tape, tmp_path_factory, k):
    path = write_fixture_drafter(tmp_path_factory.mktemp("dflash2"), preset(PRESET))
    out = generate(ranks.driver, prompt, N_TAPE, draft="dflash2", num_draft_tokens=k, draft_options={"path": path})
    assert out.tokens == tape[:N_TAPE]


def test_e_forced_rejection_sweep_over_ranks_keeps_the_tape(ranks, prompt, tape):
    session = open_session(ranks.driver, prompt, MAX_CTX,
                           oracle=Oracle(tape, ranks.driver.cfg.vocab_size, reject_at=lambda r: r % (K + 1)))
    log = round_log(session)
    out = run_bursts(session, 2 * N_TAPE, K)
    assert out == tape[:len(out)] and {accepted for _, accepted in log} >= set(range(K + 1))


# ---- red arms ------------------------------------------------------------------------------------
def test_r0_red_a_boundary_that_loses_its_lowest_bits_on_the_wire_breaks_w0(ref, ckpt_dir, prompt):
    class LossyFirst(RankedGlm5Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            send = self.transport.send

            def flip(stage, boundary):
                boundary.streams = (boundary.streams.view(np.uint32) ^ np.uint32(1)).view(np.float32)
                send(stage, boundary)

            self.transport.send = flip

    group = Ranks(ckpt_dir, SPLITS[2], {0: LossyFirst})
    try:
        got = group.driver.prime(prompt, group.driver.new_cache(MAX_CTX))
    finally:
        assert group.close() == []
    assert not np.array_equal(got, ref.prime(prompt, ref.new_cache(MAX_CTX)))


def test_red_arm_a_follower_that_ignores_rollback_diverges(ref, ckpt_dir, prompt, rows):
    class NoRollback(RankedGlm5Model):
        def _follow(self, kind, *args):
            if kind != 3:  # ROLLBACK
                super()._follow(kind, *args)

    keep = 3
    never = primed(ref, prompt)
    for tok in rows[:keep]:
        ref.decode_step(tok, never)
    want = [ref.decode_step(tok, never) for tok in CONT]
    group = Ranks(ckpt_dir, SPLITS[2], {0: NoRollback}, timeout=5.0)
    got = None
    try:
        cache = primed(group.driver, prompt)
        _, _, ckpt = group.driver.verify_rows(rows, cache)
        group.driver.rollback(cache, ckpt, keep)
        got = [group.driver.decode_step(tok, cache) for tok in CONT]
    except BackendError as exc:  # loud: the follower's planes, out of step with the position, trip its wire
        assert "rank 0 failed (ResidencyError" in str(exc) and "missed rollback" in str(exc)
    finally:
        errors = group.close()
    if got is None:
        assert [type(e).__name__ for e in errors] == ["ResidencyError"]
    else:
        assert any(not np.array_equal(g, w) for g, w in zip(got, want))


class FailsOnThirdWalk(RankedGlm5Model):
    """A rank whose third stage walk raises (a device fault, an out-of-memory, a bug)."""

    def _stage_walk(self, *args):
        self.walks_started = getattr(self, "walks_started", 0) + 1
        if self.walks_started == 3:
            raise RuntimeError("injected")
        return super()._stage_walk(*args)


@pytest.mark.parametrize("failing", [0, 1], ids=["first", "middle"])
def test_a_rank_that_fails_is_reported_by_the_driver_instead_of_a_hang(ckpt_dir, prompt, failing):
    """The failing rank passes its report on instead of a boundary, in that walk and every later
    one; the ranks after it forward it; the driver raises it. No receive ever times out."""
    group = Ranks(ckpt_dir, SPLITS[3], {failing: FailsOnThirdWalk}, timeout=20.0)
    try:
        cache = primed(group.driver, prompt)  # walk 1
        group.driver.decode_step(1, cache)     # walk 2
        for _ in range(2):                     # walk 3 fails; a later one is refused the same way
            with pytest.raises(BackendError, match=f"rank {failing} failed \\(RuntimeError: injected\\)"):
                group.driver.decode_step(2, group.driver.new_cache(MAX_CTX))
    finally:
        errors = group.close()
    assert [str(e) for e in errors] == ["injected"]  # raised again by the failing rank alone, at close


def test_a_rank_outside_the_plan_a_plan_for_another_config_and_a_driver_that_serves_are_refused(ckpt_dir):
    cfg = memra.load_config(ckpt_dir)
    plan = plan_stages(cfg.num_hidden_layers, stage_layers=SPLITS[2])
    weights = load_checkpoint(ckpt_dir, cfg, keep_bf16=True)
    with pytest.raises(InputError, match="WORLD_SIZE = the stage count"):
        RankedGlm5Model(cfg, weights, NumpyBackend(), plan, 0, ThreadComm.group(3)[0])
    with pytest.raises(InputError, match="plan the stages for this config"):
        RankedGlm5Model(cfg, weights, NumpyBackend(), plan_stages(4, stage_layers="0-1,2-3"), 0,
                        ThreadComm.group(2)[0])
    driver = RankedGlm5Model(cfg, weights, NumpyBackend(), plan, 1, ThreadComm.group(2)[1])
    with pytest.raises(InputError, match="the last rank drives"):
        driver.serve()


def test_a_thread_rank_that_waits_past_its_timeout_names_the_rank_it_waited_for():
    comms = ThreadComm.group(2, timeout=0.05)
    with pytest.raises(InputError, match="rank 1 waited 0 s for rank 0"):
        comms[1].recv(np.zeros(3), 0)


def test_a_ranked_run_without_the_launchers_environment_or_a_gpu_backend_is_refused_by_name(ckpt_dir):
    with pytest.raises(InputError, match="torchrun"):
        launcher_env({"RANK": "0"})
    with pytest.raises(InputError, match="torchrun"):
        memra.load_ranked(ckpt_dir, backend="numpy", environ={})
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(InputError, match="load_model\\(path, stages=N\\)"):
        memra.load_ranked(ckpt_dir, backend="numpy", environ=env)
    for key, value in (("RANK", "abc"), ("LOCAL_RANK", "x"), ("MASTER_PORT", "-1"), ("WORLD_SIZE", "2.0")):
        with pytest.raises(InputError, match=f"{key}='{value}' must be a non-negative integer"):
            launcher_env({**env, key: value})
    assert launcher_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}) == \
        {"rank": 1, "world": 2, "local": 0, "host": "h", "port": 29500}
