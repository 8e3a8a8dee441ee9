"""Stage 2, the target: train the demo glm5_next trunk + its NextN/MTP head, then fine-tune the MTP
alone on the target's own greedy labels (research/training.md sections 2-5).

    python training/target.py --run-dir /tmp/memra-train --minutes 8     # again to resume
    python training/target.py --run-dir /tmp/memra-train --smoke         # CPU, tiny, < 2 min

Phase "main" (--steps, 1000): AdamW (0.9, 0.95), weight decay 0.1 on matrices only, LR 2e-3 with
100 warm-up steps and a cosine to 10 %, clip 1.0, bf16 autocast on CUDA, batch 32 x 1024; loss =
CE + lambda * MTP CE (lambda 0.3, 0.1 for the last third), the MTP row i being (tok_{i+1}, h_i)
-> tok_{i+2}. After every step DeepSeek's aux-free balance moves each MoE's (MTP's included)
e_score_correction_bias by 1e-3 * sign(mean load - load): transformers never updates it.
Phase "mtp" (--mtp-steps, 300): the trunk frozen; the MTP block unrolled 3 steps (FastMTP, weights
0.51/0.31/0.18) along memra's native-mtp chain (DemoTarget.mtp_chain) on teacher-forced corpus
tokens, each step labelled with the trunk's greedy next token there (argmax under no_grad).
Every --eval-every steps: held-out `heldout` CE, `mtp_heldout` CE and `mtp_top1_vs_target` (the
MTP's argmax equals the target's next greedy token: first-position acceptance), one JSON line
each; a last JSON summary line; <run>/target/{ckpt.pt, loss.jsonl, loss.png}.
--smoke: the tiny config (target_model.tiny_config), a few steps of both phases, written to
<run>/target_smoke/ (never over a real run); tokens from <run>/tokens when present, else a
synthetic stream.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from training.common import (  # noqa: E402
    Budget, Checkpointer, LossLog, TOKENS_DIR, heldout_windows, load_tokens, random_windows,
    seed_everything, stage_args,
)
from training.demo_config import SEQ_LEN, VOCAB, target_config  # noqa: E402

CHAIN_WEIGHTS = (0.51, 0.31, 0.18)   # FastMTP's recursive step weights


def parse_args(argv=None):
    ap = stage_args(__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU, both phases, < 2 minutes")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=SEQ_LEN)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--mtp-lambda", type=float, default=0.3, help="MTP loss weight; a third of it for the last third")
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="aux-free MoE bias step")
    ap.add_argument("--mtp-steps", type=int, default=300)
    ap.add_argument("--mtp-lr", type=float, default=6e-4)
    ap.add_argument("--mtp-warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=128, help="held-out windows per eval (fixed, the first N)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.seq, args.warmup = 16, 2, 64, 4
        args.mtp_steps, args.mtp_warmup, args.eval_every, args.eval_windows = 8, 2, 8, 2
    return args


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then a cosine from peak to 10 % of it at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def synthetic_tokens(vocab: int, n: int, seed: int) -> np.ndarray:
    """A learnable stand-in corpus for --smoke without a tokenizer run: random 'words' of 2-6
    ids from one fixed Zipf-ish dictionary (the same for both splits), an EOS (0) every ~200 ids."""
    words_rng, rng = np.random.default_rng(0), np.random.default_rng(seed)
    words = [words_rng.integers(3, vocab, words_rng.integers(2, 7)) for _ in range(64)]
    p = 1.0 / np.arange(1, 65)
    out = []
    while sum(map(len, out)) < n:
        out.append(words[rng.choice(64, p=p / p.sum())])
        if rng.random() < 0.02:
            out.append(np.array([0]))
    return np.concatenate(out)[:n].astype(np.uint16)


def load_streams(args):
    """(train, heldout, vocab, stage): real token streams when present; --smoke may synthesise."""
    have = os.path.exists(os.path.join(args.run_dir, TOKENS_DIR, "train.npy"))
    if not args.smoke:
        return load_tokens(args.run_dir, "train"), load_tokens(args.run_dir, "heldout"), VOCAB, "target"
    if have:
        return load_tokens(args.run_dir, "train"), load_tokens(args.run_dir, "heldout"), VOCAB, "target_smoke"
    return synthetic_tokens(256, 60_000, 1), synthetic_tokens(256, 6_000, 2), 256, "target_smoke"


class RouterLoads:
    """Counts each MoE router's expert picks during training forwards; `rebalance` applies the
    aux-free bias update and resets the counts."""

    def __init__(self, model):
        self.routers = model.routers()
        self.counts = {}
        self.hooks = [r.register_forward_hook(self._hook(n)) for n, r in self.routers.items()]
        self.active = False

    def _hook(self, name):
        def hook(module, args, out):
            if self.active:
                c = out[2].flatten().bincount(minlength=module.num_experts)
                self.counts[name] = self.counts.get(name, 0) + c
        return hook

    def rebalance(self, rate: float) -> float:
        """Returns the worst max/mean expert load of this step."""
        import torch

        worst = 0.0
        with torch.no_grad():
            for name, c in self.counts.items():
                load = c.float()
                mean = load.mean()
                self.routers[name].e_score_correction_bias.add_(rate * torch.sign(mean - load))
                worst = max(worst, float(load.max() / mean.clamp_min(1e-9)))
        self.counts = {}
        return worst


def make_optimizer(params, lr: float):
    import torch

    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=torch.cuda.is_available())


def ce(logits, labels):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


class Trainer:
    def __init__(self, args):
        import torch

        from training.target_model import DemoTarget, tiny_config

        self.args, self.torch = args, torch
        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.train_tok, held, vocab, self.stage = load_streams(args)
        self.cfg = tiny_config(vocab) if args.smoke else target_config()
        self.held = heldout_windows(held, args.seq, limit=args.eval_windows)
        self.ckpt, self.log = Checkpointer(args.run_dir, self.stage), LossLog(args.run_dir, self.stage)
        seed_everything(args.seed)
        self.model = DemoTarget(self.cfg).to(self.dev)
        self.loads = RouterLoads(self.model)
        self.opt = make_optimizer(self.model.parameters(), args.lr)
        self.mtp_opt = None
        self.step, self.mtp_step, self.phase = 0, 0, "main"
        state = self.ckpt.load()
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.step, self.mtp_step, self.phase = state["step"], state["mtp_step"], state["phase"]
            if self.phase == "main":
                self.opt.load_state_dict(state["opt"])
            elif state.get("mtp_opt") is not None:
                self._start_mtp_phase()
                self.mtp_opt.load_state_dict(state["mtp_opt"])
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if self.dev.type == "cuda" else contextlib.nullcontext
        self.last = {}

    def save(self):
        self.ckpt.save({"model": self.model.state_dict(), "cfg": self.model.cfg_dict, "step": self.step,
                        "mtp_step": self.mtp_step, "phase": self.phase, "seed": self.args.seed,
                        "opt": self.opt.state_dict() if self.phase == "main" else None,
                        "mtp_opt": self.mtp_opt.state_dict() if self.mtp_opt is not None else None})

    def batch(self, step: int):
        rng = np.random.default_rng([self.args.seed, step])  # the same window on a resumed run
        x = self.torch.from_numpy(random_windows(self.train_tok, self.args.batch, self.args.seq, rng))
        return x.to(self.dev, non_blocking=True)

    # ---- phase main ------------------------------------------------------------------------------
    def main_step(self) -> float:
        a, torch = self.args, self.torch
        lam = a.mtp_lambda if self.step < (2 * a.steps) // 3 else a.mtp_lambda / 3
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, a.steps, a.lr, a.warmup)
        x = self.batch(self.step)
        inp, tgt = x[:, :-1], x[:, 1:]
        self.model.train()
        self.loads.active = True
        with self.autocast():
            logits, h, _ = self.model.forward_trunk(inp)
            loss_lm = ce(logits, tgt)
            mtp_logits, _ = self.model.mtp_step(inp[:, 1:], h[:, :-1])   # (tok_{i+1}, h_i) -> tok_{i+2}
            loss_mtp = ce(mtp_logits, tgt[:, 1:])
        self.loads.active = False
        loss = loss_lm + lam * loss_mtp
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.last["moe_max_over_mean"] = self.loads.rebalance(a.bias_rate)
        self.step += 1
        return float(loss_lm.detach())

    # ---- phase mtp -------------------------------------------------------------------------------
    def _start_mtp_phase(self):
        self.phase = "mtp"
        for p in self.model.parameters():
            p.requires_grad_(False)
        for p in self.model.mtp.parameters():
            p.requires_grad_(True)
        self.mtp_opt = make_optimizer(self.model.mtp.parameters(), self.args.mtp_lr)

    def mtp_train_step(self) -> float:
        a, torch = self.args, self.torch
        for g in self.mtp_opt.param_groups:
            g["lr"] = lr_at(self.mtp_step, a.mtp_steps, a.mtp_lr, a.mtp_warmup)
        x = self.batch(a.steps + self.mtp_step)
        inp = x[:, :-1]
        self.model.train()
        with torch.no_grad(), self.autocast():
            logits, h, _ = self.model.forward_trunk(inp)
            greedy = logits.argmax(-1)                  # greedy[:, j]: the target's token after inp[:, :j+1]
        s = inp.shape[1] - 1                            # MTP rows i = 0..S-2 carry (inp[i+1], h_i)
        self.loads.active = True
        with self.autocast():
            steps = self.model.mtp_chain(inp[:, 1:], h[:, :-1].detach(), n_steps=len(CHAIN_WEIGHTS))
            # step k of base i reads inp[i+1+k] and is labelled greedy[i+1+k]: rows i <= S-2-k exist
            loss = sum(w * ce(lg[:, :s - k], greedy[:, 1 + k:])
                       for k, ((lg, _), w) in enumerate(zip(steps, CHAIN_WEIGHTS)))
        self.loads.active = False
        self.mtp_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.mtp.parameters(), 1.0)
        self.mtp_opt.step()
        self.last["moe_max_over_mean"] = self.loads.rebalance(a.bias_rate)
        self.mtp_step += 1
        return float(loss.detach())

    # ---- eval ------------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        torch = self.torch
        self.model.eval()
        tot = {"heldout": 0.0, "mtp_heldout": 0.0, "mtp_top1_vs_target": 0.0}
        n = 0
        with torch.no_grad(), self.autocast():
            for i in range(0, len(self.held), self.args.batch):
                x = torch.from_numpy(self.held[i:i + self.args.batch]).to(self.dev)
                inp, tgt = x[:, :-1], x[:, 1:]
                logits, h, _ = self.model.forward_trunk(inp)
                mtp_logits, _ = self.model.mtp_step(inp[:, 1:], h[:, :-1])
                w = x.shape[0]
                tot["heldout"] += w * float(ce(logits, tgt))
                tot["mtp_heldout"] += w * float(ce(mtp_logits, tgt[:, 1:]))
                agree = mtp_logits.argmax(-1) == logits[:, 1:].argmax(-1)
                tot["mtp_top1_vs_target"] += w * float(agree.float().mean())
                n += w
        return {k: v / max(n, 1) for k, v in tot.items()}


def run(args) -> dict:
    t = Trainer(args)
    budget, a = Budget(args.minutes), args
    params = sum(p.numel() for p in t.model.parameters())
    print(f"target: {params / 1e6:.2f} M parameters on {t.dev}, stage {t.stage}, phase {t.phase} "
          f"step {t.step}/{a.steps}, mtp step {t.mtp_step}/{a.mtp_steps}", file=sys.stderr)
    t0, done_tokens, losses = time.monotonic(), 0, []

    def report(step: int, train_key: str):
        nonlocal t0, done_tokens, losses
        ev = t.evaluate()
        dt = time.monotonic() - t0
        rec = {train_key: float(np.mean(losses))} if losses else {}
        rec.update(ev)
        t.log.add(step, **rec)
        print(json.dumps({"stage": t.stage, "phase": t.phase, "step": step, **rec,
                          "tokens_per_s": round(done_tokens / dt, 1) if dt > 0 else 0.0,
                          "moe_max_over_mean": t.last.get("moe_max_over_mean")}), flush=True)
        t.save()
        t0, done_tokens, losses = time.monotonic(), 0, []
        return ev

    last_eval = {}
    while t.phase == "main" and t.step < a.steps and not budget.spent():
        losses.append(t.main_step())
        done_tokens += a.batch * a.seq
        if t.step % a.eval_every == 0 or t.step == a.steps:
            last_eval = report(t.step, "train")
    if t.phase == "main" and t.step >= a.steps:
        t._start_mtp_phase()
    while t.phase == "mtp" and t.mtp_step < a.mtp_steps and not budget.spent():
        losses.append(t.mtp_train_step())
        done_tokens += a.batch * a.seq
        if t.mtp_step % a.eval_every == 0 or t.mtp_step == a.mtp_steps:
            last_eval = report(a.steps + t.mtp_step, "mtp_chain_train")
    if t.phase == "mtp" and t.mtp_step >= a.mtp_steps:
        t.phase = "done"
    if not last_eval:
        last_eval = t.evaluate()
    t.save()
    png = os.path.join(a.run_dir, t.stage, "loss.png")
    if t.log.records():
        t.log.plot(png, f"demo target ({params / 1e6:.1f} M params): CE nats/token; MTP top-1 vs target")
    summary = {"stage": t.stage, "summary": True, "done": t.phase == "done", "phase": t.phase, "step": t.step,
               "mtp_step": t.mtp_step, "params": params, **last_eval, "png": png}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    run(parse_args())
