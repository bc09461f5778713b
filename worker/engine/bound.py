"""The longest prompt text worth tokenizing, known before tokenizing it.

A token stands for at most `token_bytes` bytes of text (the longest token of the
vocabulary, decoded alone), so a text of more than max_context * token_bytes bytes cannot
fit the context whatever it tokenizes to. Such a prompt fails its item at once, instead of
holding the engine's loop for minutes (a 30 MB prompt took 130-190 s to tokenize). Decoded
alone, a byte-fallback token reads U+FFFD (3 bytes) for its 1 byte: the bound only grows,
and never refuses a prompt that fits.
"""
from __future__ import annotations


def longest_token_bytes(tokenizer) -> int:
    vocab = len(tokenizer)
    pieces = tokenizer.batch_decode([[i] for i in range(vocab)])
    return max(1, max(len(p.encode("utf-8", "surrogatepass")) for p in pieces))


class TextBound:
    def __init__(self, tokenizer, max_context: int):
        self.max_context = max_context
        self.token_bytes = longest_token_bytes(tokenizer)
        self.max_bytes = max_context * self.token_bytes

    def check(self, text: str) -> str | None:
        """An error for a text that cannot fit the context, else None (cheap: its length)."""
        if len(text) * 4 <= self.max_bytes:  # a character is at most 4 bytes of UTF-8
            return None
        size = len(text.encode("utf-8", "surrogatepass"))
        if size <= self.max_bytes:
            return None
        return (f"prompt is {size} bytes of text: more than the model's context of {self.max_context} "
                f"tokens can hold ({self.max_bytes} bytes at {self.token_bytes} bytes a token at most); "
                "it was not tokenized")
