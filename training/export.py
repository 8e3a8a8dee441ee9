"""Stage 4, the export: the trained target (HF layout + tokenizer) and drafter into memra's package
data, and the model card's numbers into memra/demo_model/card.json.

    python training/export.py --run-dir /tmp/memra-train            # on the GPU host, after stages 0-3
    python training/export.py --card-only                            # the card again, from what is shipped

The card's held-out excerpt (the first 256 tokens of a few held-out files, each closed by EOS)
is scored here with transformers' own Glm5NextTextModel in float32 on the exported weights, an
implementation independent of memra's; tests/demo checks that memra's numpy walk gives the same
loss within 1 %. The files are chosen among held-out files whose bytes are identical across the
interpreters seen (3.12.3 on the GPU host, 3.11.7 where CI runs), so CI can read them too.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.heldout import excerpt_ids  # noqa: E402
from training.common import load_tokens, stage_args  # noqa: E402
from training.demo_config import EOS_ID  # noqa: E402

PACKAGE = os.path.join(REPO, "memra", "demo_model")
EXCERPT_FILES = ["_py_abc.py", "_threading_local.py", "asyncio/threads.py", "collections/abc.py"]
EXCERPT_PER_FILE = 256


def export_models(run_dir: str, out: str) -> None:
    from training.drafter import load_drafter
    from training.export_drafter import export_drafter
    from training.export_target import export_target
    from training.target_model import load_target

    target = load_target(run_dir)
    export_target(target, os.path.join(out, "target"))
    shutil.copy(os.path.join(run_dir, "tokenizer.json"), os.path.join(out, "target", "tokenizer.json"))
    drafter, _ = load_drafter(run_dir, target=target)
    export_drafter(drafter, os.path.join(out, "dflash2"))


def torch_nats(target_dir: str, ids: list[int]) -> float:
    """Mean next-token cross-entropy of `ids` under transformers' model of the exported weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import Glm5NextTextConfig, Glm5NextTextModel

    raw = json.load(open(os.path.join(target_dir, "config.json"), encoding="utf-8"))
    cfg = Glm5NextTextConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")})
    model = Glm5NextTextModel.from_pretrained(target_dir, config=cfg, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    head = load_file(os.path.join(target_dir, "model.safetensors"))["lm_head.weight"].float()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0]
        logp = torch.log_softmax((hidden @ head.T).double(), dim=-1)
    nxt = torch.tensor(ids[1:])
    return float(-logp[:-1].gather(1, nxt[:, None]).mean())


def training_numbers(run_dir: str) -> dict:
    """What the run directory recorded: the loss logs' last and best held-out evals, token counts."""
    out = {}
    path = os.path.join(run_dir, "target", "loss.jsonl")
    if os.path.exists(path):
        evals = [json.loads(line) for line in open(path) if '"heldout"' in line]
        main = [e for e in evals if "mtp_chain_train" not in e]
        best = min(main, key=lambda e: e["heldout"])
        out["target"] = {"final": evals[-1], "best_heldout": {"step": best["step"], "heldout": best["heldout"]}}
    path = os.path.join(run_dir, "drafter", "eval.json")
    if os.path.exists(path):
        out["drafter"] = json.load(open(path))
    if os.path.exists(os.path.join(run_dir, "tokens", "train.npy")):
        out["tokens"] = {s: int(load_tokens(run_dir, s).size) for s in ("train", "heldout")}
    return out


def write_card(out: str, run_dir: str | None) -> dict:
    from memra.tokenizer import load_tokenizer

    target = os.path.join(out, "target")
    tok = load_tokenizer(target, vocab_size=8192)
    ids = excerpt_ids(tok, EXCERPT_FILES, EXCERPT_PER_FILE, EOS_ID)
    if ids is None:
        raise SystemExit(f"the excerpt files {EXCERPT_FILES} are not here with their recorded sha256")
    path = os.path.join(out, "card.json")
    card = json.load(open(path)) if os.path.exists(path) else {}
    card["heldout_excerpt"] = {"files": EXCERPT_FILES, "tokens_per_file": EXCERPT_PER_FILE, "tokens": len(ids)}
    card["heldout_excerpt_nats"] = torch_nats(target, ids)
    if run_dir is not None:
        card.update(training_numbers(run_dir))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(card, f, indent=1)
        f.write("\n")
    return card


def main() -> None:
    ap = stage_args(__doc__.split("\n")[0])
    ap.add_argument("--out", default=PACKAGE)
    ap.add_argument("--card-only", action="store_true", help="recompute the card from the shipped files")
    args = ap.parse_args()
    if not args.card_only:
        export_models(args.run_dir, args.out)
    card = write_card(args.out, None if args.card_only else args.run_dir)
    print(json.dumps({"stage": "export", "heldout_excerpt_nats": card["heldout_excerpt_nats"]}))


if __name__ == "__main__":
    main()
