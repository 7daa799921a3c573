"""Instances by name: `host:port` entries whose host is a DNS name stand for one instance per address it resolves
to (a Kubernetes headless service: one A/AAAA record per ready pod). The router's instance pools
(router/instances.py) and the prefill worker's `--decode-allowlist` watch their entries with one `Discovery` each.

1. An entry whose host is an IP literal is one address, always (no lookup: `tandem up`'s lists, static setups).
2. A name is resolved (`Resolver`: the system's getaddrinfo in a thread, or `--dns-server`'s, serving/dns.py) at
   start and every `refresh_interval_s` after (0: once); its addresses are `ip:port` with the entry's port. Several
   names may share addresses: each address counts once.
3. What a lookup can say, and what the set of addresses becomes:
   - addresses: exactly these (the new ones join, the vanished ones leave);
   - none (NXDOMAIN, no records): the name has no instances now; logged once (a warning) until that changes;
   - failure (timeout, SERVFAIL, the resolver's own error): nothing is known, so the last good set stays; logged
     once (a warning) when the lookups start failing, and once when they work again.
4. When the set changed, `on_change(addresses)` is called with the new address -> entry map (the entry says which
   name an address came from: logs, TLS names). Lookups never block the event loop.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from serving import dns

log = logging.getLogger("tandem.discovery")

Resolver = Callable[[str], Awaitable[list[str]]]
"""host name -> its IP addresses, [] when it has none; raises LookupFailed when the lookup itself failed."""


class LookupFailed(Exception):
    """A lookup got no answer about the name (timeout, SERVFAIL, no server): nothing is known about it."""


# getaddrinfo's "this name has no addresses" (as opposed to "could not find out": EAI_AGAIN, EAI_FAIL).
_NO_ADDRESSES = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME),
                 getattr(socket, "EAI_ADDRFAMILY", socket.EAI_NONAME)}


async def system_resolver(name: str) -> list[str]:
    """The system's answer (/etc/hosts, resolv.conf, nsswitch), from getaddrinfo in the loop's executor."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in _NO_ADDRESSES:
            return []
        raise LookupFailed(e.strerror or str(e)) from None
    return list(dict.fromkeys(info[4][0] for info in infos))


def server_resolver(server: str) -> Resolver:
    """A resolver that asks the DNS server at `server` ("host:port", an IP literal host) over UDP (TCP when the
    answer is truncated): serving/dns.py."""
    host, port = split_host_port(server, "--dns-server")
    if not is_ip(host):
        raise ValueError(f"--dns-server={server!r}: the host must be an IP address (a name would need a resolver)")

    async def resolve(name: str) -> list[str]:
        try:
            return await dns.resolve((host, port), name)
        except dns.DnsError as e:
            raise LookupFailed(str(e)) from None

    return resolve


