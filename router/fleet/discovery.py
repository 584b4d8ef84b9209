"""Where the workers are: each --worker target is an address or a DNS name (a Kubernetes headless Service
gives one A record per ready worker pod), resolved again every few seconds so workers that are added,
removed or rescheduled under a new IP are found without restarting the router.

Targets follow gRPC's naming: `HOST:PORT`, or `dns://NAMESERVER[:PORT]/HOST:PORT` to ask one DNS server
directly (the system resolver, with /etc/hosts and the search domains, answers the plain form).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

# What a failed lookup raises (see resolve).
RESOLVE_ERRORS = (OSError, asyncio.TimeoutError)


@dataclass(frozen=True)
class WorkerTarget:
    host: str
    port: int
    nameserver: tuple[str, int] | None = None  # ask this DNS server instead of the system resolver

    @classmethod
    def parse(cls, text: str) -> WorkerTarget:
        """`HOST:PORT`, `[IPV6]:PORT` or `dns://NAMESERVER[:PORT]/HOST:PORT`; ValueError naming the target."""
        nameserver = None
        rest = text
        if text.startswith("dns://"):
            authority, _, rest = text.removeprefix("dns://").partition("/")
            if authority:
                nameserver = _split(authority, default_port=53, what=f"the DNS server of {text!r}")
        host, port = _split(rest, default_port=None, what=f"worker target {text!r}")
        return cls(host, port, nameserver)

    @property
    def is_address(self) -> bool:
        """An IP literal: nothing to resolve."""
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    def __str__(self) -> str:
        return _join(self.host, self.port)


def _split(text: str, default_port: int | None, what: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not port and default_port is not None:
        port = str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT with a port in 1-65535")
    return host, int(port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(target: WorkerTarget, timeout: float = 2.0) -> set[str]:
    """The target's worker addresses, `IP:PORT` each; empty when the name has no records (yet). Raises
    OSError (or a timeout) when the resolver fails."""
    if target.is_address:
        return {str(target)}
    if target.nameserver is None:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM), timeout
        )
        ips = {str(info[4][0]) for info in infos}  # an IPv4 or IPv6 address (str already)
        # A name with both families (localhost) is one worker, not two: keep IPv4 when there is any.
        v4 = {ip for ip in ips if ":" not in ip}
        return {_join(ip, target.port) for ip in (v4 or ips)}
    # dnspython only for a target that names its DNS server: it costs a router's start 0.1 s to import
    import dns.asyncresolver
    import dns.exception
    import dns.resolver

    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [target.nameserver[0]]
    resolver.port = target.nameserver[1]
    resolver.lifetime = timeout
    try:
        answer = await resolver.resolve(target.host, "A")
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return set()
    except dns.exception.DNSException as exc:
        raise OSError(f"DNS server {target.nameserver[0]}:{target.nameserver[1]} failed: {exc}") from exc
    return {_join(record.address, target.port) for record in answer}
