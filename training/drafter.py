"""Stage 3, the DFlash2 drafter: trained against the frozen target on the target's own taps and
greedy tokens (research/training.md sections 2 and 6).

Each step takes random train windows, runs the frozen target once (no grad) for its taps at
target_layer_ids and its logits, and draws up to 512 anchors per window. A block is
[token a, MASK x 7] over the context taps strictly before a; slot k is supervised with the
target's teacher-forced greedy token at a+k (argmax of its logits at a+k-1): memra accepts a
draft only when it equals the target's argmax. Loss = decay-CE (weights exp(-(k-1)/4)) + 1.0 x the
selector's CE over its top-K candidates with the true predecessor (labels outside the top-K are
dropped; their share is the candidate recall). The mask row is learned (exported beside the
drafter). Held-out: the accept length a greedy verifier gives (leading slots of the selector's
greedy walk equal to the labels, 0..7 per block) and per-slot accuracy.

    python training/drafter.py --run-dir /tmp/memra-train --minutes 4        # again to resume
    python training/drafter.py --run-dir /tmp/drafter-smoke --smoke     # CPU, tiny, <= 1.5 min
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from training.common import (  # noqa: E402
    Budget, Checkpointer, LossLog, heldout_windows, load_tokens, random_windows, seed_everything, stage_args,
)
from training.demo_config import VOCAB  # noqa: E402

STAGE = "drafter"
DECAY_GAMMA = 4.0          # decay-CE slot weights exp(-(k-1)/gamma), NVIDIA modelopt's B=8 value
SELECTOR_WEIGHT = 1.0
WEIGHT_DECAY = 0.01
# CPU smoke: a tiny random target (target_model.tiny_config) and a drafter shrunk to match it
SMOKE_SHAPE = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                   selector_rank=16, selector_top_k=8)
SMOKE_VOCAB = 256
DEFAULT_STEPS = 1500        # 16 x 1024 target tokens and 16 x 512 blocks a step: ~24 M tokens, ~3 epochs


def parse_args(argv=None):
    ap = stage_args(__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random target, tiny batches (< 2 min)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"optimizer steps of the whole schedule (default {DEFAULT_STEPS}; a resumed run keeps "
                         "its own unless this is given)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--anchors", type=int, default=512, help="blocks per window")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-windows", type=int, default=64)
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.seq, args.anchors = min(args.steps or 200, 200), 4, 64, 24
        args.eval_every, args.eval_windows, args.minutes = 100, 8, min(args.minutes, 1.5)
    return args


# ---- the target ------------------------------------------------------------------------------------
def smoke_target(seed: int, vocab: int):
    """The tiny random target of a smoke run; the same seed rebuilds the same weights. Its lm head
    is scaled so logits spread ~3 nats, as a trained head's do (at HF's init std 0.02 every label
    is a near-tie and no drafter can learn it in a smoke's few steps)."""
    import torch

    from training.target_model import DemoTarget, tiny_config

    torch.manual_seed(seed)
    target = DemoTarget(tiny_config(vocab)).eval()
    with torch.no_grad():
        w = target.lm_head.weight
        w.mul_(3.0 / (w.std() * w.shape[1] ** 0.5))
    return target


def frozen_target(run_dir: str, smoke: dict | None, device):
    from training.target_model import load_target

    target = load_target(run_dir) if smoke is None else smoke_target(smoke["seed"], smoke["vocab"])
    return target.to(device).eval().requires_grad_(False)


def borrowed_tables(target):
    """The target's embedding and lm head, which the drafter borrows (frozen)."""
    return target.trunk.embed_tokens.weight, target.lm_head.weight


def target_pass(target, ids, taps, autocast):
    """(tap rows in target_layer_ids order [B, S, H] each, greedy labels [B, S]) of one forward:
    labels[:, p] = argmax of the target's logits at p, its prediction for position p + 1."""
    import torch

    with torch.no_grad(), autocast():
        logits, _, tapped = target.forward_trunk(ids, tap_layers=taps)
    return [tapped[t] for t in taps], logits.argmax(dim=-1)


