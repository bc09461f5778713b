"""Outbound HTTP to the hosts an operator allows, and only there: the one SSRF rule of the
worker's image fetches (image_urls.py) and the API's webhooks (api/webhooks.py).

An allow-list entry is `host` (ports 80 and 443 only), `host:port`, or `*` (any host, ports
80 and 443 only). A host `*` lets in is refused when it resolves to a loopback, private,
link-local or other non-public address (the operator's own network): only a host named
exactly may be one. The check is made on the addresses the socket then connects to (not
a second lookup), so a DNS answer that changes in between cannot lead elsewhere, and again
on every redirect. A connection that fails reads the same whatever the reason, so errors
do not map the network.
"""
from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass, field

import httpcore
import httpx

DEFAULT_PORTS = (80, 443)  # what an entry without a port allows
UNREACHABLE = "could not be reached (no connection)"


class Refused(ValueError):
    """A host or an address the list does not allow (also raised where the socket connects)."""


def host_port(entry: str, setting: str) -> tuple[str, int | None]:
    """An allow-list entry -> (host lowercased, its port or None for the default ones);
    ValueError naming `setting` if it is not host[:port]."""
    if entry == "*":
        return "*", None
    try:
        parts = urllib.parse.urlsplit("//" + entry)
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or parts.path or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{setting}: {entry!r} is not host, host:port or *")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"{setting}: {entry!r}: the port must be in 1-65535")
    return host, port


def public(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_global and not addr.is_multicast


@dataclass(frozen=True, slots=True)
class Hosts:
    """The allowed hosts; `setting` names the flag or variable that sets them, in errors."""
    entries: tuple[str, ...] = ()
    setting: str = "the allowed hosts"
    # (host, port or None) per entry, derived from entries.
    _allowed: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_allowed", frozenset(host_port(e, self.setting) for e in self.entries))

    def named(self, host: str, port: int) -> bool:
        """Whether the list names this host for this port (then it may be any address)."""
        host = host.lower()
        return (host, port) in self._allowed or (port in DEFAULT_PORTS and (host, None) in self._allowed)

    def allows(self, host: str, port: int) -> bool:
        """Whether a URL of host:port may be reached at all (its addresses are checked at
        connect time: `addresses`)."""
        return self.named(host, port) or (port in DEFAULT_PORTS and ("*", None) in self._allowed)

    def check_url(self, url: str) -> None:
        """Refused unless `url` is http(s) to a host:port the list allows (its addresses are
        checked when it is reached)."""
        u = httpx.URL(url)
        if u.scheme not in ("http", "https") or not u.host:
            raise Refused(f"{_short(url)}: not an http(s) URL")
        port = u.port or (443 if u.scheme == "https" else 80)
        if not self.allows(u.host, port):
            shown = u.host if u.port is None else f"{u.host}:{u.port}"
            raise Refused(f"{_short(url)}: {shown!r} is not among the allowed hosts ({self.setting}; "
                          "an entry without a port allows 80 and 443)")

    def addresses(self, host: str, port: int) -> list[str]:
        """The addresses to connect to for host:port: all of them if the host is named,
        else only if every one is public (Refused otherwise)."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise Refused(UNREACHABLE) from None
        ips = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not self.named(host, port) and not all(public(ip) for ip in ips):
            raise Refused(f"host {host!r} is not a public address; only hosts named in "
                          f"{self.setting} may be loopback, private or link-local")
        return ips

    def client(self, timeout_s: float, follow_redirects: bool) -> httpx.Client:
        """An httpx client that reaches only what this list allows, every redirect checked."""
        def allowed(request) -> None:
            self.check_url(str(request.url))

        return httpx.Client(transport=_Transport(self), follow_redirects=follow_redirects, max_redirects=5,
                            timeout=timeout_s, event_hooks={"request": [allowed]}, trust_env=False)


class _Connect(httpcore.SyncBackend):
    """Connects to the addresses Hosts.addresses checked, not to a second lookup's."""

    def __init__(self, hosts: Hosts):
        self.hosts = hosts

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        last = None
        for ip in self.hosts.addresses(host, port):
            try:
                return super().connect_tcp(ip, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as e:
                last = e
        raise last or httpcore.ConnectError(UNREACHABLE)


class _Transport(httpx.HTTPTransport):
    """httpx's transport on a pool that connects through _Connect (TLS still checks the
    URL's host name). httpx has no public way to give a pool its network backend."""

    def __init__(self, hosts: Hosts):
        super().__init__(trust_env=False)
        self._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(trust_env=False),
                                             network_backend=_Connect(hosts))


def _short(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."
