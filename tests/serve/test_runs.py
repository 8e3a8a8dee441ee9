"""The server's sessions, without the server: however a request's bursts are cut and whatever runs
between them, its tokens are `generate`'s; and the logits behind each token are the target's own
(a speculative run's equal a plain run's, bit for bit)."""

import numpy as np
import pytest

from memra import SamplingParams, generate, load_model
from memra.serve.protocol import Job
from memra.serve.runs import open_run, token_logprobs

PROMPT = list(b"The quick brown fox")
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
CASES = [(None, None), (None, SAMPLED), ("native-mtp", None), ("native-mtp", SAMPLED), ("dflash2", None),
         ("dflash2", SAMPLED)]
IDS = ["plain-greedy", "plain-sampled", "mtp-greedy", "mtp-sampled", "dflash2-greedy", "dflash2-sampled"]


@pytest.fixture(scope="module")
def model(small_dir):
    return load_model(small_dir, backend="numpy")


@pytest.fixture(scope="module")
def drafters(model, drafter_dir):
    from memra.drafters.registry import load_drafter

    return {"native-mtp": load_drafter("native-mtp", model), "dflash2": load_drafter("dflash2", model,
                                                                                      {"path": drafter_dir})}


def job(draft, sampling, max_tokens=9, eos=(), logprobs=None, k=3):
    return Job(prompt=PROMPT, max_tokens=max_tokens, sampling=sampling, draft=draft, num_draft_tokens=k, eos=eos,
               logprobs=logprobs)


def solo(model, drafter_dir, j: Job, on_tokens=None):
    options = {"path": drafter_dir} if j.draft == "dflash2" else None
    return generate(model, j.prompt, j.max_tokens, draft=j.draft, num_draft_tokens=j.num_draft_tokens,
                    draft_options=options, sampling=j.sampling, eos=j.eos, on_tokens=on_tokens).tokens


def drain(run, sizes) -> list[int]:
    out, i = [], 0
    while not run.done:
        out.extend(run.step(sizes[i % len(sizes)]))
        i += 1
        assert i < 200
    return out


@pytest.mark.parametrize("draft,sampling", CASES, ids=IDS)
def test_a_run_in_any_bursts_gives_generates_tokens(model, drafters, drafter_dir, draft, sampling):
    j = job(draft, sampling)
    expected = solo(model, drafter_dir, j)
    assert len(expected) == j.max_tokens
    streamed = []   # generate streaming asks one round per burst: the same rounds, the same tokens
    assert solo(model, drafter_dir, j, on_tokens=lambda ids, _: streamed.extend(ids)) == streamed == expected
    for sizes in ([1], [3, 1, 5]):
        run = open_run(model, j, drafters.get(draft))
        assert drain(run, sizes) == expected
        run.close()


def test_runs_interleaved_round_robin_each_equal_their_solo_run(model, drafters, drafter_dir):
    jobs = [job(d, s, max_tokens=2 + i) for i, (d, s) in enumerate(CASES)]
    runs = [open_run(model, j, drafters.get(j.draft)) for j in jobs]
    outs = [r.step(1) for r in runs]
    for _ in range(100):
        live = [i for i, r in enumerate(runs) if not r.done]
        if not live:
            break
        for i in live:
            outs[i].extend(runs[i].step(2))
    assert all(r.done for r in runs)
    assert outs == [solo(model, drafter_dir, j) for j in jobs]


@pytest.mark.parametrize("draft", [None, "native-mtp"])
def test_a_run_stops_at_the_first_eos_and_keeps_it(model, drafters, drafter_dir, draft):
    tape = solo(model, drafter_dir, job(None, None, max_tokens=12))
    eos = (tape[4],)
    run = open_run(model, job(draft, None, max_tokens=12, eos=eos), drafters.get(draft))
    assert drain(run, [5]) == tape[:tape.index(tape[4]) + 1]


@pytest.mark.parametrize("draft", ["native-mtp", "dflash2"])
def test_a_speculative_runs_logits_are_the_plain_runs_bit_for_bit(model, drafters, draft):
    plain = open_run(model, job(None, None, logprobs=2))
    spec = open_run(model, job(draft, None, logprobs=2), drafters[draft])
    assert drain(plain, [4]) == drain(spec, [4])
    rows_plain, rows_spec = list(plain.logits), list(spec.logits)
    assert len(rows_plain) == len(rows_spec[:len(rows_plain)]) == 9   # a round may overshoot: extra rows
    for a, b in zip(rows_plain, rows_spec):
        assert np.array_equal(a, b)


def test_token_logprobs_are_the_log_softmax_of_the_logits_with_the_top_ids_first():
    logits = np.array([1.0, 3.0, 3.0, -2.0])
    lp, top = token_logprobs(logits, 3, 3)
    ref = logits - np.log(np.exp(logits).sum())
    assert lp == pytest.approx(ref[3])
    assert [i for i, _ in top] == [1, 2, 0] and top[0][1] == pytest.approx(ref[1])
    assert token_logprobs(logits, 0, 0)[1] == []


def test_close_drops_the_cache(model, drafters):
    import gc
    import weakref

    for run in (open_run(model, job(None, None)), open_run(model, job("native-mtp", None), drafters["native-mtp"])):
        ref = weakref.ref(run.cache)
        run.step(3)
        run.close()
        gc.collect()
        assert ref() is None