# ---- blocks and the loss ---------------------------------------------------------------------------
def sample_anchors(batch: int, seq: int, n: int, block: int, gen):
    """[B, N] distinct anchor positions in 1..seq-block+1 (room for b-1 labelled slots, >= 1 context row)."""
    import torch

    span = seq - block + 1
    n = min(n, span)
    return torch.rand(batch, span, generator=gen).topk(n, dim=-1).indices.sort(dim=-1).values + 1


def block_labels(ids, labels, anchor_pos, block: int):
    """(anchor ids [B, N], slot labels [B, N, b-1]): slot k's label is labels[a + k - 1]."""
    import torch

    offs = torch.arange(block - 1, device=ids.device)
    at = (anchor_pos.unsqueeze(-1) + offs).flatten(1)
    return ids.gather(1, anchor_pos), labels.gather(1, at).view(*anchor_pos.shape, block - 1)


def slot_weights(n_slots: int, device):
    import torch

    return torch.exp(-torch.arange(n_slots, dtype=torch.float32, device=device) / DECAY_GAMMA)


def drafter_loss(drafter, taps, anchor_pos, anchor_ids, slot_labels):
    """(loss, stats, hidden, logits) of one batch of blocks: decay-CE + SELECTOR_WEIGHT x selector
    CE_K; hidden / logits are the draft slots' rows [B, N, b-1, .]."""
    import torch
    import torch.nn.functional as F

    hidden = drafter(drafter.context_features(taps), anchor_pos, anchor_ids)[..., 1:, :]
    logits = drafter.logits(hidden)
    ce = F.cross_entropy(logits.float().flatten(0, -2), slot_labels.flatten(), reduction="none")
    ce = ce.view_as(slot_labels)
    w = slot_weights(slot_labels.shape[-1], ce.device)
    decay_ce = (ce * w).sum(-1).mean() / w.sum()
    sel = drafter.candidate_selector
    u, cand = sel.candidates(logits)
    pred = torch.cat([anchor_ids.unsqueeze(-1), slot_labels[..., :-1]], dim=-1)   # teacher-forced
    scores = sel.scores(u, cand, hidden, pred)
    hit = cand == slot_labels.unsqueeze(-1)
    found = hit.any(-1)
    sel_ce = F.cross_entropy(scores[found], hit[found].float().argmax(-1)) if found.any() \
        else scores.sum() * 0.0
    loss = decay_ce + SELECTOR_WEIGHT * sel_ce
    stats = {"loss": loss.item(), "ce": decay_ce.item(), "sel_ce": sel_ce.item(),
             "recall": found.float().mean().item(), "slot1_ce": ce[..., 0].mean().item()}
    return loss, stats, hidden, logits


def lr_at(step: int, total: int, peak: float) -> float:
    """4 % linear warm-up, then cosine to 10 % of the peak."""
    warm = max(1, round(0.04 * total))
    if step < warm:
        return peak * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


