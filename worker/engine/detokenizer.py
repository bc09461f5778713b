"""Incremental detokenization with stop strings, one Detokenizer per request.

Decoding uses the prefix-offset / read-offset window of vLLM and SGLang: each step decodes
only the tokens since the last clean boundary (plus a few before it, so tokenizers that
drop a leading space see the same context), and holds back output while the text ends in
U+FFFD, i.e. a multi-byte character is still split across tokens.

Stop strings are cut with the stop string itself left out (SGLang's default). Text that
could still become a stop string is held back until it either completes one or cannot.
"""
from __future__ import annotations

# Tokens of context decoded before the read offset (vLLM uses the same number).
_CONTEXT = 5


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 prompt_ids: list[int] | None = None):
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError("stop: must be non-empty strings")
        self.tokenizer = tokenizer
        # The Rust tokenizer decodes the same text without transformers' per-call Python
        # layers, when transformers has no clean-up step of its own to apply.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast = (backend.decode if backend is not None
                      and not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None)
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        # Prompt tokens only give the first output tokens their left context.
        self._ids = list(prompt_ids or [])
        self._read = len(self._ids)
        self._prefix = max(self._read - _CONTEXT, 0)
        self._text = ""  # decoded text (cut at the stop string once matched)
        self._sent = 0  # chars of _text already returned
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        return self._text

    @property
    def unsent(self) -> str:
        """Text made but not returned yet: held back, or made by a push that then failed."""
        return self._text[self._sent:]

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Add tokens; return (text safe to emit now, matched stop string or None)."""
        if self.stopped:
            raise RuntimeError("push after a stop string matched")
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return "", None  # nothing new, or a character is still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        self._append(new_text[len(prefix_text):])

        if self.stopped:
            safe = len(self._text)
        else:
            safe = len(self._text) - self._stop_prefix_len()
        delta = self._text[self._sent:safe] if safe > self._sent else ""
        self._sent = max(self._sent, safe)
        return delta, self.matched

    def flush(self) -> str:
        """The request ended for another reason: release everything held back, including
        an incomplete character (as U+FFFD, like a full decode would give)."""
        if not self.stopped and self._read < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix:self._read])
            new_text = self._decode(self._ids[self._prefix:])
            self._text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
        delta = self._text[self._sent:]
        self._sent = len(self._text)
        return delta

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _append(self, new: str) -> None:
        """Append text and cut at the first stop string to complete (earliest end, then the
        longest at that end), as token-by-token generation would have met it."""
        start = len(self._text)
        self._text += new
        best = None  # (end, -len, stop)
        for s in self.stop:
            i = self._text.find(s, max(0, start - len(s) + 1))
            if i >= 0:
                cand = (i + len(s), -len(s), s)
                best = cand if best is None or cand < best else best
        if best is not None:
            end, neg_len, s = best
            self._text = self._text[: end + neg_len]
            self.matched = s

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._text)), hold, -1):
                if self._text.endswith(s[:k]):
                    hold = k
                    break
        return hold
