"""Image inputs: a data URL -> the pixel tensor a vision tower takes, and the id that keys
the image's tokens in the radix cache.

Preprocessing is the CLIP image processor's, read from the model folder's
preprocessor_config.json (or transformers 5's processor_config.json): convert to RGB, resize
the shortest edge (PIL, the configured resample), center crop, rescale, normalize. PIL and
torch only; equal to transformers' own processor (tests/test_multimodal.py).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
from dataclasses import dataclass

import torch

# Larger images are refused before decoding (PIL reads the size from the header): 8192 x 8192
# is far above any CLIP input and keeps one decode under ~200 MiB of RGB.
MAX_IMAGE_PIXELS = 8192 * 8192
FORMATS = ("PNG", "JPEG", "WEBP")
PAD_BITS = 48  # pad ids: vocab_size + a 48-bit content hash, so never a real token id


class ImageError(ValueError):
    """An image that cannot be used: its item fails with this message."""


@dataclass(frozen=True, slots=True, eq=False)
class Image:
    """One preprocessed image of a prompt."""
    pixels: torch.Tensor  # [3, H, W] float32, normalized
    pad: int  # the id its tokens have in the prompt: vocab_size + hash of its content


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Where an image's tokens sit in a prompt: positions [start, start + length)."""
    start: int
    length: int
    image: Image


def decode_data_url(url: str):
    """A `data:image/...;base64,` URL -> an RGB PIL image, or ImageError."""
    from PIL import Image as PILImage

    head, sep, data = url.partition(",")
    if not (sep and head.startswith("data:image/") and head.endswith(";base64")):
        raise ImageError("only data:image/...;base64 URLs are supported")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data URL is not valid base64") from None
    try:
        img = PILImage.open(io.BytesIO(raw), formats=FORMATS)
    except Exception as e:
        raise ImageError(f"not a decodable PNG, JPEG or WebP image ({type(e).__name__})") from None
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS:
        raise ImageError(f"image is {w}x{h} pixels; at most {MAX_IMAGE_PIXELS} are allowed")
    try:
        return img.convert("RGB")  # decodes the pixels
    except Exception as e:
        raise ImageError(f"the image data is corrupt ({type(e).__name__}: {e})") from None


@dataclass(frozen=True, slots=True)
class ImageProcessor:
    shortest_edge: int
    crop: tuple[int, int]  # (height, width)
    resample: int  # PIL's filter number (3: bicubic)
    rescale: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_dir(cls, path: str) -> ImageProcessor:
        pre, proc = (os.path.join(path, f) for f in ("preprocessor_config.json", "processor_config.json"))
        if os.path.isfile(pre):
            with open(pre) as f:
                raw = json.load(f)
        elif os.path.isfile(proc):
            with open(proc) as f:
                raw = json.load(f).get("image_processor", {})
        else:
            raise FileNotFoundError(f"no image processor config in {path}: expected {pre}")
        size, crop = raw.get("size", {}), raw.get("crop_size", {})
        flags = ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb")
        if not all(raw.get(k, True) for k in flags) or "shortest_edge" not in size:
            raise ValueError(f"{path}: only the CLIP image processor (resize the shortest edge, "
                             "center crop, rescale, normalize) is supported")
        crop = (crop["height"], crop["width"]) if isinstance(crop, dict) else (crop, crop)
        if size["shortest_edge"] < max(crop):
            raise ValueError(f"{path}: crop_size {crop} larger than the resized image "
                             f"(shortest edge {size['shortest_edge']}) is not supported")
        return cls(size["shortest_edge"], crop, raw.get("resample", 3),
                   raw.get("rescale_factor", 1 / 255), tuple(raw["image_mean"]),
                   tuple(raw["image_std"]))

    def __call__(self, img) -> torch.Tensor:
        """An RGB PIL image -> [3, crop_h, crop_w] float32."""
        w, h = img.size
        # transformers' shortest-edge rule: the long edge truncated, not rounded.
        short, long = (w, h) if w <= h else (h, w)
        long = int(self.shortest_edge * long / short)
        size = (self.shortest_edge, long) if w <= h else (long, self.shortest_edge)
        img = img.resize(size, resample=self.resample)
        ch, cw = self.crop
        top, left = (img.height - ch) // 2, (img.width - cw) // 2
        img = img.crop((left, top, left + cw, top + ch))
        x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(ch, cw, 3)
        # Rescale in float64 then cast, as transformers does.
        x = (x.permute(2, 0, 1).double() * self.rescale).float()
        mean = torch.tensor(self.mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.std, dtype=torch.float32)[:, None, None]
        return (x - mean) / std


def load_image(url: str, processor: ImageProcessor, vocab_size: int) -> Image:
    """Decode and preprocess one image; its pad id hashes its decoded pixels and size, so the
    same pixels in another (lossless) container share their cached prefix."""
    img = decode_data_url(url)
    digest = hashlib.blake2b(img.tobytes(), digest_size=8,
                             person=f"{img.width}x{img.height}".encode()[:16]).digest()
    pad = vocab_size + int.from_bytes(digest, "little") % (1 << PAD_BITS)
    return Image(processor(img), pad)