# ---- held-out ------------------------------------------------------------------------------------
def evaluate(drafter, target, windows, args, device, autocast) -> dict:
    """Held-out decay-CE, candidate recall, per-slot accuracy of the selector's greedy walk and
    of the plain per-row argmax, and the accept length (leading walk slots equal to the labels)."""
    import torch

    drafter.eval()
    gen = torch.Generator().manual_seed(1234)   # the same anchors at every evaluation
    b = drafter.block_size
    sums, n_blocks = {}, 0
    for i in range(0, len(windows), args.batch):
        ids = torch.from_numpy(windows[i:i + args.batch, :-1]).to(device)
        taps, labels = target_pass(target, ids, drafter.tap_layers, autocast)
        anchor_pos = sample_anchors(ids.shape[0], ids.shape[1], args.anchors, b, gen).to(device)
        anchor_ids, slot_labels = block_labels(ids, labels, anchor_pos, b)
        with torch.no_grad(), autocast():
            _, stats, hidden, logits = drafter_loss(drafter, taps, anchor_pos, anchor_ids, slot_labels)
            walk = drafter.candidate_selector.greedy_walk(logits, hidden, anchor_ids)
        blocks = anchor_pos.numel()
        for name, drafts in (("walk", walk), ("argmax", logits.argmax(-1))):
            match = (drafts == slot_labels).float()
            accept = match.cumprod(-1).sum(-1)
            sums[f"accept_len_{name}"] = sums.get(f"accept_len_{name}", 0.0) + accept.sum().item()
            sums[f"slot_acc_{name}"] = sums.get(f"slot_acc_{name}", 0.0) + match.sum((0, 1)).cpu().numpy()
        for key in ("ce", "sel_ce", "recall"):
            sums[key] = sums.get(key, 0.0) + stats[key] * blocks
        n_blocks += blocks
    drafter.train()
    out = {k: (v / n_blocks).tolist() if isinstance(v, np.ndarray) else v / n_blocks for k, v in sums.items()}
    out["blocks"] = n_blocks
    return out


# ---- the stage -----------------------------------------------------------------------------------
def build_drafter(target, smoke: bool):
    from training.dflash2_torch import DFlash2Drafter, drafter_config

    import torch

    cfg = drafter_config(target.cfg_dict, **(SMOKE_SHAPE if smoke else {}))
    drafter = DFlash2Drafter(cfg, *borrowed_tables(target))
    with torch.no_grad():   # start at the scale the target's lm head was trained on
        drafter.norm.weight.copy_(target.trunk.norm.weight)
    return drafter


def load_drafter(run_dir: str, target=None, device="cpu"):
    """(drafter, target) from <run>/drafter/ckpt.pt; the target is rebuilt (smoke) or loaded."""
    state = Checkpointer(run_dir, STAGE).load()
    if state is None:
        raise SystemExit(f"no drafter checkpoint in {run_dir}/{STAGE}: run training/drafter.py first")
    target = target if target is not None else frozen_target(run_dir, state["smoke"], device)
    from training.dflash2_torch import DFlash2Drafter

    drafter = DFlash2Drafter(state["config"], *borrowed_tables(target))
    drafter.load_state_dict(state["drafter"])
    return drafter.to(device).eval(), target


def token_streams(run_dir: str, smoke: bool, seed: int):
    """(train, heldout) uint16 streams; a smoke run without a tokenized corpus makes random ones."""
    have = all(os.path.exists(os.path.join(run_dir, "tokens", f"{s}.npy")) for s in ("train", "heldout"))
    if smoke and not have:
        rng = np.random.default_rng(seed)
        return rng.integers(3, SMOKE_VOCAB, 40_000).astype(np.uint16), \
            rng.integers(3, SMOKE_VOCAB, 4_000).astype(np.uint16)
    return load_tokens(run_dir, "train"), load_tokens(run_dir, "heldout")


