"""Image inputs: an image's bytes (image_urls.py reads them) -> what the vision tower takes,
how many prompt tokens the image becomes, and the id that keys those tokens in the radix cache.

Preprocessing is the model's image processor's, read from the model folder's
preprocessor_config.json (or transformers 5's processor_config.json), with PIL and torch
only, equal to transformers' own (tests/test_multimodal.py):
- CLIP (LLaVA): resize the shortest edge, center crop, rescale, normalize: one [3, H, W].
- Qwen2-VL: resize both sides to multiples of patch * merge with the area within
  [min_pixels, max_pixels], rescale, normalize, then cut into patches, each repeated over
  `temporal_patch_size` frames (kept once here: the model's patch embedding repeats it),
  the merge x merge patches of one token next to each other.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .image_urls import ImageError
from .models.config import Qwen2VLVisionConfig, VisionConfig

# Larger images are refused before decoding (PIL reads the size from the header): 8192 x 8192
# is far above any CLIP input and keeps one decode under ~200 MiB of RGB.
MAX_IMAGE_PIXELS = 8192 * 8192
FORMATS = ("PNG", "JPEG", "WEBP")
PAD_BITS = 48  # pad ids: vocab_size + a 48-bit content hash, so never a real token id
HASH_ROWS = 256  # rows of pixels hashed at a time: no copy of the whole image


def decode_cost(img) -> int:
    """Bytes decoding an opened image takes at its peak, from its header: PIL holds 4 bytes
    a pixel (RGB is padded) and a mode other than RGB is converted into a second copy."""
    w, h = img.size
    return w * h * 4 * (1 if img.mode == "RGB" else 2)


class DecodeBudget:
    """Bytes of pixels being decoded at once across the threads that load images
    (`--image-memory`): an image waits until its decoding fits beside the others', and one
    that could never fit fails alone, before it is decoded."""

    def __init__(self, total: int):
        self.total, self.used = total, 0
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, n: int):
        if n > self.total:
            raise ImageError(f"decoding it would take {n} bytes, over the worker's --image-memory "
                             f"of {self.total}")
        with self._cond:
            self._cond.wait_for(lambda: self.used + n <= self.total)
            self.used += n
        try:
            yield
        finally:
            with self._cond:
                self.used -= n
                self._cond.notify_all()


@dataclass(frozen=True, slots=True, eq=False)
class Image:
    """One preprocessed image of a prompt."""
    # Float32, normalized: CLIP's [3, H, W]; Qwen2-VL's [patches, 3 * patch**2], one frame.
    pixels: torch.Tensor
    pad: int  # the id its tokens have in the prompt: vocab_size + hash of its content
    tokens: int  # how many prompt tokens it becomes
    grid: tuple[int, int, int] | None = None  # M-RoPE (Qwen2-VL): its tokens as (t, h, w)


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Where an image's tokens sit in a prompt: positions [start, start + length)."""
    start: int
    image: Image

    @property
    def length(self) -> int:
        return self.image.tokens

    @property
    def shift(self) -> int:
        """How far M-RoPE puts the positions after this image behind their index: its t*h*w
        tokens advance the position by only max(t, h, w). 0 without M-RoPE."""
        grid = self.image.grid
        return 0 if grid is None else max(grid) - self.length


def open_image(raw: bytes):
    """An encoded PNG, JPEG or WebP image -> a PIL image whose header is read (its size), its
    pixels not decoded yet; or ImageError."""
    from PIL import Image as PILImage

    try:
        img = PILImage.open(io.BytesIO(raw), formats=FORMATS)
    except Exception as e:
        raise ImageError(f"not a decodable PNG, JPEG or WebP image ({type(e).__name__})") from None
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS:
        raise ImageError(f"image is {w}x{h} pixels; at most {MAX_IMAGE_PIXELS} are allowed")
    return img


