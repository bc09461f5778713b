"""Chats (OpenAI-style messages) -> prompt token ids and the images placed in them.

A message's content is a string or a list of parts: {"type": "text", "text": ...} and
{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} (or a file:// or
http(s) URL the operator allows: image_urls.py). The model's chat template renders image parts
as {"type": "image"} (the Hugging Face convention), putting one image token each; that token
is then expanded to the image's token count, every position holding the image's pad id
(images.py), which keys the radix cache by the image's content.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from . import tools
from .bound import TextBound
from .image_urls import ImageError, ImageSources
from .images import (ClipProcessor, DecodeBudget, Image, ImageSpan, Qwen2VLProcessor, decode_cost, load_image,
                     open_image)
from .sampling_params import SamplingParams


class PastContext(ImageError):
    """A chat whose images alone fill the context: they are not decoded."""


@dataclass(frozen=True, slots=True)
class VisionInput:
    """What a vision model needs from its prompts."""
    processor: ClipProcessor | Qwen2VLProcessor
    image_token_id: int
    vocab_size: int


class ChatEncoder:
    def __init__(self, tokenizer, vision: VisionInput | None, sources: ImageSources = ImageSources(),
                 bound: TextBound | None = None, budget: DecodeBudget | None = None):
        self.tokenizer = tokenizer
        self.vision = vision
        self.sources = sources  # which image URLs are read, and their limits
        self.bound = bound  # a rendered chat longer than the context can hold is not tokenized
        self.budget = budget or DecodeBudget(2 << 30)  # shared by every thread that decodes
        self.tool_format = tools.format_of(getattr(tokenizer, "chat_template", None))

    @property
    def schemes(self) -> list[str]:
        """The image URL schemes taken: [] for a text model."""
        return self.sources.schemes if self.vision is not None else []

    def image_urls(self, chat) -> list[str]:
        """The image URLs of a chat item for this (vision) model; [] for anything else,
        which encode() takes (or fails) at once."""
        if self.vision is None or not isinstance(chat, list):
            return []
        try:
            return _parse(chat)[1]
        except ValueError:
            return []

    def load(self, chats: list, max_tokens: int | None = None) -> dict[str, Image | ImageError]:
        """The images of these chats, each distinct URL read (concurrently, for downloads),
        decoded and preprocessed once. The headers come first: the images of a chat whose
        images alone take max_tokens or more are not decoded (it fails: past the context),
        so no request's images can take more memory than a context's worth. Safe to run
        off the engine's thread."""
        if self.vision is None:
            return {}
        per_chat = []
        for chat in chats:
            try:
                per_chat.append(_parse(chat)[1])
            except ValueError:
                pass  # encode() fails its item with the reason
        v, opened = self.vision, {}
        for url, raw in self.sources.read_all([u for urls in per_chat for u in urls]).items():
            opened[url] = raw  # an ImageError already, or its (header, tokens) below
            if not isinstance(raw, ImageError):
                try:
                    img = open_image(raw)
                    opened[url] = (img, v.processor.tokens_of(*img.size))
                except ImageError as e:
                    opened[url] = e
        needed, over = set(), {}
        for urls in per_chat:
            tokens = sum(opened[u][1] for u in urls if not isinstance(opened[u], ImageError))
            if max_tokens is not None and tokens >= max_tokens:
                over.update((u, tokens) for u in urls)
            else:
                needed.update(urls)
        out: dict[str, Image | ImageError] = {}
        for url, o in opened.items():
            if isinstance(o, ImageError):
                out[url] = o
            elif url not in needed:
                out[url] = PastContext(f"its images take {over[url]} tokens; the model's context "
                                       f"is {max_tokens} (they were not decoded)")
            else:
                try:
                    with self.budget.hold(decode_cost(o[0])):
                        out[url] = load_image(o[0], v.processor, v.vocab_size)
                except ImageError as e:
                    out[url] = e
                finally:
                    o[0].close()
        return out

    def encode(self, chat: list[dict], images: dict[str, Image | ImageError] | None = None,
               params: SamplingParams | None = None) -> tuple[list[int], list[ImageSpan]]:
        """Token ids (images expanded) and the image spans; ValueError for a bad chat or
        image (its item fails alone). `images`: the chat's images from load(), if read
        already. `params`' tools (tools.Tool) are rendered by the template, as HF's `tools=`
        takes them, or by tools.generic_chat where the template has no tool format."""
        messages, urls = _parse(chat)
        if urls and self.vision is None:
            raise ValueError("this model does not take images")
        p, extra = params or SamplingParams(), {}
        if self.tool_format == "generic":
            messages = tools.generic_chat(messages, p.tools, p.effective_tool_choice, p.parallel_tool_calls)
        elif p.tools:
            extra = {"tools": [t.model_dump(exclude_none=True) for t in p.tools]}
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True, **extra)
        except Exception as e:
            raise ValueError(f"chat template failed: {e}") from None
        if self.bound is not None and (error := self.bound.check(text)) is not None:
            raise ValueError(error)
        # The template already holds the special tokens (BOS) it wants.
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not urls:
            return ids, []
        marks = [i for i, t in enumerate(ids) if t == self.vision.image_token_id]
        if len(marks) != len(urls):
            raise ValueError(f"the chat template placed {len(marks)} image tokens for "
                             f"{len(urls)} images")
        if images is None or any(u not in images for u in urls):
            images = self.load([chat])
        out, spans, prev = [], [], 0
        for k, (mark, url) in enumerate(zip(marks, urls)):
            image = images[url]
            if isinstance(image, PastContext):  # the chat's, not this image's
                raise ValueError(str(image))
            if isinstance(image, ImageError):
                raise ValueError(f"image {k}: {image}")
            out += ids[prev:mark]
            spans.append(ImageSpan(len(out), image))
            out += [image.pad] * image.tokens
            prev = mark + 1
        return out + ids[prev:], spans


def _parse(chat: list[dict]) -> tuple[list[dict], list[str]]:
    """The messages as the chat template takes them (image parts as {"type": "image"}) and
    the image URLs in order; ValueError for a chat that is not one."""
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
                    if not isinstance(part.get("text"), str):
                        raise ValueError(f"message {i}: a text part needs a text string")
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if not isinstance(url, str) or not url:
                        raise ValueError(f"message {i}: an image_url part needs a URL string")
                    urls.append(url)
                    parts.append({"type": "image"})
                else:
                    raise ValueError(f"message {i}: unknown content part type {kind!r}")
            if all(p["type"] == "text" for p in parts):
                # Text only: one string, which every chat template takes (as OpenAI joins).
                m = {**m, "content": "".join(p["text"] for p in parts)}
            else:
                m = {**m, "content": parts}
        if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
            m = {**m, "tool_calls": [_template_call(i, c) for c in m["tool_calls"]]}
        if isinstance(m, dict) and m.get("content") is None:
            # An assistant's tool calls alone (content null or absent): templates read a string.
            m = {**m, "content": ""}
        messages.append(m)
    return messages, urls


def _template_call(i: int, call) -> dict:
    """An assistant's earlier tool call as templates take it: OpenAI's
    {id, type, function: {name, arguments (JSON text)}} with the arguments an object (the
    templates write them with `tojson`)."""
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("arguments"), str):
        raise ValueError(f"message {i}: a tool call is {{id, type: function, function: {{name, arguments}}}}")
    try:
        args = json.loads(f["arguments"])
    except ValueError:
        raise ValueError(f"message {i}: a tool call's arguments are not JSON") from None
    return {**call, "function": {**f, "arguments": args}}
