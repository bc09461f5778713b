"""Where an image's bytes come from: its URL in a chat's image_url part.

- `data:image/<format>;base64,<data>`: always taken (the request carries the image).
- `file://<path>`: read from the worker's disk, only under the folder the operator names
  (`image_file_root`; off by default). Symlinks are resolved before the check, so a link
  cannot lead out of the folder.
- `http(s)://`: fetched by the worker, only from the hosts the operator names
  (`image_http_hosts`; off by default), redirects included, within a size and a time limit,
  under the SSRF rule of hosts.py (an entry is `host`, `host:port` or `*`; `*` lets in
  public addresses only). A fetch that cannot connect reads the same whatever the reason,
  so errors do not map the network. The API never fetches: it only checks the URL's form.

A URL that cannot be read raises ImageError, which fails its item alone.
"""
from __future__ import annotations

import base64
import binascii
import os
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from .hosts import Hosts, Refused

FETCH_THREADS = 16  # concurrent fetches of one job's images


class ImageError(ValueError):
    """An image that cannot be used: its item fails with this message."""


@dataclass(frozen=True, slots=True)
class ImageSources:
    file_root: str | None = None
    http_hosts: tuple[str, ...] = ()
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0
    # The SSRF rule over http_hosts, derived from it.
    hosts: Hosts = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", Hosts(self.http_hosts, "--image-http-hosts"))
        if self.file_root is not None and not os.path.isdir(self.file_root):
            raise ValueError(f"image_file_root: {self.file_root!r} is not a folder")
        if self.max_bytes < 1:
            raise ValueError(f"image_max_bytes: must be >= 1, got {self.max_bytes}")
        if not 0 < self.timeout_s <= 600:
            raise ValueError(f"image_fetch_timeout: must be in (0, 600] seconds, got {self.timeout_s}")

    @property
    def schemes(self) -> list[str]:
        """The URL schemes taken (announced with the worker's model, checked by the API)."""
        return (["data"] + ["file"] * (self.file_root is not None)
                + ["http", "https"] * bool(self.http_hosts))

    def read(self, url: str) -> bytes:
        """The image's encoded bytes, or ImageError."""
        scheme = url.partition(":")[0].lower()
        if scheme == "data":
            return _data(url)
        if scheme not in self.schemes:
            raise ImageError(f"{scheme}: image URLs are not taken by this worker (it takes "
                             f"{', '.join(self.schemes)}){_HOW.get(scheme, '')}")
        return self._file(url) if scheme == "file" else self._http(url)

    def read_all(self, urls: list[str]) -> dict[str, bytes | ImageError]:
        """Each distinct URL read once; remote ones fetched concurrently, so one job waits
        about one fetch's time, not the sum of its images'."""
        urls = list(dict.fromkeys(urls))
        if len(urls) < 2 or sum(not u.startswith("data:") for u in urls) < 2:
            return {u: _try(self.read, u) for u in urls}
        with ThreadPoolExecutor(min(FETCH_THREADS, len(urls))) as pool:
            return dict(zip(urls, pool.map(lambda u: _try(self.read, u), urls)))

    def _file(self, url: str) -> bytes:
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ImageError(f"file URL {_short(url)}: only local paths (file:///...) are taken")
        path = os.path.realpath(urllib.parse.unquote(parts.path))
        root = os.path.realpath(self.file_root)
        if os.path.commonpath([root, path]) != root:
            raise ImageError(f"file URL {_short(url)}: outside the allowed folder")
        if not os.path.isfile(path):  # not a FIFO or a device, whose read may never end
            raise ImageError(f"file URL {_short(url)}: no such file")
        try:
            with open(path, "rb") as f:
                data = f.read(self.max_bytes + 1)
        except OSError as e:
            raise ImageError(f"file URL {_short(url)}: {e.strerror or type(e).__name__}") from None
        if len(data) > self.max_bytes:
            raise ImageError(f"file URL {_short(url)}: larger than {self.max_bytes} bytes")
        return data

    def _http(self, url: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        try:
            with self.hosts.client(self.timeout_s, follow_redirects=True) as client:
                with client.stream("GET", url) as r:
                    if r.status_code != 200:
                        raise ImageError(f"image URL {_short(url)}: HTTP {r.status_code}")
                    size = r.headers.get("content-length")
                    if size and size.isdigit() and int(size) > self.max_bytes:
                        raise ImageError(f"image URL {_short(url)}: larger than {self.max_bytes} bytes")
                    data = bytearray()
                    for chunk in r.iter_bytes():
                        data += chunk
                        if len(data) > self.max_bytes:
                            raise ImageError(f"image URL {_short(url)}: larger than "
                                             f"{self.max_bytes} bytes")
                        if time.monotonic() > deadline:  # httpx's timeout is per read
                            raise httpx.ReadTimeout("deadline")
                    return bytes(data)
        except Refused as e:  # from the check of a hop (it names the URL) or from connecting
            shown = str(e) if str(e).startswith(_short(url)) else f"{_short(url)}: {e}"
            raise ImageError(f"image URL {shown}") from None
        except ImageError:
            raise
        except httpx.TimeoutException:
            raise ImageError(f"image URL {_short(url)}: not fetched within {self.timeout_s:g} s") from None
        except httpx.TooManyRedirects:
            raise ImageError(f"image URL {_short(url)}: too many redirects") from None
        except httpx.TransportError:  # refused, reset, unreachable: one text for all of them
            raise ImageError(f"image URL {_short(url)}: {UNREACHABLE}") from None
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
            raise ImageError(f"image URL {_short(url)}: {type(e).__name__}: {e}") from None


UNREACHABLE = "could not be fetched (no connection)"


# How an operator turns a scheme on (the worker's flags; env in docs/engine.md, "Images").
_HOW = {"file": "; the operator allows file URLs with --image-file-root",
        "http": "; the operator allows fetching with --image-http-hosts",
        "https": "; the operator allows fetching with --image-http-hosts"}


def _data(url: str) -> bytes:
    head, sep, data = url.partition(",")
    if not (sep and head.startswith("data:image/") and head.endswith(";base64")):
        raise ImageError("a data URL must be data:image/<format>;base64,<data>")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data URL is not valid base64") from None


def _try(read, url: str) -> bytes | ImageError:
    try:
        return read(url)
    except ImageError as e:
        return e


def _short(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."
