"""bench_accept: the acceptance the demo model's draft sources reach on held-out code.

    python benchmarks/bench_accept.py --backend cuda --git-sha SHA [--checkpoint DIR --drafter DIR]
        [--prompts 16] [--prompt-tokens 128] [--new-tokens 128] [--ks 1,2,3,4,5,6,7]
        [--sources native-mtp,dflash2] [--modes greedy,sampled] [--out F]

Prompts are cut from the held-out files of training/manifest/corpus.json (benchmarks/heldout.py:
only files whose sha256 matches are used). For each prompt the plain greedy tape comes first;
then every (source, mode, K) generates the same number of tokens through `memra.generate`.
Greedy: the speculative tokens must equal the plain tape (a mismatch fails the run). Sampled:
temperature 0.7, top-p 0.95, seed = prompt index. Prompts whose greedy tape loops (its second
half periodic) are left out of the acceptance numbers (they flatter any drafter) but are still
checked for identity. Reported per (source, mode, K): mean acceptance length (1 + accepted /
rounds with drafts), per-position acceptance (accepted at position j / rounds) and the
conditional rate at j (accepted at j / accepted at j - 1). Card on stderr, ONE JSON line on stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit, int_list, record_header  # noqa: E402
from benchmarks.heldout import heldout_prompts, is_looping  # noqa: E402
from memra import load_model  # noqa: E402
from memra.generate import generate  # noqa: E402
from memra.speculative.sampling import SamplingParams  # noqa: E402
from memra.tokenizer import load_tokenizer  # noqa: E402

SAMPLED = dict(temperature=0.7, top_p=0.95)


def _args(argv=None) -> argparse.Namespace:
    from memra import demo_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=demo_model.TARGET, help="target checkpoint (default: the demo)")
    ap.add_argument("--drafter", default=demo_model.DFLASH2, help="dflash2 drafter dir (default: the demo's)")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "numpy"))
    ap.add_argument("--git-sha", required=True)
    ap.add_argument("--out")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ks", type=int_list, default=list(range(1, 8)))
    ap.add_argument("--sources", default="native-mtp,dflash2")
    ap.add_argument("--modes", default="greedy,sampled")
    return ap.parse_args(argv)


def _tally(runs: list[dict], k: int) -> dict:
    drafts = sum(r["num_drafts"] for r in runs)
    per_pos = [sum((r["accepted_per_pos"] + [0] * k)[j] for r in runs) for j in range(k)]
    accepted = sum(r["num_accepted_tokens"] for r in runs)
    cond = [per_pos[j] / (per_pos[j - 1] if j else drafts) if (per_pos[j - 1] if j else drafts) else None
            for j in range(k)]
    return {
        "prompts": len(runs), "rounds_with_drafts": drafts, "drafted": sum(r["num_draft_tokens"] for r in runs),
        "accepted": accepted, "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position": [p / drafts if drafts else None for p in per_pos], "conditional": cond,
    }


def main(argv=None) -> int:
    args = _args(argv)
    model = load_model(args.checkpoint, backend=args.backend)
    tok = load_tokenizer(args.checkpoint, vocab_size=model.cfg.vocab_size)
    prompts = heldout_prompts(tok, args.prompts, args.prompt_tokens, args.new_tokens)
    if not prompts:
        raise SystemExit("no held-out file of the manifest is present with its recorded sha256 here")
    sources, modes = args.sources.split(","), args.modes.split(",")
    tapes = [generate(model, ids, args.new_tokens).tokens for _, ids in prompts]
    looping = [is_looping(t) for t in tapes]
    results, mismatches = [], []
    for source in sources:
        options = {"path": args.drafter} if source == "dflash2" else None
        for mode in modes:
            for k in args.ks:
                runs = []
                for i, (path, ids) in enumerate(prompts):
                    sampling = SamplingParams(**SAMPLED, seed=i) if mode == "sampled" else None
                    res = generate(model, ids, args.new_tokens, draft=source, num_draft_tokens=k,
                                   draft_options=options, sampling=sampling)
                    if mode == "greedy" and res.tokens != tapes[i]:
                        mismatches.append({"source": source, "k": k, "prompt": path})
                    if not looping[i]:
                        runs.append(res.stats)
                results.append({"source": source, "mode": mode, "k": k, **_tally(runs, k)})
    config = {"checkpoint": args.checkpoint, "drafter": args.drafter, "prompts": len(prompts),
              "prompt_files": [path for path, _ in prompts],
              "looping_excluded": sum(looping), "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "sampled": SAMPLED}
    record = record_header("bench_accept", args.git_sha, config, model.be) | {
        "greedy_identical_to_plain": not mismatches, "mismatches": mismatches, "results": results}
    card = [f"bench_accept on {model.be.device_name()}: {len(prompts)} held-out prompts "
            f"({sum(looping)} looping, excluded), greedy tapes identical to plain: {not mismatches}"]
    for r in results:
        pp = " ".join(f"{p:.2f}" for p in r["per_position"] if p is not None)
        mal = r["mean_acceptance_length"]
        card.append(f"  {r['source']:<10} {r['mode']:<7} K={r['k']}: mean length "
                    f"{mal if mal is None else round(mal, 3)}, per position {pp}")
    emit(record, card, args.out)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
