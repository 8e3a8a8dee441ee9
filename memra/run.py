"""`python -m memra.run`: generate from a glm5_next checkpoint (or the built-in demo model).

    python -m memra.run                                  # demo: the `small` preset fixture
    python -m memra.run --model DIR --prompt-ids 1,2,3 --max-new-tokens 32 --backend cuda
    python -m memra.run --draft native-mtp --num-draft-tokens 4   # speculative, same tokens
    python -m memra.run --list-drafters                  # installed draft sources and their origin
    python -m memra.run --draft native-mtp --temperature 0.8 --top-p 0.95 --seed 1   # sampled, exact

Token ids in, token ids out (plus the UTF-8 text when the vocab is byte-level, i.e. 256).
Every refusal prints its message and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from memra.errors import InputError, MemraError


def _parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m memra.run", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (config.json + safetensors); default: the demo model")
    ap.add_argument("--demo-preset", default="small", help="preset for the demo model (mini | small)")
    ap.add_argument("--demo-dir", default=os.path.join(tempfile.gettempdir(), "memra-demo"),
                    help="where the demo fixture is written once and reused")
    ap.add_argument("--backend", default="auto", help="numpy | cuda | auto (default)")
    ap.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    ap.add_argument("--prompt", help="prompt text, as UTF-8 bytes (byte-level vocabs only)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--draft", help="speculative draft source (see --list-drafters); default: plain greedy")
    ap.add_argument("--num-draft-tokens", type=int, default=4, help="drafts per round, K (1..14)")
    ap.add_argument("--draft-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option for the draft source (repeatable; VALUE parsed as JSON when it can be)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--list-drafters", action="store_true",
                    help="print each draft source with where it came from (built-in or plugin) and exit")
    return ap.parse_args(argv)


def _demo_dir(root: str, preset_name: str) -> str:
    """Write (once) the deterministic demo fixture and return its directory."""
    from memra.checkpoint import write_fixture
    from memra.config import preset

    path = os.path.join(root, f"{preset_name}-seed0")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        write_fixture(path, preset(preset_name), seed=0)
    return path


def _prompt(args, vocab: int) -> list[int]:
    if args.prompt_ids and args.prompt:
        raise InputError("give either --prompt-ids or --prompt, not both")
    if args.prompt is not None:
        if vocab != 256:
            raise InputError(f"--prompt needs a byte-level vocab (256); this model has {vocab}: use --prompt-ids")
        return list(args.prompt.encode("utf-8"))
    if args.prompt_ids:
        try:
            return [int(x) for x in args.prompt_ids.split(",")]
        except ValueError:
            raise InputError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    return [1, 2, 3, 4]


def _draft_options(pairs: list[str]) -> dict | None:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"--draft-option takes KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options or None


def _sampling(args):
    from memra.spec.sampling import SamplingParams

    if args.temperature == 0:
        return None
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed)


def _list_drafters() -> None:
    from memra.drafters.registry import draft_source_origins

    origins = draft_source_origins()
    width = max(map(len, origins), default=0)
    for name, origin in origins.items():
        print(f"{name:<{width}}  {origin}")


def main(argv=None) -> int:
    args = _parse_args(argv)
    try:
        if args.list_drafters:
            _list_drafters()
            return 0
        from memra import load_model
        from memra.generate import generate

        path = args.model or _demo_dir(args.demo_dir, args.demo_preset)
        model = load_model(path, backend=args.backend)
        prompt = _prompt(args, model.cfg.vocab_size)
        t0 = time.perf_counter()
        result = generate(model, prompt, args.max_new_tokens, draft=args.draft,
                          num_draft_tokens=args.num_draft_tokens, draft_options=_draft_options(args.draft_option),
                          sampling=_sampling(args), eos=model.cfg.eos_token_id)
        seconds = time.perf_counter() - t0
    except MemraError as exc:
        print(f"memra: {exc}", file=sys.stderr)
        return 2
    tokens = result.tokens
    record = {"model": path, "backend": model.be.name, "draft": args.draft, "temperature": args.temperature,
              "prompt_ids": prompt,
              "tokens": tokens, "tokens_per_s": round(len(tokens) / seconds, 2) if seconds > 0 else None}
    if args.draft:
        record["stats"] = result.stats
    if model.cfg.vocab_size == 256:
        record["text"] = bytes(tokens).decode("utf-8", errors="replace")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