def decode_image(img):
    """An opened image (open_image) -> its RGB pixels (a decoded PIL image), or ImageError.
    The opened image's own decoded pixels are freed once converted."""
    try:
        if img.mode == "RGB":
            img.load()
            return img
        rgb = img.convert("RGB")
        img.close()
        return rgb
    except Exception as e:
        raise ImageError(f"the image data is corrupt ({type(e).__name__}: {e})") from None


@dataclass(frozen=True, slots=True)
class Normalize:
    """The steps every processor shares: resize (PIL), rescale, normalize."""
    resample: int  # PIL's filter number (3: bicubic)
    rescale: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_dict(cls, raw: dict) -> Normalize:
        return cls(raw.get("resample", 3), raw.get("rescale_factor", 1 / 255),
                   tuple(raw["image_mean"]), tuple(raw["image_std"]))

    def __call__(self, img, size: tuple[int, int]) -> torch.Tensor:
        """An RGB PIL image resized to size (width, height) -> [3, height, width] float32."""
        img = img.resize(size, resample=self.resample)
        x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size[1], size[0], 3)
        # Rescale in float64 then cast, as transformers does.
        x = (x.permute(2, 0, 1).double() * self.rescale).float()
        mean = torch.tensor(self.mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.std, dtype=torch.float32)[:, None, None]
        return (x - mean) / std


@dataclass(frozen=True, slots=True)
class ClipProcessor:
    shortest_edge: int
    crop: tuple[int, int]  # (height, width)
    tokens: int  # per image: the vision tower's (config.py)
    norm: Normalize

    @classmethod
    def from_dict(cls, raw: dict, path: str, tokens: int) -> ClipProcessor:
        size, crop = raw.get("size", {}), raw.get("crop_size", {})
        flags = ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb")
        if not all(raw.get(k, True) for k in flags) or "shortest_edge" not in size:
            raise ValueError(f"{path}: only the CLIP image processor (resize the shortest edge, "
                             "center crop, rescale, normalize) is supported")
        crop = (crop["height"], crop["width"]) if isinstance(crop, dict) else (crop, crop)
        if size["shortest_edge"] < max(crop):
            raise ValueError(f"{path}: crop_size {crop} larger than the resized image "
                             f"(shortest edge {size['shortest_edge']}) is not supported")
        return cls(size["shortest_edge"], crop, tokens, Normalize.from_dict(raw))

    def tokens_of(self, w: int, h: int) -> int:
        """The tokens an image of w x h pixels becomes (known before decoding it)."""
        return self.tokens

    def __call__(self, img) -> tuple[torch.Tensor, int, None]:
        """An RGB PIL image -> ([3, crop_h, crop_w] float32, tokens, no grid)."""
        w, h = img.size
        # transformers' shortest-edge rule: the long edge truncated, not rounded.
        short, long = (w, h) if w <= h else (h, w)
        long = int(self.shortest_edge * long / short)
        x = self.norm(img, (self.shortest_edge, long) if w <= h else (long, self.shortest_edge))
        ch, cw = self.crop
        top, left = (x.shape[1] - ch) // 2, (x.shape[2] - cw) // 2
        return x[:, top:top + ch, left:left + cw], self.tokens, None