def main(argv=None) -> dict:
    import contextlib

    import torch

    from training.dflash2_torch import param_groups

    args = parse_args(argv)
    seed_everything(args.seed)
    budget = Budget(args.minutes)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" \
        else contextlib.nullcontext
    train, heldout = token_streams(args.run_dir, args.smoke, args.seed)
    ckpt, log = Checkpointer(args.run_dir, STAGE), LossLog(args.run_dir, STAGE)
    state = ckpt.load()
    smoke = {"seed": args.seed, "vocab": VOCAB if int(train.max()) >= SMOKE_VOCAB else SMOKE_VOCAB} \
        if args.smoke else None
    if state is not None and (state["smoke"] is None) != (smoke is None):
        raise SystemExit(f"{ckpt.path} is from a {'smoke' if smoke is None else 'full'} run: use another --run-dir")
    target = frozen_target(args.run_dir, state["smoke"] if state else smoke, device)
    drafter = build_drafter(target, args.smoke).to(device)
    opt = torch.optim.AdamW(param_groups(drafter, WEIGHT_DECAY), lr=args.lr, betas=(0.9, 0.95))
    step, total = 0, args.steps or DEFAULT_STEPS
    if state is not None:
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["opt"])
        step, total = state["step"], args.steps or state["total"]
    print(f"drafter: {drafter.own_parameter_count():,} params (+ borrowed tables), taps {list(drafter.tap_layers)}, "
          f"block {drafter.block_size}, step {step}/{total}, device {device}", flush=True)
    heldout_w = heldout_windows(heldout, args.seq, limit=args.eval_windows)

    def save():
        ckpt.save({"drafter": drafter.state_dict(), "opt": opt.state_dict(), "step": step, "total": total,
                   "config": drafter.config, "smoke": state["smoke"] if state else smoke, "seed": args.seed})

    t0, last, last_step = time.monotonic(), None, None
    t_mark, seen = t0, 0        # the rate is measured per log interval: the first step pays kernel autotuning
    while step < total and not budget.spent():
        rng = np.random.default_rng([args.seed, step])
        ids = torch.from_numpy(random_windows(train, args.batch, args.seq, rng)[:, :-1]).to(device)
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        anchor_pos = sample_anchors(args.batch, args.seq, args.anchors, drafter.block_size, gen).to(device)
        taps, labels = target_pass(target, ids, drafter.tap_layers, autocast)
        anchor_ids, slot_labels = block_labels(ids, labels, anchor_pos, drafter.block_size)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.lr)
        with autocast():
            loss, stats, _, _ = drafter_loss(drafter, taps, anchor_pos, anchor_ids, slot_labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        seen += ids.numel()
        if step % 10 == 0 or step == total:
            rate = seen / (time.monotonic() - t_mark)
            t_mark, seen = time.monotonic(), 0
            log.add(step, train_loss=stats["loss"], train_ce=stats["ce"], train_sel_ce=stats["sel_ce"])
            print(f"step {step}/{total} loss {stats['loss']:.3f} ce {stats['ce']:.3f} sel {stats['sel_ce']:.3f} "
                  f"recall {stats['recall']:.3f} slot1 {stats['slot1_ce']:.3f} | {rate:,.0f} target tok/s "
                  f"({rate * args.anchors / args.seq:,.0f} blocks/s)", flush=True)
            if step == 20:
                per_step = args.batch * args.seq / rate
                print(f"at {per_step:.3f} s/step, {args.minutes:g} min fits ~{int(args.minutes * 60 / per_step)} "
                      f"steps (the schedule is {total}: a later call may pass --steps to resize it)", flush=True)
        if step % args.eval_every == 0 or step == total:
            last, last_step = evaluate(drafter, target, heldout_w, args, device, autocast), step
            log.add(step, heldout_ce=last["ce"], heldout_accept_len=last["accept_len_walk"])
            print(f"heldout @ {step}: accept_len {last['accept_len_walk']:.3f} (argmax rows "
                  f"{last['accept_len_argmax']:.3f}) ce {last['ce']:.3f} recall {last['recall']:.3f}", flush=True)
            save()
    save()
    if last_step != step:   # the budget ran out between evaluations
        last = evaluate(drafter, target, heldout_w, args, device, autocast)
        log.add(step, heldout_ce=last["ce"], heldout_accept_len=last["accept_len_walk"])
    summary = {"step": step, "total": total, "heldout": last, "params": drafter.own_parameter_count(),
               "elapsed_s": time.monotonic() - t0}
    with open(os.path.join(ckpt.dir, "eval.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    log.plot(os.path.join(ckpt.dir, "loss.png"), f"DFlash2 drafter (block {drafter.block_size}) vs the frozen target")
    print(f"heldout_accept_len {last['accept_len_walk']:.3f}  slot_acc {np.round(last['slot_acc_walk'], 3).tolist()}")
    return summary


if __name__ == "__main__":
    main()
