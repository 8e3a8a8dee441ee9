"""Export a trained torch DFlash2 drafter (training/dflash2_torch.py) as memra's drafter directory.

The directory is what memra's `dflash2` source loads against the exported target:
config.json (the drafter's own config dict: nested dflash_config, is_causal false) and
model.safetensors (the state dict under memra's tensor names, bf16 by default). A learned mask
row goes beside them as mask_embedding.npy (float32 [H]), which memra's loader reads from the
drafter directory (the `mask_embedding` draft option overrides it).

    python training/export_drafter.py --run-dir /tmp/memra-train --out <out>/drafter
    export_drafter(drafter, "<out>/drafter")                          # bf16, for shipping
    export_drafter(drafter, tmp, dtype="float32")                     # exact, for the parity test
    generate(model, ids, 64, draft="dflash2", draft_options={"path": "<out>/drafter"})
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memra.drafters.dflash2.config import load_dflash_config
from memra.drafters.dflash2.model import MASK_FILE  # the name memra's loader looks for
from memra.drafters.dflash2.weights import census
from memra.safetensors_io import write_safetensors


def drafter_tensors(drafter) -> dict[str, np.ndarray]:
    """memra name -> float32 array of every saved drafter tensor (the borrowed tables excluded)."""
    return {name: p.detach().float().cpu().numpy() for name, p in drafter.state_dict().items()
            if name != "mask_embedding"}


def export_drafter(drafter, out_dir: str, dtype: str = "bfloat16") -> str:
    """Write config.json, model.safetensors (and mask_embedding.npy when learned); returns out_dir.
    The tensor contract is checked with memra's own census before anything is written."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tensors = drafter_tensors(drafter)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(drafter.config, f, indent=2)
    census(out_dir, load_dflash_config(out_dir), {n: a.shape for n, a in tensors.items()})
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, dtype=dtype, metadata={"format": "pt"})
    mask_path = os.path.join(out_dir, MASK_FILE)
    if drafter.mask_embedding is not None:
        np.save(mask_path, drafter.mask_embedding.detach().float().cpu().numpy())
    elif os.path.exists(mask_path):
        os.remove(mask_path)  # a stale row from an earlier export would be read as this drafter's
    return out_dir


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description="export <run>/drafter/ckpt.pt as memra's drafter directory")
    ap.add_argument("--run-dir", default="/tmp/memra-train")
    ap.add_argument("--out", default=None, help="default: <run>/export/drafter")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args(argv)
    from training.drafter import load_drafter

    drafter, _ = load_drafter(args.run_dir)
    out = export_drafter(drafter, args.out or os.path.join(args.run_dir, "export", "drafter"), args.dtype)
    print(f"drafter -> {out}")
    return out


if __name__ == "__main__":
    main()
