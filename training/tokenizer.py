"""Stage 1, the tokenizer: byte-level BPE trained with Hugging Face `tokenizers` on the train split
only, vocab 8192 (research/training.md section 3: 4k and 8k tie in bits/byte, 8k carries more
bytes per accepted token). Specials first: <|endoftext|> = 0 (end of file, the EOS), <|mask|> = 1
(the DFlash block's mask), <|pad|> = 2. Then both splits are encoded to uint16 streams.

    python training/tokenizer.py --run-dir /tmp/memra-train
    -> <run>/tokenizer.json, <run>/tokens/{train,heldout}.npy
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from training.common import TOKENS_DIR, stage_args  # noqa: E402
from training.demo_config import EOS_ID, SPECIALS, VOCAB  # noqa: E402

_CHUNK = 1 << 20  # characters encoded per call: keeps memory flat on a 30 MB file


def train_tokenizer(train_txt: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([train_txt], trainer)
    assert tok.token_to_id(SPECIALS[0]) == EOS_ID, "specials must take the first ids"
    return tok


def encode_file(tok, path: str) -> np.ndarray:
    """The file's ids; a file may hold many documents, each ending in <|endoftext|>."""
    text = open(path, encoding="utf-8").read()
    end = SPECIALS[0]
    ids: list[int] = []
    start = 0
    while start < len(text):
        stop = text.find(end, start + _CHUNK)  # cut right after a marker, never inside a token
        stop = len(text) if stop < 0 else stop + len(end)
        ids.extend(tok.encode(text[start:stop]).ids)
        start = stop
    return np.asarray(ids, dtype=np.uint16)


def main() -> None:
    args = stage_args(__doc__.split("\n")[0]).parse_args()
    corpus = os.path.join(args.run_dir, "corpus")
    tok = train_tokenizer(os.path.join(corpus, "train.txt"))
    tok.save(os.path.join(args.run_dir, "tokenizer.json"))
    os.makedirs(os.path.join(args.run_dir, TOKENS_DIR), exist_ok=True)
    out = {"stage": "tokenizer", "vocab": tok.get_vocab_size()}
    for split in ("train", "heldout"):
        ids = encode_file(tok, os.path.join(corpus, f"{split}.txt"))
        np.save(os.path.join(args.run_dir, TOKENS_DIR, f"{split}.npy"), ids)
        size = os.path.getsize(os.path.join(corpus, f"{split}.txt"))
        out[split] = {"tokens": int(ids.size), "eos": int((ids == EOS_ID).sum()),
                      "bytes_per_token": round(size / ids.size, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
