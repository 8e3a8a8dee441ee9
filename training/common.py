"""What every training stage shares: the run directory, seeding, resumable checkpoints, the
loss log and its PNG, a wall-clock budget, and the token streams.

Each stage is one script that runs for at most `--minutes` and leaves a checkpoint in the run
directory, so a stage spans several short device calls:

    python training/target.py --run-dir /tmp/memra-train --minutes 4     # again to resume
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import numpy as np

TOKENS_DIR = "tokens"          # <run>/tokens/{train,heldout}.npy: uint16 ids, EOS after each file


def stage_args(description: str, **defaults) -> argparse.ArgumentParser:
    """The flags every stage takes; a stage adds its own."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--run-dir", default=defaults.get("run_dir", "/tmp/memra-train"))
    ap.add_argument("--seed", type=int, default=defaults.get("seed", 0))
    ap.add_argument("--minutes", type=float, default=defaults.get("minutes", 8.0),
                    help="wall-clock budget of this call; the stage checkpoints and exits when it is spent")
    return ap


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Budget:
    """True once `minutes` of wall clock have passed since construction."""

    def __init__(self, minutes: float):
        self.end = time.monotonic() + 60.0 * minutes

    def spent(self) -> bool:
        return time.monotonic() >= self.end


class Checkpointer:
    """<run>/<stage>/ckpt.pt, written atomically (a call killed mid-write keeps the last one)."""

    def __init__(self, run_dir: str, stage: str):
        self.dir = os.path.join(run_dir, stage)
        os.makedirs(self.dir, exist_ok=True)
        self.path = os.path.join(self.dir, "ckpt.pt")

    def load(self):
        import torch

        if not os.path.exists(self.path):
            return None
        return torch.load(self.path, map_location="cpu", weights_only=False)

    def save(self, state: dict) -> None:
        import torch

        tmp = self.path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.path)


class LossLog:
    """<run>/<stage>/loss.jsonl, one record per logged step; `plot` draws every series to PNG."""

    def __init__(self, run_dir: str, stage: str):
        self.path = os.path.join(run_dir, stage, "loss.jsonl")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def add(self, step: int, **values: float) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **{k: float(v) for k, v in values.items()}}) + "\n")

    def records(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def plot(self, png: str, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        recs = self.records()
        keys = sorted({k for r in recs for k in r if k != "step"})
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            pts = [(r["step"], r[key]) for r in recs if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key, marker="." if len(pts) < 30 else None)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)


def load_tokens(run_dir: str, split: str) -> np.ndarray:
    """The token stream of `split` ("train" | "heldout") written by tokenizer.py."""
    path = os.path.join(run_dir, TOKENS_DIR, f"{split}.npy")
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: run training/corpus.py and training/tokenizer.py first")
    return np.load(path)


def random_windows(tokens: np.ndarray, batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    """`batch` windows of seq + 1 tokens at uniform random offsets: inputs [:, :-1], labels [:, 1:]."""
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    return np.stack([tokens[s:s + seq + 1] for s in starts]).astype(np.int64)


def heldout_windows(tokens: np.ndarray, seq: int, limit: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows of seq + 1 tokens over the held-out stream (fixed)."""
    n = (len(tokens) - 1) // seq
    if limit is not None:
        n = min(n, limit)
    return np.stack([tokens[i * seq:i * seq + seq + 1] for i in range(n)]).astype(np.int64)
