"""Where remote rollouts may send requests: the model and status-log URLs callers give are checked.

A caller of `/remote/init` names the URLs sparring then POSTs to (`model_base_url`, `status_log_url`),
so unchecked they would let anyone with the route reach what the server can reach: loopback, the
private network, a cloud's metadata service. `EgressRule` refuses any URL with credentials in it and
any host that resolves to a non-public address, unless the operator listed the host (or the address)
in SPARRING_REMOTE_ALLOWED_HOSTS. `GuardedTransport` applies the rule to every request the remote's
HTTP client sends, redirects included, and connects to the very address it checked, so a name that
resolves differently the second time (DNS rebinding) reaches nothing new.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

import httpx2

from sparring.policies import RefusedExchange

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], Awaitable[list[str]]]

# IPv6 prefixes that carry an IPv4 address a gateway would forward to (NAT64).
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# The local-use NAT64 prefix (RFC 8215), not global: where the IPv4 address sits in it depends on the
# length of the prefix the operator chose, so none of it is public.
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")


class RefusedDestination(RefusedExchange):
    """A URL of a remote rollout that the egress rule refuses."""


async def system_resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, by the system's resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def is_public(address: Address) -> bool:
    """Whether `address` is on the public internet: not loopback, private, link-local (the metadata
    services' 169.254.169.254 included), shared, reserved or multicast, however it is spelled."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return is_public(address.ipv4_mapped)
        if address in _NAT64:
            return is_public(ipaddress.IPv4Address(address.packed[-4:]))
        if address in _NAT64_LOCAL:
            return False
        if address.sixtofour is not None:  # 2002:AABB:CCDD::/48, relayed to the IPv4 address AA.BB.CC.DD
            return is_public(address.sixtofour)
    return address.is_global and not address.is_multicast


def _address(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])  # an IPv6 zone id is not part of the address
    except ValueError:
        return None


class EgressRule:
    """The check of a remote rollout's URLs: `allowed` hosts (names or addresses) pass, others must
    resolve to public addresses only."""

    def __init__(self, allowed: Iterable[str] = (), *, resolve: Resolve = system_resolve) -> None:
        self.allowed_names: set[str] = set()
        self.allowed_addresses: set[Address] = set()
        for host in allowed:
            address = _address(host.strip("[]"))
            if address is not None:
                self.allowed_addresses.add(address)
            else:
                self.allowed_names.add(host.lower().rstrip("."))
        self.resolve = resolve

    def check_url(self, url: str, what: str) -> None:
        """Refuse, before any lookup, what is wrong in the URL itself (BadRequest-worthy)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RefusedDestination(f"the {what} must be an http(s) URL with a host")
        if parts.username is not None or parts.password is not None:
            raise RefusedDestination(f"the {what} must not carry credentials (user:password@)")

    async def address_for(self, host: str, port: int, what: str) -> str | None:
        """The checked address to connect to for `host`, or None to connect to `host` as it is (a host
        the operator listed by name). Raises `RefusedDestination` before any connection is made."""
        name = host.lower().rstrip(".")
        if name in self.allowed_names:
            return None
        literal = _address(name.strip("[]"))
        if literal is not None:
            candidates = [literal]
        else:
            try:
                resolved = await self.resolve(name, port)
            except OSError as exc:
                raise RefusedDestination(f"the host of the {what} does not resolve") from exc
            candidates = [a for a in (_address(text) for text in resolved) if a is not None]
            if not candidates:
                raise RefusedDestination(f"the host of the {what} does not resolve")
        for address in candidates:
            if address not in self.allowed_addresses and not is_public(address):
                # The address stays out of the message: it would tell callers about the inside network.
                raise RefusedDestination(
                    f"the {what} reaches a non-public address; an operator may allow its host in "
                    "SPARRING_REMOTE_ALLOWED_HOSTS"
                )
        return str(candidates[0])

    async def check(self, url: str, what: str) -> None:
        """The whole check of one URL, as `/remote/init` runs it on what a caller sends."""
        self.check_url(url, what)
        parts = urlsplit(url)
        assert parts.hostname is not None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        await self.address_for(parts.hostname, port, what)


class GuardedTransport(httpx2.AsyncBaseTransport):
    """Applies an `EgressRule` to every request (each redirect is a request too), then sends it to the
    address that was checked, keeping the host's name for the `Host` header and TLS."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, rule: EgressRule) -> None:
        self.inner = inner
        self.rule = rule

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        self.rule.check_url(str(url), "remote rollout's URL")
        port = url.port or (443 if url.scheme == "https" else 80)
        address = await self.rule.address_for(url.host, port, "remote rollout's URL")
        if address is not None and address != url.host:
            request.extensions = {**request.extensions, "sni_hostname": url.host}
            request.url = url.copy_with(host=address)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()