@dataclass(frozen=True, slots=True)
class Qwen2VLProcessor:
    patch: int
    merge: int  # merge x merge patches make one token
    min_pixels: int
    max_pixels: int
    norm: Normalize

    @classmethod
    def from_dict(cls, raw: dict, path: str, v: Qwen2VLVisionConfig) -> Qwen2VLProcessor:
        if not all(raw.get(k, True) for k in ("do_resize", "do_rescale", "do_normalize",
                                               "do_convert_rgb")):
            raise ValueError(f"{path}: an image processor that skips resizing, rescaling or "
                             "normalizing is not supported")
        size = raw.get("size") or {}
        sizes = (raw.get("patch_size", v.patch_size), raw.get("merge_size", v.merge_size),
                 raw.get("temporal_patch_size", v.temporal_patch_size))
        if sizes != (v.patch_size, v.merge_size, v.temporal_patch_size):
            raise ValueError(f"{path}: patch_size, merge_size, temporal_patch_size {sizes} "
                             "differ from the model's vision_config")
        # Top-level min/max_pixels override `size`, as in transformers.
        return cls(*sizes[:2], raw.get("min_pixels", size.get("shortest_edge", 56 * 56)),
                   raw.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280)),
                   Normalize.from_dict(raw))

    def size(self, w: int, h: int) -> tuple[int, int]:
        """transformers' smart_resize: each side rounded to a multiple of patch * merge, then
        scaled (aspect ratio kept) until the area is within [min_pixels, max_pixels]."""
        f = self.patch * self.merge
        if max(w, h) / min(w, h) > 200:
            raise ImageError(f"image is {w}x{h} pixels; an aspect ratio over 200 is not supported")
        rh, rw = round(h / f) * f, round(w / f) * f
        if rh * rw > self.max_pixels:
            beta = math.sqrt(h * w / self.max_pixels)
            rh, rw = max(f, math.floor(h / beta / f) * f), max(f, math.floor(w / beta / f) * f)
        elif rh * rw < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (h * w))
            rh, rw = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
        return rw, rh

    def tokens_of(self, w: int, h: int) -> int:
        """The tokens an image of w x h pixels becomes (known before decoding it)."""
        w, h = self.size(w, h)
        return (w // (self.patch * self.merge)) * (h // (self.patch * self.merge))

    def __call__(self, img) -> tuple[torch.Tensor, int, tuple[int, int, int]]:
        """An RGB PIL image -> (patches [tokens * merge**2, 3 * p * p]: transformers' with its
        `frames` identical frames kept once, tokens, grid)."""
        w, h = self.size(*img.size)
        p, m = self.patch, self.merge
        gh, gw = h // (p * m), w // (p * m)  # the token grid
        x = self.norm(img, (w, h)).view(3, gh, m, p, gw, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        return x.reshape(gh * gw * m * m, -1), gh * gw, (1, gh, gw)


def image_processor(path: str, vision: VisionConfig | Qwen2VLVisionConfig
                    ) -> ClipProcessor | Qwen2VLProcessor:
    """The image processor of the model folder `path`, for its vision tower `vision`: the
    tower decides the processor's kind (its config must describe one of that kind)."""
    pre, proc = (os.path.join(path, f)
                 for f in ("preprocessor_config.json", "processor_config.json"))
    if os.path.isfile(pre):
        with open(pre) as f:
            raw = json.load(f)
    elif os.path.isfile(proc):
        with open(proc) as f:
            raw = json.load(f).get("image_processor", {})
    else:
        raise FileNotFoundError(f"no image processor config in {path}: expected {pre}")
    if isinstance(vision, Qwen2VLVisionConfig):
        return Qwen2VLProcessor.from_dict(raw, path, vision)
    return ClipProcessor.from_dict(raw, path, vision.tokens_per_image)


def load_image(img, processor: ClipProcessor | Qwen2VLProcessor, vocab_size: int) -> Image:
    """Decode and preprocess one opened image (open_image); its pad id hashes its decoded
    pixels and size, so the same pixels in another (lossless) container share their cached
    prefix."""
    img = decode_image(img)
    try:
        # Full-width strips, so the digest is that of the whole image's bytes.
        h = hashlib.blake2b(digest_size=8, person=f"{img.width}x{img.height}".encode()[:16])
        for y in range(0, img.height, HASH_ROWS):
            h.update(img.crop((0, y, img.width, min(y + HASH_ROWS, img.height))).tobytes())
        pad = vocab_size + int.from_bytes(h.digest(), "little") % (1 << PAD_BITS)
        pixels, tokens, grid = processor(img)
    finally:
        img.close()  # the decoded pixels go now, not when the caller drops the image
    return Image(pixels, pad, tokens, grid)