def split_host_port(entry: str, what: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ValueError names `what` (the flag) and the entry."""
    host, _, port = entry.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}={entry!r}: must be host:port with a port in 1..65535")
    if not is_ip(host):
        try:
            dns.encode_name(host)
        except ValueError as e:
            raise ValueError(f"{what}={entry!r}: {e}") from None
    return host, int(port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def join_host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def entry_host(entry: str) -> str:
    """The host an entry names (the name TLS checks a resolved address's certificate against)."""
    return split_host_port(entry, "entry")[0]


@dataclass(frozen=True)
class DiscoveryConfig:
    """How names in instance lists are resolved (the router's --prefill/--decode, prefill's --decode-allowlist)."""
    refresh_interval_s: float = 5.0
    """Seconds between lookups of each name: new addresses join, vanished ones leave (0: resolve once, at start).
    The default is about how long Kubernetes takes to publish a pod's endpoint change."""
    dns_server: str | None = None
    """host:port of a DNS server to ask instead of the system resolver (tests, a registry on its own port)."""

    def __post_init__(self) -> None:
        if not self.refresh_interval_s >= 0:
            raise ValueError(f"--dns-refresh-interval={self.refresh_interval_s}: must be >= 0 (0: resolve once)")
        if self.dns_server is not None:
            server_resolver(self.dns_server)  # (checked here: a bad value is a usage error)

    def resolver(self) -> Resolver:
        return system_resolver if self.dns_server is None else server_resolver(self.dns_server)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "DiscoveryConfig":
        return cls(ns.dns_refresh_interval, ns.dns_server)


def add_discovery_args(p: argparse.ArgumentParser) -> None:
    """The flags of DiscoveryConfig (router, prefill; declared once, here)."""
    d = DiscoveryConfig()
    p.add_argument("--dns-refresh-interval", type=float, default=d.refresh_interval_s, metavar="SECONDS",
                   help="entries whose host is a DNS name (a headless service) are one instance per address it "
                        "resolves to, looked up again this often: new addresses join, vanished ones leave (0: "
                        f"once, at start; default: {d.refresh_interval_s:g})")
    p.add_argument("--dns-server", default=None, metavar="IP:PORT",
                   help="ask this DNS server for those names instead of the system resolver (default: the system's)")


LOOKUP_TIMEOUT_S = 10.0  # one lookup's bound (getaddrinfo has none of its own): then it counts as failed


@dataclass
class _Name:
    entry: str
    host: str
    port: int
    addresses: list[str] | None = None  # the last good answer, as ip:port (None: never resolved)
    failing: str = ""  # why the lookups fail, since they started to ("": the last one worked)


@dataclass
class Discovery:
    """The addresses a list of host:port entries stands for, now (`addresses`), kept up to date (module docstring)."""
    what: str
    """Whose entries these are, for logs ("decode", "--decode-allowlist")."""
    entries: list[str]
    """host:port entries; a host is an IP literal (one address) or a name (its addresses)."""
    config: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    resolver: Resolver | None = None
    """How names are resolved (default: the config's: the system resolver, or --dns-server's)."""
    on_change: Callable[[dict[str, str]], None] | None = None
    """Called with the new address -> entry map when the addresses changed."""

    def __post_init__(self) -> None:
        self.resolver = self.resolver or self.config.resolver()
        self._static: dict[str, str] = {}
        self._names: list[_Name] = []
        for entry in self.entries:
            host, port = split_host_port(entry, self.what)
            if is_ip(host):
                self._static.setdefault(join_host_port(str(ipaddress.ip_address(host)), port), entry)
            else:
                self._names.append(_Name(entry, host, port))
        self.addresses: dict[str, str] = dict(self._static)  # address -> the entry it came from
        self._task: asyncio.Task | None = None
        self._refreshing: asyncio.Task | None = None
        self.last_refresh = float("-inf")  # loop time the last lookups started

    @property
    def dynamic(self) -> bool:
        return bool(self._names)

    async def start(self) -> None:
        """The first lookups (unless a refresh ran already); then, with an interval, the refreshes in the
        background."""
        if self.last_refresh == float("-inf"):
            await self.refresh()
        if self._names and self.config.refresh_interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        for task in (self._task, self._refreshing):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the refreshes must go on
                log.exception("%s: refresh failed", self.what)

    async def refresh(self) -> bool:
        """Looks every name up again (one refresh at a time: a caller during one waits for it); whether the
        addresses changed."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._refresh())
        return await asyncio.shield(self._refreshing)

    async def refresh_if_older(self, age_s: float) -> bool:
        """refresh() unless the last one started less than age_s ago (then: whether one in flight changed them)."""
        if asyncio.get_running_loop().time() - self.last_refresh >= age_s:
            return await self.refresh()
        if self._refreshing is not None and not self._refreshing.done():
            return await asyncio.shield(self._refreshing)
        return False

    async def _refresh(self) -> bool:
        if not self._names:
            return False
        self.last_refresh = asyncio.get_running_loop().time()
        await asyncio.gather(*(self._lookup(n) for n in self._names))
        found = dict(self._static)
        for n in self._names:
            for a in n.addresses or ():
                found.setdefault(a, n.entry)
        if found == self.addresses:
            return False
        self.addresses = found
        if self.on_change is not None:
            self.on_change(dict(found))
        return True

    async def _lookup(self, n: _Name) -> None:
        try:
            ips = await asyncio.wait_for(self.resolver(n.host), LOOKUP_TIMEOUT_S)
        except (LookupFailed, TimeoutError, OSError) as e:
            why = str(e) or f"no answer within {LOOKUP_TIMEOUT_S:g} s"
            if not n.failing:
                kept = ("nothing resolved yet" if n.addresses is None else
                        f"keeping its last {len(n.addresses)} address(es)")
                log.warning("%s %s: lookup failed (%s); %s until one works", self.what, n.entry, why, kept)
            n.failing = why
            return
        addrs = sorted(join_host_port(str(ipaddress.ip_address(ip)), n.port) for ip in ips)
        if n.failing:
            log.info("%s %s: lookups work again", self.what, n.entry)
            n.failing = ""
        if addrs != n.addresses:
            if addrs:
                log.info("%s %s resolves to %s", self.what, n.entry, ", ".join(addrs))
            else:
                log.warning("%s %s: no addresses (NXDOMAIN or no A/AAAA records): no instances from it", self.what,
                            n.entry)
        n.addresses = addrs
