"""Chats (OpenAI-style messages) -> prompt token ids and the images placed in them.

A message's content is a string or a list of parts: {"type": "text", "text": ...} and
{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}. The model's chat
template renders image parts as {"type": "image"} (the Hugging Face convention), putting one
image token each; that token is then expanded to the image's feature count, every position
holding the image's pad id (images.py), which keys the radix cache by the image's content.
"""
from __future__ import annotations

from dataclasses import dataclass

from .images import Image, ImageError, ImageProcessor, ImageSpan, load_image


@dataclass(frozen=True, slots=True)
class VisionInput:
    """What a vision model needs from its prompts."""
    processor: ImageProcessor
    image_token_id: int
    tokens_per_image: int
    vocab_size: int


class ChatEncoder:
    def __init__(self, tokenizer, vision: VisionInput | None):
        self.tokenizer = tokenizer
        self.vision = vision

    def encode(self, chat: list[dict]) -> tuple[list[int], list[ImageSpan]]:
        """Token ids (images expanded) and the image spans; ValueError for a bad chat or
        image (its item fails alone)."""
        if not isinstance(chat, list) or not chat:
            raise ValueError("a chat is a non-empty list of messages")
        messages, urls = [], []
        for i, m in enumerate(chat):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                parts = []
                for part in content:
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "text":
                        parts.append({"type": "text", "text": part.get("text", "")})
                    elif kind == "image_url":
                        url = part.get("image_url")
                        urls.append(url.get("url", "") if isinstance(url, dict) else url)
                        parts.append({"type": "image"})
                    else:
                        raise ValueError(f"message {i}: unknown content part type {kind!r}")
                if all(p["type"] == "text" for p in parts):
                    # Text only: one string, which every chat template takes (as OpenAI joins).
                    m = {**m, "content": "".join(p["text"] for p in parts)}
                else:
                    m = {**m, "content": parts}
            messages.append(m)
        if urls and self.vision is None:
            raise ValueError("this model does not take images")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:
            raise ValueError(f"chat template failed: {e}") from None
        # The template already holds the special tokens (BOS) it wants.
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not urls:
            return ids, []
        v = self.vision
        marks = [i for i, t in enumerate(ids) if t == v.image_token_id]
        if len(marks) != len(urls):
            raise ValueError(f"the chat template placed {len(marks)} image tokens for "
                             f"{len(urls)} images")
        images: list[Image] = []
        for k, url in enumerate(urls):
            try:
                images.append(load_image(url, v.processor, v.vocab_size))
            except ImageError as e:
                raise ValueError(f"image {k}: {e}") from None
        out, spans, prev = [], [], 0
        for mark, image in zip(marks, images):
            out += ids[prev:mark]
            spans.append(ImageSpan(len(out), v.tokens_per_image, image))
            out += [image.pad] * v.tokens_per_image
            prev = mark + 1
        return out + ids[prev:], spans
