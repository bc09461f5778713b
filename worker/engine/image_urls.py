"""Where an image's bytes come from: its URL in a chat's image_url part.

- `data:image/<format>;base64,<data>`: always taken (the request carries the image).
- `file://<path>`: read from the worker's disk, only under the folder the operator names
  (`image_file_root`; off by default). Symlinks are resolved before the check, so a link
  cannot lead out of the folder.
- `http(s)://`: fetched by the worker, only from the hosts the operator names
  (`image_http_hosts`; off by default), redirects included, within a size and a time limit.
  An entry is `host` (ports 80 and 443 only), `host:port`, or `*` (any host, ports 80 and
  443 only). A host `*` lets in is refused when it resolves to a loopback, private,
  link-local or other non-public address (the operator's own network): only a host named
  exactly may be one. The check is made on the addresses the socket then connects to (not
  a second lookup), so a DNS answer that changes in between cannot lead elsewhere, and again
  on every redirect. A fetch that cannot connect reads the same whatever the reason, so
  errors do not map the network. The API never fetches: it only checks the URL's form.

A URL that cannot be read raises ImageError, which fails its item alone.
"""
from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import socket
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpcore
import httpx

FETCH_THREADS = 16  # concurrent fetches of one job's images
DEFAULT_PORTS = (80, 443)  # what an entry without a port allows


class ImageError(ValueError):
    """An image that cannot be used: its item fails with this message."""


class _Refused(ImageError):
    """Raised where the socket connects, which does not know the URL."""


def host_port(entry: str) -> tuple[str, int | None]:
    """An allow-list entry -> (host lowercased, its port or None for the default ones);
    ValueError naming it if it is not host[:port]."""
    if entry == "*":
        return "*", None
    try:
        parts = urllib.parse.urlsplit("//" + entry)
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or parts.path or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"image_http_hosts: {entry!r} is not host, host:port or *")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"image_http_hosts: {entry!r}: the port must be in 1-65535")
    return host, port


def _public(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_global and not addr.is_multicast


@dataclass(frozen=True, slots=True)
class ImageSources:
    file_root: str | None = None
    http_hosts: tuple[str, ...] = ()
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0
    # (host, port or None) per entry of http_hosts, derived from it.
    _allowed: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_allowed", frozenset(host_port(e) for e in self.http_hosts))
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

    def named(self, host: str, port: int) -> bool:
        """Whether the list names this host for this port (then it may be any address)."""
        host = host.lower()
        return (host, port) in self._allowed or (port in DEFAULT_PORTS and (host, None) in self._allowed)

    def allows(self, host: str, port: int) -> bool:
        """Whether a URL of host:port may be fetched at all (its addresses are checked at
        connect time: `addresses`)."""
        return self.named(host, port) or (port in DEFAULT_PORTS and ("*", None) in self._allowed)

    def addresses(self, host: str, port: int) -> list[str]:
        """The addresses to connect to for host:port: all of them if the host is named,
        else only if every one is public (ImageError otherwise)."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise _Refused(UNREACHABLE) from None
        ips = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not self.named(host, port) and not all(_public(ip) for ip in ips):
            raise _Refused(f"host {host!r} is not a public address; only hosts named in "
                           "--image-http-hosts may be loopback, private or link-local")
        return ips

    def _http(self, url: str) -> bytes:
        def allowed(request) -> None:  # every hop, redirects included
            u = request.url
            if u.scheme not in ("http", "https"):
                raise ImageError(f"image URL {_short(str(u))}: not http(s)")
            port = u.port or (443 if u.scheme == "https" else 80)
            if not self.allows(u.host, port):
                shown = u.host if u.port is None else f"{u.host}:{u.port}"
                raise ImageError(f"image URL {_short(str(u))}: {shown!r} is not among the allowed "
                                 "hosts (--image-http-hosts; an entry without a port allows 80 and 443)")

        deadline = time.monotonic() + self.timeout_s
        try:
            with httpx.Client(transport=_Transport(self), follow_redirects=True, max_redirects=5,
                              timeout=self.timeout_s, event_hooks={"request": [allowed]},
                              trust_env=False) as client:
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
        except _Refused as e:
            raise ImageError(f"image URL {_short(url)}: {e}") from None
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


class _Connect(httpcore.SyncBackend):
    """Connects to the addresses ImageSources.addresses checked, not to a second lookup's."""

    def __init__(self, sources: ImageSources):
        self.sources = sources

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        last = None
        for ip in self.sources.addresses(host, port):
            try:
                return super().connect_tcp(ip, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as e:
                last = e
        raise last or httpcore.ConnectError(UNREACHABLE)


class _Transport(httpx.HTTPTransport):
    """httpx's transport on a pool that connects through _Connect (TLS still checks the
    URL's host name). httpx has no public way to give a pool its network backend."""

    def __init__(self, sources: ImageSources):
        super().__init__(trust_env=False)
        self._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(trust_env=False),
                                             network_backend=_Connect(sources))


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
