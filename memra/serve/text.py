"""A request's generated text: token ids in, releasable text out, stop strings applied on the text.

    out = TextOutput(tokenizer, prompt_ids, stops=("\\n\\n",))
    for token in new_ids:
        if out.push(token):          # a stop string completed: generation ends here
            break
    delta = out.release(final=False)  # text that can no longer change or turn into a stop string

Ids are detokenized one at a time through `memra.tokenizer.TextStream`, so the text is a
function of the token ids alone: however a request's tokens arrive (bursts of any size,
streamed or not), its text is the same. The text of an EOS token is not part of the output.
While streaming, a tail that is still a prefix of some stop string is held back until the next
token settles it; `release(final=True)` lets it go once no more tokens come.
"""

from __future__ import annotations

from memra.tokenizer import TextStream


class TextOutput:
    def __init__(self, tokenizer, prompt_ids, stops=()):
        self.stream = TextStream(tokenizer.decode, prompt_ids) if tokenizer is not None else None
        self.stops = tuple(s for s in stops if s)
        self.longest = max(map(len, self.stops), default=0)
        self.text = ""            # everything decoded so far, cut at a stop string once one is found
        self.sent = 0             # how much of it release() has handed out
        self.stopped = False

    def push(self, token: int) -> bool:
        """Add one generated (non-EOS) token; True when a stop string has just completed."""
        if self.stream is None or self.stopped:
            return self.stopped
        return self._append(self.stream.push([token]))

    def finish(self) -> None:
        """No more tokens: whatever the detokenizer held back (a cut character) becomes text."""
        if self.stream is not None and not self.stopped:
            self._append(self.stream.finish())

    def release(self, final: bool) -> str:
        """The text not yet handed out that can no longer change (all of it once final or stopped)."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def _append(self, piece: str) -> bool:
        if not piece:
            return False
        start = max(0, len(self.text) - self.longest + 1)  # a stop may straddle the old tail
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def _held(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        for n in range(min(self.longest - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
