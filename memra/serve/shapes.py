"""OpenAI response bodies: completions and chat, whole or as stream chunks, with logprobs.

    shape = Shape(request, engine)
    shape.whole(text, tokens, logprobs, finish_reason, usage)   # the non-streamed body
    shape.chunk(update, first=True)                             # one SSE chunk (None: nothing to say)
    shape.usage_chunk(usage)                                    # stream_options.include_usage's last chunk

Logprobs are the target's raw distribution (log-softmax of its logits, before temperature and
the filters) at each generated token, whatever the draft source: completions get OpenAI's
legacy {tokens, token_logprobs, top_logprobs, text_offset}, chat gets {content: [...]}.
`usage.speculative` carries the request's acceptance (vLLM's counter names); it is null for
plain decoding. `token_ids` joins each choice when the request asked for return_token_ids.
"""

from __future__ import annotations

import time
import uuid


class Shape:
    def __init__(self, request, engine):
        self.request, self.chat = request, request.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = engine.name
        self.tokenizer = engine.tokenizer
        self.offset = 0      # completions' text_offset runs across chunks

    def whole(self, text: str, tokens: list[int], logprobs, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=self._logprobs(logprobs), finish_reason=finish_reason)
        if self.request.return_token_ids:
            choice["token_ids"] = list(tokens)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": usage}

    def chunk(self, update, first: bool) -> dict | None:
        if not (update.text or update.tokens or update.finish_reason or first):
            return None
        if self.chat:
            delta = {"role": "assistant"} if first else {}
            if update.text or first:
                delta["content"] = update.text
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": update.text}
        choice.update(logprobs=self._logprobs(update.logprobs), finish_reason=update.finish_reason)
        if self.request.return_token_ids:
            choice["token_ids"] = list(update.tokens)
        return self._chunk([choice])

    def usage_chunk(self, usage: dict) -> dict:
        body = self._chunk([])
        body["usage"] = usage
        return body

    def _chunk(self, choices: list) -> dict:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.request.include_usage:
            body["usage"] = None
        return body

    def _logprobs(self, entries):
        if entries is None:
            return None
        if self.chat:
            return {"content": [dict(self._token(t), logprob=lp, top_logprobs=[dict(self._token(i), logprob=v)
                                                                                for i, v in top])
                                for t, lp, top in entries]}
        texts = [self._text(t) for t, _, _ in entries]
        offsets = []
        for s in texts:
            offsets.append(self.offset)
            self.offset += len(s)
        spelled = lambda t: _spelling(self._bytes(t))  # noqa: E731
        return {"tokens": [spelled(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{spelled(i): v for i, v in top} for _, _, top in entries],
                "text_offset": offsets}

    def _token(self, token: int) -> dict:
        raw = self._bytes(token)
        return {"token": _spelling(raw), "bytes": list(raw)}

    def _bytes(self, token: int) -> bytes:
        return self.tokenizer.token_bytes(token) if self.tokenizer is not None else self._text(token).encode()

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else f"<{token}>"


def _spelling(raw: bytes) -> str:
    """A token (its bytes) as logprobs name it: its text, or for a piece that is not whole UTF-8
    characters (byte-level BPE) "bytes:" and its bytes as \\xNN escapes, as OpenAI spells those, so
    two such pieces never share one top_logprobs key."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
