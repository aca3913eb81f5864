"""Where a webhook may be sent: only http(s) URLs, and, unless the operator allows private
addresses (`webhook_allow_private`), only to hosts whose every address is public.

The API checks an endpoint's URL when it is created; the worker looks the host up again before
every attempt and connects to the address it checked (a name that later resolves to a private
address, DNS rebinding, is refused there, not followed)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_URL_CHARS = 2048
SCHEMES = ("http", "https")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class UrlRefused(ValueError):
    """The URL (or the address its host resolves to) may not receive webhooks."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # as written in the URL (no brackets for IPv6)
    port: int


def parse(url: str) -> Target:
    """The scheme, host and port of an acceptable URL; UrlRefused says why not."""
    if len(url) > MAX_URL_CHARS:
        raise UrlRefused(f"must be at most {MAX_URL_CHARS} characters")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise UrlRefused("must not contain whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UrlRefused(f"is not a valid URL ({exc})") from exc
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise UrlRefused("must be an http:// or https:// URL")
    if not parts.hostname:
        raise UrlRefused("must name a host")
    if parts.username is not None or parts.password is not None:
        raise UrlRefused("must not carry credentials")
    return Target(scheme, parts.hostname, port or (443 if scheme == "https" else 80))


# IPv6 forms that carry an IPv4 address a router may deliver to (RFC 6052's well-known NAT64
# prefix, SIIT's IPv4-translated addresses); 6to4, Teredo and IPv4-mapped ones are unwrapped by
# ipaddress itself, and the deprecated IPv4-compatible ::a.b.c.d below.
_NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")
# Only global unicast IPv6 is a webhook destination: this also refuses the local-use NAT64
# prefix (64:ff9b:1::/48), whose IPv4 address sits where no single rule can read it.
_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses ``address`` carries (IPv4-mapped, IPv4-compatible, IPv4-translated,
    6to4, Teredo's server and client, NAT64): a packet to it may reach them."""
    found: list[ipaddress.IPv4Address] = []
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if int(address) >> 32 == 0 or address in _IPV4_TRANSLATED or address in _NAT64_WELL_KNOWN:
        found.append(low32)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    return found


def is_public(address: IPAddress) -> bool:
    """False for private, loopback, link-local, multicast, reserved and unspecified addresses
    and anything else not globally routable. An IPv6 address that carries IPv4 addresses
    (:func:`embedded_ipv4`) is public only when each of them is; any other IPv6 address must
    also be global unicast (2000::/3)."""
    if isinstance(address, ipaddress.IPv6Address):
        carried = embedded_ipv4(address)
        if carried:
            return all(is_public(ipv4) for ipv4 in carried)
        if address not in _GLOBAL_UNICAST:
            return False
    return not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or not address.is_global
    )


def resolve(target: Target) -> list[IPAddress]:
    """Every address the host stands for (a literal address is itself)."""
    try:
        return [ipaddress.ip_address(target.host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UrlRefused(f"host {target.host!r} does not resolve ({exc})") from exc
    found: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in found:
            found.append(address)
    if not found:
        raise UrlRefused(f"host {target.host!r} does not resolve")
    return found


def public_address(target: Target) -> IPAddress:
    """The address to connect to: the host's first, once every address it has is public."""
    addresses = resolve(target)
    private = [str(a) for a in addresses if not is_public(a)]
    if private:
        raise UrlRefused(
            f"host {target.host!r} is or resolves to a non-public address ({', '.join(private)})"
        )
    return addresses[0]


def check(url: str, *, allow_private: bool) -> Target:
    """The URL's target, refused (UrlRefused) when it may not receive webhooks."""
    target = parse(url)
    if not allow_private:
        public_address(target)
    return target
