"""Items -> token ids: texts in one tokenizer call, chats through their template (chat.py),
token-id items as given; a text past what the context can hold is not tokenized
(bound.py). Each item's error is its own.

The engine's thread has one encoder (chats whose images were loaded), the text intake's
thread another (`copy`): a tokenizer is not used by two threads at once.
"""
from __future__ import annotations

import copy

from .chat import ChatEncoder
from .images import ImageSpan
from .sampling_params import SamplingParams


class Encoder:
    def __init__(self, tokenizer, chats: ChatEncoder):
        self.tokenizer = tokenizer
        self.chats = chats

    def copy(self) -> "Encoder":
        """The same encoder on its own copy of the tokenizer, for another thread."""
        tokenizer = copy.deepcopy(self.tokenizer)
        c = self.chats
        return Encoder(tokenizer, ChatEncoder(tokenizer, c.vision, c.sources, c.bound, c.budget))

    def tokenize(self, prompts: list) -> list[list[int]]:
        """Text items in one tokenizer call; token-id items as given."""
        texts = [p for p in prompts if isinstance(p, str)]
        if len(texts) == len(prompts):
            return self.tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else []
        return [self.tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str)
                else list(p) for p in prompts]

    def _tokenize_each(self, prompts: list) -> list[tuple[list[int], str | None]]:
        """(ids, error) per item: one tokenizer call, or, if it raises, one per item, so a
        text the tokenizer cannot take fails alone."""
        try:
            return [(ids, None) for ids in self.tokenize(prompts)]
        except Exception:
            out = []
            for p in prompts:
                try:
                    out.append((self.tokenize([p])[0], None))
                except Exception as e:
                    out.append(([], f"the tokenizer cannot take this text: {type(e).__name__}: {e}"))
            return out

    def encode(self, items: list[tuple]) -> list[tuple[list[int], list[ImageSpan], str | None]]:
        """(ids, image spans, error) per item (index, prompt or None, input_ids or None, its
        SamplingParams or None: a chat's tools)."""
        out: list = [None] * len(items)
        plain = []
        bound = self.chats.bound
        for i, (_, prompt, _, _) in enumerate(items):
            if isinstance(prompt, str) and bound and (error := bound.check(prompt)) is not None:
                out[i] = ([], [], error)
            elif not isinstance(prompt, list):
                plain.append(i)
        for i, (ids, error) in zip(plain, self._tokenize_each([items[i][1] if items[i][1] is not None
                                                               else items[i][2] for i in plain])):
            out[i] = (ids, [], error)
        for i, (index, chat, _, params) in enumerate(items):
            if isinstance(chat, list):
                out[i] = self.encode_chat(index, chat, params=params)
            elif params is not None and params.tools:
                out[i] = ([], [], "tools: only for chat items (messages)")
        return out

    def encode_chat(self, index: int, chat: list, images: dict | Exception | None = None,
                    params: SamplingParams | None = None) -> tuple:
        if isinstance(images, Exception):  # loading them failed as a whole (intake.py)
            why = f"{type(images).__name__}: {images}"
            return [], [], f"messages[{index}]: its images could not be loaded ({why})"
        try:
            return (*self.chats.encode(chat, images, params), None)
        except ValueError as e:
            return [], [], f"messages[{index}]: {e}"
        except Exception as e:  # e.g. the tokenizer refusing a text: this chat fails alone
            return [], [], f"messages[{index}]: cannot be encoded: {type(e).__name__}: {e}"
