"""Stage 0, the corpus: the `.py` files of the running interpreter's standard library (CPython's
`Lib/`, tests included, no site-packages), recorded file by file so the corpus is reproducible
without being committed.

Split by file: a file is held out when sha256 of its path (relative to `Lib/`) falls in the
lowest 5 % of the hash space, so the split depends on nothing but the path, and no held-out file
is ever trained on. Writes training/manifest/corpus.json (interpreter version, every file's path,
sha256, bytes and split) and <run>/corpus/{train,heldout}.txt (the files, each followed by the
end-of-file marker the tokenizer turns into <|endoftext|>).

    python training/corpus.py --run-dir /tmp/memra-train
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFEST = os.path.join(HERE, "manifest", "corpus.json")
HELDOUT_PERCENT = 5
EOF_MARK = "<|endoftext|>"


def split_of(rel_path: str) -> str:
    h = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def stdlib_files(lib: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(lib):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        out.extend(os.path.relpath(os.path.join(root, f), lib) for f in sorted(files) if f.endswith(".py"))
    return sorted(p.replace(os.sep, "/") for p in out)


def build(run_dir: str) -> dict:
    lib = sysconfig.get_paths()["stdlib"]
    files, texts = [], {"train": [], "heldout": []}
    for rel in stdlib_files(lib):
        raw = open(os.path.join(lib, rel), "rb").read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few test fixtures are deliberately not UTF-8: not Python a user writes
        if EOF_MARK in text:
            continue  # would forge the end-of-file token
        split = split_of(rel)
        files.append({"path": rel, "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw), "split": split})
        texts[split].append(text)
    out = os.path.join(run_dir, "corpus")
    os.makedirs(out, exist_ok=True)
    for split, parts in texts.items():
        with open(os.path.join(out, f"{split}.txt"), "w", encoding="utf-8") as f:
            f.write("".join(t + EOF_MARK for t in parts))
    manifest = {
        "interpreter": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "stdlib": lib,
        "heldout_rule": f"sha256(path)[:8] as big-endian int % 100 < {HELDOUT_PERCENT}",
        "files": files,
    }
    summary = {split: {"files": sum(f["split"] == split for f in files),
                       "bytes": sum(f["bytes"] for f in files if f["split"] == split)} for split in texts}
    manifest["summary"] = summary
    return manifest


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default="/tmp/memra-train")
    ap.add_argument("--manifest", default=MANIFEST)
    args = ap.parse_args()
    manifest = build(args.run_dir)
    os.makedirs(os.path.dirname(args.manifest), exist_ok=True)
    with open(args.manifest, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=0)
    print(json.dumps({"stage": "corpus", "interpreter": manifest["interpreter"], **manifest["summary"]}))


if __name__ == "__main__":
    main()
