"""Token ids where they enter memra: one check, one wording, at every door.

    ids = check_token_ids(prompt_ids, model.cfg.vocab_size, "prompt token id")   # -> list[int]

generate (prompt and EOS ids, through memra.arguments, which first refuses what is not a sequence),
SpecSession (prompt, and each proposal a draft source makes), the model's prime / decode_step /
verify_rows and the CLI all call it, so a bad id is refused by the argument's name before anything
runs. Ints and numpy integers pass; floats, bools, strings and None are refused even where int()
would take them (2.7 is not a token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from memra.errors import InputError

TOKENIZER_FIX = "check the tokenizer (or the ids) belong to this checkpoint"


def check_token_ids(ids, vocab: int, what: str = "token id", fix: str = TOKENIZER_FIX,
                    allow_empty: bool = False) -> list[int]:
    """`ids` (a 1-D sequence or array) as a list of ints in 0..vocab-1, or an InputError that
    names `what` (the argument, singular: "prompt token id", "EOS id"), the bound and `fix`."""
    if isinstance(ids, Iterator):  # a generator: read it once
        ids = list(ids)
    seq = ids if isinstance(ids, np.ndarray) else np.asarray(ids, dtype=object)
    if seq.ndim == 0:  # a lone id (or a string): a sequence of one, judged below
        seq = seq.reshape(1)
    if seq.ndim != 1 or (seq.size == 0 and not allow_empty):
        got = "an empty one" if seq.size == 0 else f"shape {seq.shape}"
        raise InputError(f"{what}s must be a {'' if allow_empty else 'non-empty '}1-D sequence of integers, "
                         f"got {got}")
    out = []
    for tok in seq.tolist():
        if isinstance(tok, (bool, np.bool_)) or not isinstance(tok, (int, np.integer)):
            raise InputError(f"{what}s must be integers (ints or numpy integers), got {tok!r} "
                             f"({type(tok).__name__})")
        tok = int(tok)
        if not 0 <= tok < vocab:
            raise InputError(f"{what} {tok} is outside the vocab 0..{vocab - 1}: {fix}")
        out.append(tok)
    return out


@dataclass(frozen=True)
class NextToken:
    """A greedy step's token before the host has read it (Glm5Model.decode_next): `ids` [1],
    where the backend keeps it (the next decode_next's input), and `wait()` -> the int."""
    ids: object
    read: Callable

    def wait(self) -> int:
        return int(self.read()[0])


def host_id(token) -> int:
    """An int token as it is, a NextToken's once the host has it."""
    return token.wait() if isinstance(token, NextToken) else token
